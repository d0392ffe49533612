"""Parameters, gradients and optimizer state to host memory between phases, and back.

megatron's DDP keeps parameters and gradients in large contiguous buffers
(``DistributedDataParallel.buffers`` / ``expert_parallel_buffers``, each a
``_ParamAndGradBuffer`` with ``param_data`` — under the distributed optimizer — and
``grad_data``); every parameter's ``.data`` and ``.main_grad`` is a *view* into them, and the
distributed optimizer's fp32 main parameters may be views too (fp32 models) or their own tensors
(bf16/fp16 models). Moving tensors with ``.to()`` would cut those views. So we move *storages*:
each device storage is copied into a (pinned) host buffer and then resized to zero bytes, which
frees its device memory while every tensor and view of it stays the same Python object; moving
back resizes it and copies the bytes in. megatron-core does the same for its grad buffers
(``_ParamAndGradBuffer.offload_to_cpu``); its optimizer offload (``MegatronOptimizer
.offload_to_cpu``) instead rebinds ``p.data``, which would detach an fp32 model's main
parameters from the parameter buffer, so we do not use it.

A storage shared by the model and the optimizer (fp32 main parameters that are views of the
parameter buffer) moves with the model: ``optimizer=True`` alone then moves the Adam moments.
Gradients move with the model and keep their values (a caller may leave ``train_mode`` between
``forward_backward`` and ``optimizer_step``). Non-parameter module buffers (rotary frequencies)
are small and stay on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _storage_key(storage: torch.UntypedStorage) -> int:
    return storage.data_ptr()


class Offloader:
    """Which device storages belong to the model (parameters, gradient buffers) and to the
    optimizer (state, main parameters not shared with the model), and their host copies while
    offloaded. ``device``: where they live while resident."""

    def __init__(self, chunks: list[Any], optimizer: Any, device: torch.device) -> None:
        self.chunks = chunks
        self.optimizer = optimizer
        if device.type == "cuda" and device.index is None:  # tensors report cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # part ("model" / "optimizer") -> [(storage, host copy)] while that part is offloaded
        self._offloaded: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    def is_offloaded(self, part: str) -> bool:
        return part in self._offloaded

    # ---- which storages -----------------------------------------------------------------
    def _on_device(self, tensor: Any) -> bool:
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.device == self.device
            and tensor.untyped_storage().nbytes() > 0
        )

    def _model_tensors(self) -> Iterator[torch.Tensor]:
        for chunk in self.chunks:
            yield from chunk.parameters()  # views of param_data when there is one
            for buffer in [
                *getattr(chunk, "buffers", []),
                *getattr(chunk, "expert_parallel_buffers", []),
            ]:
                for data in (buffer.param_data, buffer.grad_data):
                    if data is not None:
                        yield data
            for param in chunk.parameters():  # gradients outside megatron's buffers, if any
                if param.grad is not None:
                    yield param.grad

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            torch_optimizer = getattr(inner, "optimizer", None)
            if torch_optimizer is None:  # a stub optimizer of a rank without parameters
                continue
            for group in torch_optimizer.param_groups:
                yield from group["params"]
            for state in torch_optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def _storages(self, tensors: Iterator[torch.Tensor], exclude: set[int]) -> list[Any]:
        found: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            if self._on_device(tensor):
                storage = tensor.untyped_storage()
                key = _storage_key(storage)
                if key not in exclude:
                    found.setdefault(key, storage)
        return list(found.values())

    def _part_storages(self, part: str) -> list[torch.UntypedStorage]:
        model = self._storages(self._model_tensors(), set())
        if part == "model":
            return model
        return self._storages(self._optimizer_tensors(), {_storage_key(s) for s in model})

    # ---- moving -------------------------------------------------------------------------
    def offload(self, *, model: bool, optimizer: bool) -> None:
        """Device -> host for the chosen parts (a part already on the host stays there).
        The optimizer's storages are chosen first, while the model's are still resident, so
        that shared ones are recognised as the model's."""
        parts = [p for p, on in (("optimizer", optimizer), ("model", model)) if on]
        chosen = {p: self._part_storages(p) for p in parts if p not in self._offloaded}
        pin = self.device.type == "cuda"
        for part, storages in chosen.items():
            copies = []
            for storage in storages:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.untyped_storage().copy_(storage, non_blocking=pin)
                copies.append((storage, host))
            self._offloaded[part] = copies
        if pin:  # the copies must land before the device memory is released
            torch.cuda.synchronize(self.device)
        for copies in (self._offloaded[p] for p in chosen):
            for storage, _ in copies:
                storage.resize_(0)
        if pin and chosen:
            torch.cuda.empty_cache()  # hand the freed blocks back (e.g. to a colocated rollout)

    def reload(self, *, model: bool, optimizer: bool) -> None:
        """Host -> device for the chosen parts that are offloaded."""
        pin = self.device.type == "cuda"
        for part, on in (("model", model), ("optimizer", optimizer)):
            if not on or part not in self._offloaded:
                continue
            for storage, host in self._offloaded.pop(part):
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage(), non_blocking=pin)
        if pin:
            torch.cuda.current_stream(self.device).synchronize()

    def device_bytes(self) -> dict[str, int]:
        """Resident bytes per part (what offloading would free)."""
        return {p: sum(s.nbytes() for s in self._part_storages(p)) for p in ("model", "optimizer")}
