"""Assemble an RL job (``drivetrain grpo`` / ``drivetrain ppo``): plugins, config, roles,
prompts; every check that needs no worker runs before any starts.

With no data and no model (or an environment and no model): the command's built-in task, a
hook (``drivetrain grpo`` passes :mod:`drivetrain.trainer.builtin.tasks`' addition and
calculator tasks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api import EngineConfig, registry
from drivetrain.api.config import LoraConfig, RolloutConfig, WeightSyncConfig
from drivetrain.api.errors import ConfigError
from drivetrain.runtime.hosted_rollout import HostedRollout, rollout_host
from drivetrain.trainer.config_loader import ConfigLayer, load_config, to_yaml
from drivetrain.trainer.data.tokenize import pad_token_id
from drivetrain.trainer.device_defaults import device_layers, numerics_line
from drivetrain.trainer.hf_export import verify_model_dir
from drivetrain.trainer.job_config import TaskLayers
from drivetrain.trainer.named_registry import import_plugins
from drivetrain.trainer.preflight import (
    Context,
    check_devices,
    check_output_dir,
    load_tokenizer,
    model_context,
)
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.rl.advantages import ADVANTAGES, NEEDS_CRITIC
from drivetrain.trainer.rl.capabilities import RLPlugins, fit_plugins
from drivetrain.trainer.rl.config import RLConfig, rl_config_type, updates_per_step
from drivetrain.trainer.rl.episode_setup import episode_setup
from drivetrain.trainer.rl.hosted import check_transport, find_hosted
from drivetrain.trainer.rl.off_policy import CORRECTIONS
from drivetrain.trainer.rl.placement import (
    Placement,
    PlacementSpec,
    build_placement,
    resolve_mode,
    resolve_transport,
)
from drivetrain.trainer.rl.policy_losses import POLICY_LOSSES
from drivetrain.trainer.rl.prompts import load_prompts
from drivetrain.trainer.rl.rewards import RewardScorer
from drivetrain.trainer.rl.trainer import RLSetup
from drivetrain.trainer.workers.role_worker import (
    ACTOR,
    CRITIC,
    REFERENCE,
    REWARD_MODEL,
    TEACHER,
    RoleSpec,
)
from drivetrain.trainer.workers.shared_paths import SharedPaths

PRESETS = Path(__file__).parent / "presets"
#: What each command changes from RLConfig's defaults (and the built-in job's file): the
#: user's files and overrides still win.
ALGORITHM_DEFAULTS = {
    "grpo": [],
    "ppo": ["algorithm.advantage=gae", "sampling.n=1", "run.output_dir=runs/ppo"],
    # the teacher's per-token reverse KL is the whole signal: the verifier weighs nothing
    "distill": [
        "algorithm.advantage=distill",
        "reward.weights=[0.0]",
        "run.output_dir=runs/distill",
    ],
}


@dataclass(frozen=True)
class RLJob:
    algorithm: str
    engine: str
    critic_engine: str
    rollout: str
    transport: str
    config: RLConfig
    task: TaskLayers | None = None  # the built-in task it runs (no data and no model given)
    hosted: HostedRollout | None = None  # the rollout as rollout.python's environment has it

    def to_yaml(self) -> str:
        return to_yaml(self.config)


#: makes a built-in task's layers for the config the user gave (its environment, say), training
#: what it needs first unless told not to (``train`` off: --print-config, --dry-run)
RLTask = Callable[[RLConfig, bool], TaskLayers]


def load_rl_job(
    algorithm: str,
    *,
    engine: str,
    critic_engine: str = "",
    rollout: str = "hf",
    weight_sync: str = "auto",
    files: Sequence[ConfigLayer] = (),
    overrides: Sequence[str] = (),
    preset: str = "",
    task: RLTask | None = None,
    train_prerequisites: bool = True,
) -> RLJob:
    """Parse the config; with no model (and, without an environment, no data), ``task``'s."""
    critic_engine = critic_engine or engine
    for reg, name in ((registry.engines, engine), (registry.engines, critic_engine)):
        reg.spec(name)  # unknown or unusable plugin: lists what is installed
    defaults = tuple(ALGORITHM_DEFAULTS[algorithm])
    presets = preset_files(preset)
    # rollout.python set: the rollout is what that environment has, configured as it says
    hosted = find_hosted(rollout, [*presets, *files], overrides)
    if hosted is None:
        registry.rollouts.spec(rollout)
    config_type = rl_config_type(
        registry.engines.load_config_class(engine, EngineConfig),
        registry.engines.load_config_class(critic_engine, EngineConfig),
        hosted.config_class()
        if hosted
        else registry.rollouts.load_config_class(rollout, RolloutConfig),
        _transport_config(weight_sync),
    )
    device = device_layers(config_type, [*presets, *files], overrides)  # beneath everything
    shipped: list[ConfigLayer] = [*device, defaults, *presets]  # the job's, below the user's
    shipped_overrides: list[str] = []
    config = load_config(config_type, files=[*shipped, *files], overrides=overrides)
    layers = None
    model, data = config.actor.model.path, config.data.train_path
    if not config.episodic and bool(model) != bool(data):
        missing = "actor.model.path" if data else "data.train_path"
        given = "data.train_path" if data else "actor.model.path"
        raise ConfigError(f"{missing} is required when {given} is set")
    if not model:  # and no data, or an environment: the built-in task's
        if task is None:
            raise ConfigError("actor.model.path is required")
        layers = task(config, train_prerequisites)
        shipped = [*device, *layers.files, defaults, *layers.algorithm_files, *presets]
        shipped_overrides = list(layers.overrides)
        config = load_config(
            config_type, files=[*shipped, *files], overrides=[*shipped_overrides, *overrides]
        )
    mode = resolve_mode(config.placement, config.workers)
    if config.algorithm.mode != "sync" and mode == "colocated":
        raise ConfigError(
            f"algorithm.mode={config.algorithm.mode} generates while the actor trains, but "
            "colocated rollouts share the actor's devices and sleep while it trains; use "
            "placement.mode=separate (Ray), or one rank in-process (rollout.python for a "
            "rollout process of its own)"
        )
    transport = resolve_transport(
        weight_sync, mode, rollout_process=bool(getattr(config.rollout, "python", ""))
    )
    if weight_sync not in ("auto", transport):
        raise ConfigError(
            f"placement {mode} hands the weights to a rollout in this process (the direct "
            f"transport), so --weight-sync {weight_sync} has nothing to carry; it applies to a "
            "rollout of its own: rollout.python=<interpreter> (a server process), or "
            "placement.mode=colocated|separate (Ray)"
        )
    if hosted is not None:
        check_transport(hosted, transport)
    plugins = RLPlugins.find(
        engine, critic_engine, rollout, transport, rollout_spec=hosted and hosted.spec
    )
    job_default = load_config(config_type, files=shipped, overrides=shipped_overrides)
    config = fit_plugins(config, job_default, plugins, mode)
    return RLJob(algorithm, engine, critic_engine, rollout, transport, config, layers, hosted)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_files(name: str) -> list[Path]:
    """The preset's YAML (``rl/presets/<name>.yaml``: the algorithm knobs a named variant
    sets), merged before the user's files and overrides, which win."""
    if not name:
        return []
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    return [PRESETS / f"{name}.yaml"]


