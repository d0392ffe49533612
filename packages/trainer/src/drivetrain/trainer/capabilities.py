"""What a job asks of its plugins, checked against what they declare.

Every plugin lists its capabilities in its :class:`~drivetrain.api.plugin.PluginSpec` (read
from its light spec module, no plugin code imported); ``KNOWN_CAPABILITIES`` in the api says
what each one promises. When a job loads, the trainer adapts what it can (padded batches for an
engine without ``packed``, fixed-size micro-batches for one without ``dynamic_batch``) and
refuses the rest with one line naming the plugin, the capability and the config key that asked
for it. An engine declaring nothing still trains SFT: padded batches, fixed micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

from drivetrain.api.config import EngineConfig, MicroBatchConfig
from drivetrain.api.errors import ConfigError
from drivetrain.api.plugin import PluginSpec

T = TypeVar("T")
E = TypeVar("E", bound=EngineConfig)
DEVICE = "device:"


def require(kind: str, spec: PluginSpec, capability: str, asked_by: str) -> None:
    """Refuse ``asked_by`` (``key=value`` as the user wrote it) unless ``spec`` declares
    ``capability``."""
    if capability not in spec.capabilities:
        declared = ", ".join(sorted(spec.capabilities)) or "nothing"
        raise ConfigError(
            f"{asked_by} needs the '{capability}' capability, which {kind} {spec.name!r} does "
            f"not declare (it declares {declared})"
        )


@functools.cache
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def lists_devices(spec: PluginSpec) -> bool:
    """Whether the plugin makes a device claim at all (a ``device:*`` capability)."""
    return any(c.startswith(DEVICE) for c in spec.capabilities)


def require_adapter_reference(spec: PluginSpec, mode: str) -> None:
    """The reference that is the actor with its LoRA adapter disabled needs ``lora``
    (``mode``: ``reference.mode`` as set, ``adapter`` or ``auto``)."""
    resolved = "" if mode == "adapter" else " (the actor with its adapter disabled)"
    require("engine", spec, "lora", f"reference.mode={mode}{resolved}")


def device_of(spec: PluginSpec, requested: str, *, remote: bool) -> str | None:
    """The device kind ``requested`` means for this plugin: ``auto`` is CUDA when this machine
    has it and the plugin lists it (or lists no device at all: it then resolves ``auto`` to
    the GPU itself), else the CPU; ``None`` when the ranks run on a Ray cluster this process
    cannot see (``remote``) and only they can tell."""
    if requested != "auto":
        return requested.partition(":")[0]
    if remote:
        return None
    takes_cuda = DEVICE + "cuda" in spec.capabilities or not lists_devices(spec)
    return "cuda" if takes_cuda and _cuda_available() else "cpu"


def check_device(kind: str, spec: PluginSpec, key: str, requested: str, *, remote: bool) -> None:
    """Refuse a device the plugin does not list. A plugin listing no ``device:*`` makes no
    device claim and is not refused."""
    device = device_of(spec, requested, remote=remote)
    if device is None or not lists_devices(spec):
        return
    shown = f"{key}={requested}" + (f" ({device} on this machine)" if requested == "auto" else "")
    require(kind, spec, DEVICE + device, shown)


def fixed_micro_batch(
    spec: PluginSpec, key: str, micro: MicroBatchConfig, job_micro: MicroBatchConfig, longest: int
) -> MicroBatchConfig:
    """``micro`` for an engine: a token budget only where it declares ``dynamic_batch``.

    Without it, the job's own budget (``job_micro``: its defaults and built-in file) becomes
    as many samples per micro-batch as fit in it at the longest a sample may be (``longest``
    tokens), the same peak; a budget the user set (``micro`` differs from ``job_micro``) is
    refused."""
    if micro.max_tokens is None or "dynamic_batch" in spec.capabilities:
        return micro
    if micro != job_micro:
        require("engine", spec, "dynamic_batch", f"{key}.max_tokens={micro.max_tokens}")
    return MicroBatchConfig(micro_batch_size=max(1, micro.max_tokens // longest))


def pinned_device(spec: PluginSpec, requested: str, *, remote: bool) -> str:
    """``requested``, but the CPU where ``auto`` would give an engine or rollout (which resolve
    ``auto`` themselves) an accelerator of this machine that the plugin does not list."""
    claims = lists_devices(spec)
    if requested != "auto" or remote or not claims or DEVICE + "cuda" in spec.capabilities:
        return requested
    return "cpu" if _cuda_available() else requested


def fit_engine_config(
    spec: PluginSpec, key: str, engine: E, job_engine: EngineConfig, *, longest: int, remote: bool
) -> E:
    """The engine config under ``key`` (``engine``, ``actor``...) fitted to the engine: LoRA,
    offload and its device checked, ``auto`` pinned to a device it lists, fixed micro-batches
    unless it declares ``dynamic_batch`` (``job_engine``: the job's own config, for telling
    the job's token budget from the user's)."""
    if engine.model.lora.enabled:
        require("engine", spec, "lora", f"{key}.model.lora.rank={engine.model.lora.rank}")
    for part in ("params", "optimizer"):
        if getattr(engine.offload, part):
            require("engine", spec, "offload", f"{key}.offload.{part}=true")
    check_device("engine", spec, f"{key}.device", engine.device, remote=remote)
    micro = fixed_micro_batch(
        spec, f"{key}.micro_batch", engine.micro_batch, job_engine.micro_batch, longest
    )
    device = pinned_device(spec, engine.device, remote=remote)
    return dataclasses.replace(engine, micro_batch=micro, device=device)


def fit_single_engine(spec: PluginSpec, config: T, job_default: Any) -> T:
    """An SFT or DPO config (``engine``, ``data.packing``, ``data.max_length``, ``workers``)
    fitted to the engine (:func:`fit_engine_config`), with padded batches unless it declares
    ``packed``. ``job_default`` is the config the job gives without the user's files and
    overrides."""
    c: Any = config
    engine = fit_engine_config(
        spec,
        "engine",
        c.engine,
        job_default.engine,
        longest=c.data.max_length,
        remote=bool(c.workers.ray_address),
    )
    packing = c.data.packing and "packed" in spec.capabilities
    return dataclasses.replace(c, engine=engine, data=dataclasses.replace(c.data, packing=packing))
