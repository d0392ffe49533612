"""Run megatron-core 0.16 on the host (CPU, gloo): the one place that bends its CUDA assumptions.

megatron-core hard-codes CUDA in three ways, each handled here by one mechanism:

1. ``torch.cuda.current_device()`` / ``device="cuda"`` as device arguments, and the CUDA RNG
   (``torch.cuda.manual_seed``/``get_rng_state``). The modules listed in ``_HOST_MODULES`` get
   their module-level name ``torch`` rebound to :class:`_HostTorch`, a proxy that forwards
   everything to the real ``torch`` except: tensor factories map a CUDA ``device`` to the host
   (and drop ``pin_memory``), and ``torch.cuda`` becomes :class:`_HostCuda` whose
   ``current_device()`` is the CPU, whose RNG functions are the host generator's and whose
   ``synchronize()`` is a no-op. Only code *inside those megatron modules* sees the proxy.
2. ``Tensor.cuda()`` and ``Tensor.type() == 'torch.cuda.FloatTensor'`` (methods, not module
   names). The megatron callables in ``_HOST_METHOD_SCOPES`` run with those two methods
   rebound for the duration of the call only: ``cuda()`` returns the host tensor itself and
   ``type()`` reports host tensors under the CUDA type names megatron compares against.
3. The RNG tracker's private state helpers (``tensor_parallel.random._get_cuda_rng_state`` /
   ``_set_cuda_rng_state``) index ``torch.cuda.default_generators``; they are replaced by the host
   generator's state. The tracker is used even with dropout 0 (every column/row-parallel weight
   init and attention dropout region forks it), and recompute snapshots it.

``activate()`` is called by :func:`drivetrain.engine.megatron.parallel.init_parallel` only when
the engine's device is CPU; nothing imports this module on GPU runs. It is idempotent. Fusion
flags stay off on CPU (see ``model.transformer_config``): they need CUDA kernels or compile
slowly.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

# Modules whose CUDA device arguments / CUDA RNG calls are redirected (mechanism 1), with the
# megatron calls that need it. Found by running TP=2 (+SP, recompute), PP=2, virtual PP, DP=2,
# DDP + distributed optimizer, bf16 and dist_checkpointing save/load (resharded) on CPU and
# recording every call that reached the shims; a path not run here (async checkpoint save,
# fully parallel load, CUDA graphs) may need its module added.
_HOST_MODULES = (
    # GlobalMemoryBuffer.get_tensor (the sequence-parallel all-gather buffer) and
    # local_multi_tensor_l2_norm (grad norm without Apex): current_device() / device="cuda"
    "megatron.core.utils",
    # LinearWithGradAccumulationAndAsyncCommunication.backward: SP all-gather buffer on
    # current_device()
    "megatron.core.tensor_parallel.layers",
    # _gather_along_first_dim / _reduce_scatter_along_first_dim (SP): outputs on current_device()
    "megatron.core.tensor_parallel.mappings",
    # CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed: torch.cuda.manual_seed and
    # torch.cuda.get_rng_state become the host generator's
    "megatron.core.tensor_parallel.random",
    # get_default_causal_mask: torch.ones(sq, sq, device="cuda")
    "megatron.core.transformer.utils",
    # Router.gating (MoE): moves a host router weight to current_device() on every forward
    "megatron.core.transformer.moe.router",
    # RotaryEmbedding.get_emb moves inv_freq to current_device() on the first forward
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    # forward_backward_{no_pipelining,pipelining_*}: total_num_tokens on device="cuda"
    "megatron.core.pipeline_parallel.schedules",
    # create_tensor_recv_prev/next: receive buffers on current_device(); _communicate:
    # torch.cuda.synchronize() after the batched isend/irecv
    "megatron.core.pipeline_parallel.p2p_communication",
    # _ParamAndGradBuffer.__init__: the contiguous param/grad buffers of megatron's DDP
    "megatron.core.distributed.param_and_grad_buffer",
    # MegatronOptimizer / Float16OptimizerWithFloat16Params.__init__: found_inf and loss-scale
    # tensors on device='cuda'
    "megatron.core.optimizer.optimizer",
    # DistributedOptimizer.get_parameter_state_dp_zero (checkpoint gather): buffers on
    # current_device()
    "megatron.core.optimizer.distrib_optimizer",
    # get_grad_norm_fp32 / clip_grad_by_total_norm_fp32: norm and overflow tensors on 'cuda'
    "megatron.core.optimizer.clip_grads",
    # save_state_dict_async_finalize (dist_checkpointing.save): validation all-reduce tensor
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    # FileSystemWriterAsync.preload_tensors (dist_checkpointing.save): torch.cuda.synchronize()
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)

# Callables that run with host-friendly Tensor.cuda / Tensor.type (mechanism 2): module, owner
# (class name, or None for a module-level function), attribute.
_HOST_METHOD_SCOPES = (
    # LanguageModule.setup_embeddings_and_output_layer: `weight.data.cuda()` before the
    # first/last-stage all-reduce of tied embeddings (PP > 1 with tied weights)
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule",
        "setup_embeddings_and_output_layer",
    ),
    # Float16OptimizerWithFloat16Params.__init__ (bf16/fp16 without the distributed optimizer):
    # param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'] / FloatTensor
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
    # DistributedOptimizer.__init__ / _build_model_and_main_param_groups: the same type() checks
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer",
        "_build_model_and_main_param_groups",
    ),
    # DistributedOptimizer.get_parameter_state_dp_zero (checkpoint): send_tensor.cuda()
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer",
        "get_parameter_state_dp_zero",
    ),
    # clip_grad_by_total_norm_fp32: assert param.grad.type() == 'torch.cuda.FloatTensor'
    ("megatron.core.optimizer.clip_grads", None, "clip_grad_by_total_norm_fp32"),
)

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "randn_like",
    "rand_like",
)

_ACTIVE = False
_SCOPED: set[tuple[str, str | None, str]] = set()  # method scopes already wrapped


def _host_device(device: Any) -> Any:
    if isinstance(device, int):  # a CUDA ordinal
        return "cpu"
    if device is None:
        return None
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return "cpu" if kind == "cuda" else device


def _host_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA runtime
        return factory(*args, **kwargs)

    return wrapper


class _HostCuda:
    """``torch.cuda`` as megatron sees it on the host: the CPU is the current device."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        """Host ops are synchronous."""

    # the "CUDA" generator is the host generator: the RNG tracker's named states fork it
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    # Megatron-FSDP overlaps communication on side streams; host work is synchronous
    @staticmethod
    def Stream(*_: Any, **__: Any) -> _HostStream:  # torch.cuda's name
        return _HostStream()

    @staticmethod
    def current_stream(*_: Any, **__: Any) -> _HostStream:
        return _HostStream()

    @staticmethod
    def stream(*_: Any, **__: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _HostStream:
    """A CUDA stream on the host, where every op has finished when it returns: waiting on or
    for a stream has nothing to wait for."""

    def wait_stream(self, *_: Any) -> None:
        """Nothing is pending on the host."""

    def wait_event(self, *_: Any) -> None:
        """Nothing is pending on the host."""

    def synchronize(self) -> None:
        """Nothing is pending on the host."""

    def record_event(self, *_: Any) -> _HostStream:
        """The event of host work that has already happened (``wait()`` returns at once)."""
        return self

    def wait(self, *_: Any) -> None:
        """Nothing is pending on the host (as an event: see ``record_event``)."""


class _HostTorch:
    """The real ``torch`` module except for ``cuda``, ``autocast`` and the tensor factories."""

    def __init__(self) -> None:
        self.cuda = _HostCuda()
        for name in _FACTORIES:
            setattr(self, name, _host_factory(getattr(torch, name)))

    @staticmethod
    def autocast(device_type: str, *args: Any, **kwargs: Any) -> torch.autocast:
        return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    @staticmethod
    def device(kind: Any, *args: Any) -> torch.device:
        """CUDA devices are the host (Megatron-FSDP names ``f"cuda:{current_device()}"``)."""
        if isinstance(kind, str) and kind.startswith("cuda"):
            return torch.device("cpu")
        return torch.device(kind, *args)

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups skip __getattr__
        return value


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _host_tensor_methods() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor, ``Tensor.type()`` names host tensors as CUDA ones.

    Rebinds two ``torch.Tensor`` methods for the duration of one megatron call (see
    ``_HOST_METHOD_SCOPES``); nested scopes leave the outer rebinding in place."""
    real_cuda, real_type = torch.Tensor.cuda, torch.Tensor.type
    if getattr(real_cuda, "_drivetrain_host", False):
        yield
        return

    def host_cuda(self: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return self

    def host_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or self.device.type != "cpu" or self.dtype not in _CUDA_TYPE_NAMES:
            return real_type(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES[self.dtype]

    host_cuda._drivetrain_host = True  # type: ignore[attr-defined]
    torch.Tensor.cuda, torch.Tensor.type = host_cuda, host_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.type = real_cuda, real_type  # type: ignore[method-assign]


_HOST_TORCH = _HostTorch()


def _scoped(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _host_tensor_methods():
            return function(*args, **kwargs)

    return wrapper


def _wrap_in_scope(module_name: str, owner_name: str | None, attribute: str) -> None:
    module = importlib.import_module(module_name)
    owner = module if owner_name is None else getattr(module, owner_name)
    raw = inspect.getattr_static(owner, attribute)
    if isinstance(raw, classmethod):
        setattr(owner, attribute, classmethod(_scoped(raw.__func__)))
    elif isinstance(raw, staticmethod):
        setattr(owner, attribute, staticmethod(_scoped(raw.__func__)))
    else:
        setattr(owner, attribute, _scoped(raw))
    if owner_name is None:  # a function: rebind `from module import function` copies too
        package = module_name.split(".")[0]
        for other in list(sys.modules.values()):
            name = getattr(other, "__name__", "") if other is not None else ""
            if name.startswith(package) and other.__dict__.get(attribute) is raw:
                setattr(other, attribute, getattr(owner, attribute))


def _host_rng_state(*_: Any, **__: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_host_rng_state(new_state: torch.Tensor, *_: Any, **__: Any) -> None:
    torch.set_rng_state(new_state)


def extend(
    modules: Iterable[str] = (), method_scopes: Iterable[tuple[str, str | None, str]] = ()
) -> None:
    """Apply mechanisms 1 (``modules``) and 2 (``method_scopes``: module, owner, attribute) to
    megatron code outside megatron-core, such as the standalone Megatron-FSDP package.
    Idempotent: a module or callable already handled is left as it is."""
    for name in modules:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = _HOST_TORCH  # type: ignore[attr-defined]
    for scope in method_scopes:
        if scope not in _SCOPED:
            _wrap_in_scope(*scope)
            _SCOPED.add(scope)


def activate() -> None:
    """Make megatron-core CPU-safe (idempotent; call before building models)."""
    global _ACTIVE
    if _ACTIVE:
        return
    extend(_HOST_MODULES, _HOST_METHOD_SCOPES)
    # CudaRNGStatesTracker.fork / CheckpointFunction snapshot and restore "the CUDA generator"
    # through these two helpers, which index torch.cuda.default_generators
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _host_rng_state  # type: ignore[attr-defined]
    random._set_cuda_rng_state = _set_host_rng_state  # type: ignore[attr-defined]
    _ACTIVE = True