def _transport_config(name: str) -> type[WeightSyncConfig]:
    if name == "auto":
        # the default transports (colocated, broadcast) share the base class's knobs
        return WeightSyncConfig
    registry.ckpt_engines.spec(name)
    return registry.ckpt_engines.load_config_class(name, WeightSyncConfig)


def role_specs(job: RLJob, total_updates: int) -> tuple[dict[str, RoleSpec], Reference]:
    """Engines per role, and where the reference log-probs come from."""
    c = job.config
    actor = _for_run(c.actor, total_updates, c.seed)
    roles = {ACTOR: RoleSpec(job.engine, actor)}
    reference = Reference(c.reference_mode)
    if reference.needs_engine:
        roles[REFERENCE] = RoleSpec(job.engine, actor)
    if c.algorithm.advantage in NEEDS_CRITIC:
        critic = c.critic
        model = dataclasses.replace(
            critic.model, path=critic.model.path or c.actor.model.path, value_head=True
        )
        critic = _for_run(dataclasses.replace(critic, model=model), total_updates, c.seed)
        roles[CRITIC] = RoleSpec(job.critic_engine, critic)
    if c.teacher.model_path:  # frozen, full weights: the actor's LoRA is not the teacher's
        model = dataclasses.replace(actor.model, path=c.teacher.model_path, lora=LoraConfig())
        roles[TEACHER] = RoleSpec(job.engine, dataclasses.replace(actor, model=model))
    if c.reward.model_path:
        model = dataclasses.replace(c.critic.model, path=c.reward.model_path, value_head=True)
        roles[REWARD_MODEL] = RoleSpec(
            job.critic_engine, dataclasses.replace(c.critic, model=model, seed=c.seed)
        )
    return roles, reference


