import pytest
import torch

from drivetrain.rollout.weights import (
    device_buckets,
    stage_weights,
    tensor_from_bytes,
    tensor_to_bytes,
)

SHAPES = {"a": (2, 3), "b": (4,)}


def test_staging_checks_every_name_and_shape_and_copies():
    source = torch.ones(2, 3)
    staged = stage_weights([("a", source), ("b", torch.zeros(4))], SHAPES)
    source.add_(1)  # the sender may reuse its buffer once the stream moved on
    assert torch.equal(staged[0][1], torch.ones(2, 3))
    with pytest.raises(KeyError, match="unknown weight 'c'"):
        stage_weights([("a", torch.ones(2, 3)), ("c", torch.ones(1))], SHAPES)
    with pytest.raises(ValueError, match=r"has shape \(3, 2\)"):
        stage_weights([("a", torch.ones(3, 2))], SHAPES)


def test_device_buckets_copy_as_the_stream_arrives_keep_order_and_bound_size():
    shapes = {f"w{i}": (n,) for i, n in enumerate([10, 10, 30, 5, 5])}
    buffer = torch.zeros(30)  # a transport reuses its buffer for the next tensor

    def stream():
        for name, (n,) in shapes.items():
            buffer[:n] = int(name[1:]) + 1
            yield name, buffer[:n]

    buckets = list(device_buckets(stream(), shapes, "cpu", bucket_bytes=80))  # fp32: 4 B each
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    for bucket in buckets:
        for name, tensor in bucket:
            assert torch.equal(tensor, torch.full(shapes[name], int(name[1:]) + 1.0))
    assert list(device_buckets([], shapes, "cpu", 80)) == []
    assert [len(b) for b in device_buckets(stream(), shapes, "cpu", bucket_bytes=1)] == [1] * 5


def test_device_buckets_check_each_tensor_before_copying_it():
    arrived = device_buckets([("a", torch.ones(2, 3)), ("c", torch.ones(1))], SHAPES, "cpu", 8)
    with pytest.raises(KeyError, match="unknown weight 'c'"):
        list(arrived)
    with pytest.raises(ValueError, match=r"has shape \(3, 2\)"):
        list(device_buckets([("a", torch.ones(3, 2))], SHAPES, "cpu", 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), (7,)])
def test_bytes_round_trip_is_bitwise(dtype, shape):
    tensor = (torch.randn(shape) * 100).to(dtype)
    meta, data = tensor_to_bytes(tensor)
    back = tensor_from_bytes(meta, bytes(data))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("meta", "size", "error"),
    [
        ({"dtype": "load", "shape": (2,)}, 8, "'load' is not a torch dtype"),
        ({"dtype": "nonesuch", "shape": (2,)}, 8, "'nonesuch' is not a torch dtype"),
        ({"dtype": "float32", "shape": (3,)}, 8, r"shape \(3,\) is 12 bytes, got 8"),
    ],
)
@pytest.mark.fault
def test_tensor_headers_from_another_process_are_checked(meta, size, error):
    with pytest.raises(ValueError, match=error):
        tensor_from_bytes(meta, bytes(size))


def test_non_contiguous_tensors_are_sent_in_logical_order():
    tensor = torch.arange(12.0).reshape(3, 4).t()
    meta, data = tensor_to_bytes(tensor)
    assert torch.equal(tensor_from_bytes(meta, bytes(data)), tensor)


def test_streams_that_reuse_one_buffer_are_copied_as_they_arrive():
    """A transport may yield views of a buffer it overwrites for the next tensor."""
    from drivetrain.rollout.weights import collect_weights

    def reusing():
        buffer = torch.zeros(3)
        for value in (1.0, 2.0):
            buffer.fill_(value)
            yield f"w{int(value)}", buffer

    for staged in (
        collect_weights(reusing()),
        stage_weights(reusing(), {"w1": (3,), "w2": (3,)}),
    ):
        assert [t.tolist() for _, t in staged] == [[1.0] * 3, [2.0] * 3]


def test_a_tensor_the_transport_wrote_in_place_is_not_copied_onto_itself():
    """A transport that wrote a weight into the model's own tensor (``destination``) yields
    an alias of it; copying that onto itself would move every byte again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from drivetrain.rollout.weights import apply_weights, destination
    from drivetrain.runtime.request_queue import WeightUpdate

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += "copy" in func.__name__
            return func(*args, **(kwargs or {}))

    params = {"a": torch.zeros(4, 3), "b": torch.zeros(2)}
    update = WeightUpdate(1)
    written = destination(params, update, "a", (4, 3), "float32").detach()  # an alias
    with Copies():
        apply_weights([("a", written), ("b", torch.ones(2))], params, update)
    assert Copies.count == 1  # "b" only
    assert torch.equal(params["b"], torch.ones(2)) and update.changed
