"""What a job computes in when its config does not say: chosen per device, printed at start.

On a GPU a job whose files and overrides leave a dtype unset trains in bfloat16 (the engines'
mixed precision: float32 master weights and optimizer state, gradients reduced in float32) and
samples in bfloat16 from a copy of the same weights, as verl, NeMo-RL and TRL's GRPO do: about
twice the float32 throughput on an H100's tensor cores, half the activation and KV memory, and
the rollout serves exactly the weights the trainer's forward casts to (the log-prob alarm then
uses its half-precision threshold). TF32 is left off: a float32 matmul a user asks for stays
IEEE float32 (``numerics=exact`` and the float32 seeds check rely on it). On the CPU everything
stays float32: bfloat16 matmuls are no faster there and a bf16 rollout would only add a gap.

The choice is a config layer beneath everything the job and the user give, so any file or
override wins, and ``--print-config`` shows the result.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Sequence
from typing import Any

from drivetrain.api import EngineConfig, RolloutConfig
from drivetrain.trainer.config_loader import ConfigLayer, peek

GPU_DTYPE = "bfloat16"


@functools.cache
def on_gpu() -> bool:
    """Whether this process's jobs run on CUDA (their engines and rollouts pick it when seen)."""
    import torch

    return torch.cuda.is_available()


def dtype_keys(config_type: type[Any]) -> list[str]:
    """The dotted dtype keys of ``config_type``'s engines and rollouts (top-level fields)."""
    hints = typing.get_type_hints(config_type)
    keys = []
    for f in dataclasses.fields(config_type):
        kind = hints.get(f.name)
        if isinstance(kind, type) and issubclass(kind, EngineConfig):
            keys.append(f"{f.name}.model.dtype")
        elif isinstance(kind, type) and issubclass(kind, RolloutConfig):
            keys.append(f"{f.name}.dtype")
    return keys


def device_layer(
    config_type: type[Any],
    files: Sequence[ConfigLayer] = (),
    overrides: Sequence[str] = (),
    *,
    gpu: bool | None = None,
) -> tuple[str, ...]:
    """The config layer of this device's defaults (``key=value`` strings; none on the CPU).
    A role that ``files`` or ``overrides`` put on the CPU (``<role>.device=cpu``) keeps float32
    there."""
    if not (on_gpu() if gpu is None else gpu):
        return ()
    layer = []
    for key in dtype_keys(config_type):
        role = key.split(".")[0]
        if peek(files, overrides, f"{role}.device") != "cpu":
            layer.append(f"{key}={GPU_DTYPE}")
    return tuple(layer)


def device_layers(
    config_type: type[Any], files: Sequence[ConfigLayer] = (), overrides: Sequence[str] = ()
) -> list[ConfigLayer]:
    """The layers to put beneath everything a job loads (none, or :func:`device_layer`'s),
    decided once from the user's ``files`` and ``overrides`` so the job's config and its
    defaults (what tells a user's setting from the job's) get the same."""
    layer = device_layer(config_type, files, overrides)
    return [layer] if layer else []


def numerics_line(config: Any, roles: Sequence[str]) -> str:
    """One line for the job's start: the device, the dtype of each of ``roles`` (top-level
    fields of ``config`` holding an engine's or a rollout's config), TF32."""
    said = []
    for key in dtype_keys(type(config)):
        role, *path = key.split(".")
        if role not in roles:
            continue
        dtype = functools.reduce(getattr, path, getattr(config, role))
        master = " (float32 master weights)" if path[0] == "model" and dtype != "float32" else ""
        said.append(f"{role} {dtype}{master}")
    if not on_gpu():
        return f"numerics on cpu: {', '.join(said)}"
    import torch

    # "highest": float32 matmuls in float32; "high"/"medium": TF32 or bf16 passes
    tf32 = "off" if torch.get_float32_matmul_precision() == "highest" else "on"
    return (
        f"numerics on cuda ({torch.cuda.get_device_name()}): {', '.join(said)}; TF32 matmuls "
        f"{tf32}. Unset dtypes default to {GPU_DTYPE} on a GPU (trainer README: GPU defaults)"
    )