def _for_run(config: EngineConfig, total_updates: int, seed: int) -> Any:
    optim = dataclasses.replace(config.optim, total_steps=total_updates)
    return dataclasses.replace(config, optim=optim, seed=seed)


@dataclass(frozen=True)
class PreparedRL:
    job: RLJob
    setup: RLSetup
    roles: dict[str, RoleSpec]
    dropped: int


def prepare(job: RLJob) -> PreparedRL:
    """Validate everything a run needs, without starting a worker or writing a file."""
    c = job.config
    if c.algorithm.advantage == "distill" and not c.teacher.model_path:
        raise ConfigError("algorithm.advantage=distill needs a teacher: set teacher.model_path")
    import_plugins(c.algorithm.plugins)
    ADVANTAGES.get(c.algorithm.advantage)
    POLICY_LOSSES.get(c.algorithm.policy_loss)
    CORRECTIONS.get(c.algorithm.correction_name)
    RewardScorer(c.reward.functions, c.reward.weights)
    for name in (job.engine, job.critic_engine):
        registry.engines.load(name)
    if job.hosted is None:
        registry.rollouts.load(job.rollout)
    else:  # loaded in its environment: here, the host that starts it there
        rollout_host()
    if job.transport != "direct":
        registry.ckpt_engines.load(job.transport)
    check_output_dir("run.output_dir", c.run.output_dir)
    devices = {
        "actor.device": c.actor.device,
        "critic.device": c.critic.device,
        "rollout.device": c.rollout.device,
        "weight_sync.device": c.weight_sync.device,
    }
    check_devices(devices, ray_address=c.workers.ray_address)
    for model in (c.actor.model.path, c.critic.model.path, c.teacher.model_path):
        verify_model_dir(model)
    tokenizer = load_tokenizer(c.data.tokenizer_path or c.actor.model.path)
    if c.teacher.model_path:
        check_same_vocabulary(tokenizer, c.teacher.model_path)
    keys = {
        "prompt_key": c.data.prompt_key,
        "messages_key": c.data.messages_key,
        "answer_key": c.data.answer_key,
        "max_prompt_length": c.data.max_prompt_length,
        "max_new_tokens": c.sampling.max_new_tokens,
        "context": generation_context(job),
    }
    episodes, dropped = None, 0
    if c.episodic:
        episodes = episode_setup(c, tokenizer, keys["context"])
        train, val = episodes.train, episodes.val
    else:
        train, dropped = load_prompts(c.data.train_path, tokenizer, **keys)
        train = train[: c.data.max_prompts or None]
        val = []
        if c.data.val_path:
            val, _ = load_prompts(c.data.val_path, tokenizer, **keys)
            val = val[: c.data.val_size or None]
    if c.run.prompts_per_step > len(train):
        raise ConfigError(
            f"run.prompts_per_step={c.run.prompts_per_step} exceeds the {len(train)} prompts"
        )
    roles, reference = role_specs(job, c.run.steps * updates_per_step(c))
    state = {
        "algorithm": job.algorithm,
        **({"env": c.env} if c.env else {}),
        "actor_engine": job.engine,
        # what generates the samples: the same steps through another backend or mode are
        # another run (an hf run's directory resumed by a vLLM run re-exported the hf model)
        "rollout": job.rollout,
        "mode": c.algorithm.mode,
        "model_path": c.actor.model.path,
        "roles": sorted(roles),
        "seed": c.seed,
    }
    setup = RLSetup(
        config=c,
        state=state,
        train=train,
        val=val,
        pad_token_id=pad_token_id(tokenizer),
        tokenizer=tokenizer,
        reference=reference,
        teacher=TEACHER in roles,
        critic=CRITIC in roles,
        reward_model=REWARD_MODEL in roles,
        episodes=episodes,
    )
    return PreparedRL(job, setup, roles, dropped)


