"""What an RL job asks of its engines, rollout and weight transport, checked against what they
declare when the job loads (see :mod:`drivetrain.trainer.capabilities`).

RL batches are always padded, so ``packed`` is never asked for; the actor's and the critic's
token budgets become fixed micro-batches on engines without ``dynamic_batch``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from drivetrain.api import ConfigError, registry
from drivetrain.api.plugin import PluginSpec
from drivetrain.trainer.capabilities import (
    check_device,
    device_of,
    fit_engine_config,
    pinned_device,
    require,
    require_adapter_reference,
)
from drivetrain.trainer.rl.advantages import NEEDS_CRITIC
from drivetrain.trainer.rl.config import RLConfig


def value_head_roles(c: RLConfig) -> list[str]:
    """The config keys that start a value-head role on the critic's engine."""
    roles = []
    if c.algorithm.advantage in NEEDS_CRITIC:
        roles.append(f"algorithm.advantage={c.algorithm.advantage} (a critic)")
    if c.reward.model_path:
        roles.append("reward.model_path (a reward model)")
    return roles


@dataclass(frozen=True)
class RLPlugins:
    """The specs of an RL job's plugins (``transport`` is ``None`` for the in-process
    hand-over, which is always there and never loaded)."""

    actor: PluginSpec
    critic: PluginSpec
    rollout: PluginSpec
    transport: PluginSpec | None

    @classmethod
    def find(
        cls,
        engine: str,
        critic_engine: str,
        rollout: str,
        transport: str,
        *,
        rollout_spec: PluginSpec | None = None,
    ) -> RLPlugins:
        """The specs by name (imports only the light spec modules); ``rollout_spec``: the
        rollout's as another environment has it (``rollout.python``), not looked up here."""
        return cls(
            registry.engines.spec(engine),
            registry.engines.spec(critic_engine),
            rollout_spec or registry.rollouts.spec(rollout),
            None if transport == "direct" else registry.ckpt_engines.spec(transport),
        )


def _fit_routing_replay(c: RLConfig, plugins: RLPlugins) -> RLConfig:
    """Routing replay: the actor's engine replays and reports the experts it used; in
    ``rollout`` mode the rollout records (both declare it). Recording alone
    (``rollout.return_routed_experts``, for the metrics) needs both too."""
    mode, records = c.algorithm.routing_replay, c.rollout.return_routed_experts
    if mode == "off" and not records:
        return c
    asked_by = f"algorithm.routing_replay={mode}"
    if mode == "off":
        asked_by = "rollout.return_routed_experts (the router metrics)"
    if c.env:  # a Trajectory joins turns' tokens, not (yet) their routing
        raise ConfigError(f"{asked_by}: multi-turn episodes (env={c.env}) carry no routing yet")
    require("engine", plugins.actor, "routing_replay", asked_by)
    if mode == "old_policy" and not records:  # the rollout's routing is not needed
        return c
    require("rollout", plugins.rollout, "routed_experts", asked_by)
    return dataclasses.replace(
        c, rollout=dataclasses.replace(c.rollout, return_routed_experts=True)
    )


def _fit_numerics(c: RLConfig, plugins: RLPlugins) -> RLConfig:
    """``numerics`` is one setting of the job: the actor's engine (and so its reference) and
    the rollout get it, after both declare that they honour it."""
    for key, value in (("actor", c.actor.numerics), ("rollout", c.rollout.numerics)):
        if value not in ("default", c.numerics):
            raise ConfigError(
                f"{key}.numerics={value}: set numerics={value}, the job's one setting (it sets "
                "the actor's engine and the rollout alike)"
            )
    if c.numerics != "default":
        asked_by = f"numerics={c.numerics}"
        require("engine", plugins.actor, "exact_numerics", asked_by)
        require("rollout", plugins.rollout, "exact_numerics", asked_by)
    return dataclasses.replace(
        c,
        actor=dataclasses.replace(c.actor, numerics=c.numerics),
        rollout=dataclasses.replace(c.rollout, numerics=c.numerics),
    )


def fit_plugins(c: RLConfig, job_default: RLConfig, plugins: RLPlugins, placement: str) -> RLConfig:
    """``c`` with fixed micro-batches where an engine lacks ``dynamic_batch`` and ``auto``
    devices pinned to one the plugin lists, after refusing what a plugin does not declare.
    ``job_default``: the config without the user's layers; ``placement``: the resolved
    placement mode."""
    remote = bool(c.workers.ray_address)
    longest = c.data.max_prompt_length + c.sampling.max_new_tokens
    actor = plugins.actor
    if c.reference_mode == "adapter":
        require_adapter_reference(actor, c.reference.mode)
    fitted = fit_engine_config(
        actor, "actor", c.actor, job_default.actor, longest=longest, remote=remote
    )
    c = dataclasses.replace(c, actor=fitted)
    if roles := value_head_roles(c):
        critic = plugins.critic
        for asked_by in roles:
            require("engine", critic, "value_head", asked_by)
        fitted = fit_engine_config(
            critic, "critic", c.critic, job_default.critic, longest=longest, remote=remote
        )
        c = dataclasses.replace(c, critic=fitted)
    backend = plugins.rollout
    check_device("rollout", backend, "rollout.device", c.rollout.device, remote=remote)
    rollout = pinned_device(backend, c.rollout.device, remote=remote)
    c = dataclasses.replace(c, rollout=dataclasses.replace(c.rollout, device=rollout))
    c = _fit_numerics(c, plugins)
    c = _fit_routing_replay(c, plugins)
    if python := getattr(c.rollout, "python", ""):  # only some backends have the key
        require("rollout", backend, "separate_process", f"rollout.python={python}")
    # sharing an accelerator, the rollout hands its memory to the training step; on the CPU
    # there is no device memory to hand back
    device = device_of(backend, c.rollout.device, remote=remote)
    if placement == "colocated" and device not in (None, "cpu"):
        mode = c.placement.mode
        shown = f"placement.mode={mode}" + (" (colocated)" if mode == "auto" else "")
        require("rollout", backend, "sleep", f"{shown} on {device}")
    if plugins.transport is not None:
        check_device(
            "ckpt-engine",
            plugins.transport,
            "weight_sync.device",
            c.weight_sync.device,
            remote=remote,
        )
    return c