def check_same_vocabulary(tokenizer: Any, teacher_path: str) -> None:
    """The teacher scores the student's token ids: both must mean the same tokens by them."""
    teacher = load_tokenizer(teacher_path, what="teacher's tokenizer")
    if teacher.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"teacher.model_path={teacher_path!r} has another vocabulary than the student: "
            "on-policy distillation scores the student's token ids with the teacher"
        )


def generation_context(job: RLJob) -> Context:
    """The most tokens a sample (prompt and response) may have: the rollout's
    ``max_model_len``, or the actor's or rollout model's context where that is shorter."""
    c = job.config
    shortest = Context(
        c.rollout.max_model_len,
        f"the rollout's context (rollout.max_model_len={c.rollout.max_model_len})",
    )
    trust = c.actor.model.trust_remote_code
    for path in dict.fromkeys((c.actor.model.path, rollout_config(job).model_path)):
        context = model_context(path, trust_remote_code=trust)
        if context is not None and context.tokens < shortest.tokens:
            shortest = context
    return shortest


def rollout_config(job: RLJob) -> RolloutConfig:
    c = job.config
    rollout = c.rollout
    if not rollout.model_path:
        rollout = dataclasses.replace(rollout, model_path=c.actor.model.path)
    return dataclasses.replace(rollout, seed=c.seed)


def start(prepared: PreparedRL) -> Placement:
    job, c = prepared.job, prepared.job.config
    mode = resolve_mode(c.placement, c.workers)
    spec = PlacementSpec(
        mode=mode,
        roles=prepared.roles,
        plugins=c.algorithm.plugins,
        workers=c.workers,
        placement=c.placement,
        rollout_name=job.rollout,
        rollout_config=rollout_config(job),
        transport=job.transport,
        sync_config=c.weight_sync,
        shared=SharedPaths.of(c.run.output_dir, model_paths(prepared)),
    )
    return build_placement(spec)


def model_paths(prepared: PreparedRL) -> dict[str, str]:
    """Config key -> the model path each role's ranks load (every node must see them)."""
    return {f"{role}.model.path": spec.config.model.path for role, spec in prepared.roles.items()}


def describe(prepared: PreparedRL) -> str:
    job, c = prepared.job, prepared.job.config
    roles = ", ".join(f"{r}={s.engine}" for r, s in prepared.roles.items())
    data = f"{len(prepared.setup.train)} prompts ({prepared.dropped} too long)"
    if c.episodic:
        who = " ".join(
            [f"env {c.env}"] * bool(c.env) + [f"agent {c.agent.command!r}"] * bool(c.agent.command)
        )
        data = f"{who}: {len(prepared.setup.train)} tasks, up to {c.episode.max_turns} turns"
    rollout = f"{job.rollout} in {job.hosted.python}" if job.hosted else job.rollout
    return (
        f"{job.algorithm}: {data}, "
        f"{len(prepared.setup.val)} validation; {c.run.steps} steps x "
        f"{c.run.prompts_per_step} prompts x {c.sampling.n} samples; roles {roles}; rollout "
        f"{rollout}; placement {resolve_mode(c.placement, c.workers)}, weights via "
        f"{job.transport}\n{numerics_line(c, ['rollout', *prepared.roles])}"
    )
