"""The RL job's configuration (``drivetrain grpo`` / ``drivetrain ppo``).

Like SFT's, the chosen plugins' own config classes are plugged in at load time
(:func:`rl_config_type`): ``actor`` and ``critic`` get their engines' classes, ``rollout`` the
rollout backend's, ``weight_sync`` the transport's, so every knob is reachable with dotted
overrides (``actor.optim.lr=1e-6 rollout.max_batch_size=128``) and unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from drivetrain.api.config import (
    NUMERICS,
    EngineConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    WeightSyncConfig,
)
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.job_config import LoggingConfig, WorkersConfig
from drivetrain.trainer.rl.advantages import NEEDS_GROUPS, OWN_BASELINE
from drivetrain.trainer.rl.aggregation import AGGREGATIONS
from drivetrain.trainer.rl.dapo import DAPOConfig
from drivetrain.trainer.rl.group_stream import AheadConfig
from drivetrain.trainer.rl.kl import KLConfig
from drivetrain.trainer.rl.off_policy import CorrectionConfig
from drivetrain.trainer.rl.policy_losses import ClipConfig
from drivetrain.trainer.rl.routing import MODES as ROUTING_MODES

REFERENCE_MODES = ("auto", "none", "engine", "adapter")
MODES = ("sync", "one_step_off", "async")


@dataclass(frozen=True)
class RLDataConfig:
    train_path: str = ""
    val_path: str = ""  # greedy validation reward before and after training (and every N)
    tokenizer_path: str = ""  # empty: the actor model's directory
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    answer_key: str = "answer"
    max_prompt_length: int = 512
    max_prompts: int = 0  # train on the first N prompts only (0: all), for epochs over a pool
    val_size: int = 0  # 0: every validation row


@dataclass(frozen=True)
class SamplingConfig:
    """How the rollout samples during training (validation is greedy)."""

    n: int = 8  # samples per prompt (GRPO's group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64


@dataclass(frozen=True)
class AlgorithmConfig:
    #: grpo | rloo | gae (needs the critic) | reinforce_pp | reinforce_pp_baseline | distill
    #: (per-token rewards as they are: the teacher's reverse KL) | a registered name
    advantage: str = "grpo"
    norm_by_std: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
    gamma: float = 1.0
    lam: float = 1.0
    policy_loss: str = "vanilla"  # vanilla (PPO clip, dual-clip) | reinforce | gspo | registered
    clip: ClipConfig = field(default_factory=ClipConfig)  # rl/policy_losses.py
    value_clip: float = 0.5  # critic
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    kl: KLConfig = field(default_factory=KLConfig)  # rl/kl.py; coef 0: no reference needed
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # samples per optimizer step; 0: the whole step's batch
    # with one optimizer step per batch, take the old log-probs from the update's own forward
    # (detached) instead of a separate pass: the same numbers, one forward fewer (TRL, verl)
    on_policy_shortcut: bool = True
    plugins: tuple[str, ...] = ()  # modules imported first (they register estimators/losses)
    # ---- generation ahead of training (trainer README, "Sync, one-step-off and async") ----
    #: sync: generate, then train, then sync weights; one_step_off: step k+1's batch generates
    #: under weights k while step k trains; async: rollouts generate continuously, the trainer
    #: takes the first complete groups, weights pushed every ``ahead.sync_every`` steps
    mode: str = "sync"
    ahead: AheadConfig = field(default_factory=AheadConfig)  # rl/group_stream.py
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)  # rl/off_policy.py
    dapo: DAPOConfig = field(default_factory=DAPOConfig)  # rl/dapo.py
    #: mixture-of-experts models: off | rollout (the actor's forwards use the experts the
    #: rollout chose) | old_policy (the updates use the old log-probs' forward's) (rl/routing.py)
    routing_replay: str = "off"

    def __post_init__(self) -> None:
        if self.routing_replay == "False":  # YAML reads a bare `off` as false
            object.__setattr__(self, "routing_replay", "off")
        if self.routing_replay not in ROUTING_MODES:
            raise ConfigError(
                f"algorithm.routing_replay={self.routing_replay!r} is not one of {ROUTING_MODES}"
            )
        self._check_loss()
        self._check_generation_ahead()
        self._check_dapo()

    def _check_loss(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"algorithm.aggregation={self.aggregation!r} is not one of {AGGREGATIONS}"
            )
        if self.ppo_epochs < 1 or self.mini_batch_size < 0:
            raise ConfigError("algorithm.ppo_epochs must be >= 1, mini_batch_size >= 0")
        clip = self.clip
        if not (0 <= clip.low < 1 and clip.high >= 0):
            raise ConfigError("algorithm.clip.low must be in [0, 1), algorithm.clip.high >= 0")
        if clip.dual and clip.dual <= 1:
            raise ConfigError(f"algorithm.clip.dual={clip.dual} must be > 1 (or 0: off)")

    def _check_generation_ahead(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"algorithm.mode={self.mode!r} is not one of {MODES}")
        ahead = self.ahead
        if self.mode == "async" and ahead.sync_every - 1 > ahead.max_staleness:
            raise ConfigError(
                f"algorithm.ahead.sync_every={ahead.sync_every} leaves the rollouts up to "
                f"{ahead.sync_every - 1} versions behind, beyond max_staleness="
                f"{ahead.max_staleness}: raise max_staleness or lower sync_every"
            )

    def _check_dapo(self) -> None:
        if self.dapo.dynamic_sampling and self.mode != "sync":
            raise ConfigError(
                f"algorithm.dapo.dynamic_sampling works in mode=sync, not {self.mode!r} "
                "(generation ahead of training takes groups as they finish)"
            )

    @property
    def staleness(self) -> int:
        """How many versions a sample may lag the trainer (0 in sync mode)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.ahead.max_staleness)

    @property
    def correction_name(self) -> str:
        """The correction in use (``auto`` resolved)."""
        if self.correction.method != "auto":
            return self.correction.method
        return "tis" if self.staleness > 0 else "none"


@dataclass(frozen=True)
class ReferenceConfig:
    """``auto``: none when ``algorithm.kl.coef == 0``; the actor with its LoRA adapter disabled
    when the actor trains LoRA; else a frozen engine (the actor's backend and config)."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in REFERENCE_MODES:
            raise ConfigError(f"reference.mode={self.mode!r} is not one of {REFERENCE_MODES}")


@dataclass(frozen=True)
class RewardConfig:
    functions: tuple[str, ...] = ("exact_match",)  # names or module:function paths
    weights: tuple[float, ...] = ()  # default 1 each
    model_path: str = ""  # a reward model (value-head engine, critic's backend) adds its score


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation (``rl/stages.Advantages``, the ``distill`` estimator): a teacher
    model (the actor's engine backend, ``infer`` only) scores every token the student sampled;
    ``coef`` x the per-token reverse KL ``log pi_student - log pi_teacher`` is subtracted from
    the token's reward. Empty
    ``model_path``: no teacher. The teacher must share the student's tokenizer."""

    model_path: str = ""
    coef: float = 1.0

    def __post_init__(self) -> None:
        if self.coef <= 0:
            raise ConfigError(f"teacher.coef={self.coef} must be > 0")


@dataclass(frozen=True)
class EpisodeConfig:
    """Multi-turn episodes (``env=<name>``, agentic/episodes.py): the policy's turns and the
    environment's observations alternate until the environment says done or a limit ends it.
    A turn samples at most ``sampling.max_new_tokens``."""

    max_turns: int = 4
    max_tokens: int = 0  # per episode after the first prompt, sampled and observed (0: context)
    tool_parser: str = "hermes"  # hermes | llama3_json | a drivetrain.tool_parsers plugin
    options: dict[str, Any] = field(default_factory=dict)  # the environment's own options
    train_tasks: int = 4096  # tasks an environment makes itself when there is no data
    env_threads: int = 8  # environment calls (tool calls) running at once
    #: an environment's reset/step/truncated call running longer fails the step (tools have
    #: their own, shorter timeouts; this bounds the environment's own code), and so does a
    #: step whose handling by the trainer (tokenising its observations) takes it past this
    step_timeout_s: float = 600.0
    #: tool calls a turn may make; the excess is answered by one error line and counted
    #: (``episode/cut/tool_calls``)
    max_tool_calls: int = 16
    #: characters of text a step's observations may carry; the rest is cut before tokenising
    #: and counted (``episode/cut/observation_chars``)
    max_observation_chars: int = 16_000

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 0 or self.env_threads < 1:
            raise ConfigError(
                "episode.max_turns and episode.env_threads must be >= 1, episode.max_tokens >= 0"
            )
        if self.step_timeout_s <= 0:
            raise ConfigError("episode.step_timeout_s must be > 0")
        if self.max_tool_calls < 1 or self.max_observation_chars < 1:
            raise ConfigError(
                "episode.max_tool_calls and episode.max_observation_chars must be >= 1"
            )
        if self.train_tasks < 1:
            raise ConfigError("episode.train_tasks must be >= 1")


@dataclass(frozen=True)
class AgentConfig:
    """An agent written against the OpenAI API plays the episodes (agentic/agent_runner.py):
    ``command`` runs once per step (and validation) with ``DRIVETRAIN_EPISODES`` naming a
    JSON file of episodes, each with its own chat-completions ``base_url`` on the endpoint
    the trainer serves over its rollouts, and ``OPENAI_API_KEY``; the tokens are recorded
    server-side and trained on. Tasks come from ``env`` or data.train_path rows; the reward
    is what the agent reports, else the reward functions on its last turn."""

    command: str = ""  # e.g. "python examples/openai_agent/agent.py" (shell words)
    host: str = "127.0.0.1"  # loopback unless told otherwise; every request needs the key
    port: int = 0  # 0: a free port picked at run time
    timeout_s: float = 3600.0  # one play (every episode of a step) at most

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or not 0 <= self.port < 65536:
            raise ConfigError("agent.timeout_s must be > 0 and agent.port in [0, 65535]")


@dataclass(frozen=True)
class RLRunConfig:
    output_dir: str = "runs/grpo"
    steps: int = 20
    prompts_per_step: int = 16
    eval_every: int = 0  # validation every N steps (0: before and after only)
    save_every: int = 0  # checkpoint every N steps (0: at the end only)
    keep_last: int = 2
    export_hf: bool = True
    stop_grace_s: float = 25.0  # as SFT's run.stop_grace_s (trainer/stopping.py)
    checkpoint_on_interrupt: bool = False  # SIGINT also checkpoints; SIGTERM always
    #: a time budget for the training loop (0: none): the run ends after the step during which
    #: it ran out, and then saves, validates and exports as at run.steps (the LR schedule
    #: still spans run.steps); a resumed run gets the budget again
    max_seconds: float = 0.0
    #: warn once when actor/rollout_log_prob_diff exceeds this (rl/log_prob_alarm.py);
    #: 0: from the dtypes (0.002 when the actor and rollout run float32, else 0.05); < 0: off
    log_prob_alarm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "keep_last"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name}={getattr(self, name)} must be >= 1")
        for name in ("stop_grace_s", "max_seconds", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class PlacementConfig:
    """Where roles run. ``inprocess``: everything in this process (one actor rank);
    ``colocated``: Ray, rollout replicas share the actor ranks' devices (the rollout sleeps
    while the actor trains; ``colocated`` weight sync); ``separate``: Ray, rollouts on their own
    pool (``broadcast`` sync). ``auto``: inprocess for one rank, else colocated."""

    mode: str = "auto"
    rollout_replicas: int = 1
    rollout_cpus: float = 1.0  # separate pool: per rollout replica
    rollout_gpus: float = -1.0  # separate pool: -1 = one when the cluster has GPUs
    colocated_share: float = 0.5  # colocated: fraction of a rank's bundle the rollout takes

    def __post_init__(self) -> None:
        modes = ("auto", "inprocess", "colocated", "separate")
        if self.mode not in modes:
            raise ConfigError(f"placement.mode={self.mode!r} is not one of {modes}")
        if self.rollout_replicas < 1:
            raise ConfigError("placement.rollout_replicas must be >= 1")
        if not 0 < self.colocated_share < 1:
            raise ConfigError("placement.colocated_share must be in (0, 1)")


def _engine_default(lr: float) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(),
        optim=OptimConfig(lr=lr, weight_decay=0.0),
        micro_batch=MicroBatchConfig(max_tokens=8192),
    )


@dataclass(frozen=True)
class RLConfig:
    actor: EngineConfig = field(default_factory=lambda: _engine_default(1e-6))
    critic: EngineConfig = field(default_factory=lambda: _engine_default(1e-5))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    run: RLRunConfig = field(default_factory=RLRunConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)  # the actor's ranks
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    #: an environment (``drivetrain environments``): multi-turn episodes instead of one
    #: completion per prompt; its tasks come from data.train_path rows or the environment
    env: str = ""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    seed: int = 0
    #: ``exact``: the rollout's log-probs equal the actor's bit for bit (the trainer README's
    #: "Exact numerics"); the actor's engine and the rollout must declare ``exact_numerics``
    numerics: str = "default"

    def __post_init__(self) -> None:
        self._check_numerics()
        if self.episodic:
            self._check_episodes()
        # the reference and the KL coefficient must agree: a reference nothing uses, or a KL
        # term without a reference to measure it against, is a mistake, not a run to start
        if self.algorithm.dapo.dynamic_sampling and self.teacher.model_path:
            raise ConfigError(
                "algorithm.dapo.dynamic_sampling filters groups on the verifier's reward; with a "
                "teacher the signal is per token: turn one of them off"
            )
        if self.algorithm.dapo.dynamic_sampling and self.sampling.n < 2:
            raise ConfigError(
                "algorithm.dapo.dynamic_sampling needs sampling.n >= 2: a group of one sample "
                "never has reward variance"
            )
        self._check_group_size()
        kl_coef, mode = self.algorithm.kl.coef, self.reference_mode
        if mode == "adapter" and not self.actor.model.lora.enabled:
            raise ConfigError(
                "reference.mode=adapter needs a LoRA actor (actor.model.lora.rank > 0)"
            )
        if mode != "none" and kl_coef == 0:
            raise ConfigError(f"reference.mode={mode} but algorithm.kl.coef is 0: nothing uses it")
        if mode == "none" and kl_coef != 0:
            raise ConfigError(
                f"algorithm.kl.coef={kl_coef} needs a reference model, but reference.mode=none "
                "(auto, engine or adapter; or algorithm.kl.coef=0)"
            )

    def _check_numerics(self) -> None:
        if self.numerics not in NUMERICS:
            raise ConfigError(f"numerics={self.numerics!r} is not one of {', '.join(NUMERICS)}")
        if self.numerics == "exact" and (self.sampling.top_k > 0 or self.sampling.top_p < 1):
            raise ConfigError(
                "numerics=exact samples from the full distribution the actor computes: unset "
                "sampling.top_k and sampling.top_p"
            )
        if self.numerics == "exact" and self.actor.model.lora.enabled:
            raise ConfigError(
                "numerics=exact with actor.model.lora: the rollout serves the merged weights "
                "(W + BA) while the actor computes Wx + BAx, other arithmetic; train without "
                "LoRA for exact numerics"
            )

    def _check_group_size(self) -> None:
        """A group-relative estimator over groups of one trains without a baseline (or not at
        all), silently: refused here, before any worker starts."""
        advantage, n = self.algorithm.advantage, self.sampling.n
        if advantage in NEEDS_GROUPS and n < 2:
            others = ", ".join(f"algorithm.advantage={k} ({v})" for k, v in OWN_BASELINE.items())
            raise ConfigError(
                f"sampling.n={n}: algorithm.advantage={advantage} needs groups of at least 2 "
                "samples per prompt (the group's rewards are its baseline); set "
                f"sampling.n>=2, or use an estimator with its own baseline: {others}"
            )

    def _check_episodes(self) -> None:
        """What multi-turn episodes do not support yet, refused by key."""
        alg = self.algorithm
        refused = {
            f"algorithm.mode={alg.mode}": alg.mode != "sync",
            "algorithm.dapo.dynamic_sampling": alg.dapo.dynamic_sampling,
            "algorithm.dapo.overlong_buffer": alg.dapo.overlong_buffer > 0,
            "teacher.model_path": bool(self.teacher.model_path),
            # the environment's (or the agent's) rewards are the signal; a reward model's
            # score has no turn to land on yet
            "reward.model_path": bool(self.reward.model_path),
        }
        for key, set_ in refused.items():
            if set_:
                raise ConfigError(
                    f"{key} is not supported with multi-turn episodes (env, agent.command): "
                    "they play in algorithm.mode=sync, without dynamic sampling, overlong "
                    "shaping, a teacher or a reward model"
                )

    @property
    def episodic(self) -> bool:
        """Multi-turn episodes (an environment, or an OpenAI-API agent) instead of one
        completion per prompt."""
        return bool(self.env or self.agent.command)

    @property
    def reference_mode(self) -> str:
        """The reference actually used: ``none``, ``engine`` or ``adapter`` (``auto`` resolved)."""
        if self.reference.mode != "auto":
            return self.reference.mode
        if self.algorithm.kl.coef == 0:
            return "none"
        return "adapter" if self.actor.model.lora.enabled else "engine"


def _plugged(cls: type, base_default: Any) -> Any:
    shared = {f.name: getattr(base_default, f.name) for f in dataclasses.fields(base_default)}
    return field(default_factory=lambda: cls(**shared))


def rl_config_type(
    actor: type[EngineConfig],
    critic: type[EngineConfig],
    rollout: type[RolloutConfig],
    weight_sync: type[WeightSyncConfig],
) -> type[RLConfig]:
    """``RLConfig`` whose role sections have the chosen plugins' config classes (keeping the RL
    defaults above for the fields the base classes share)."""
    return dataclasses.make_dataclass(
        f"RLConfig[{actor.__name__},{rollout.__name__}]",
        [
            ("actor", actor, _plugged(actor, _engine_default(1e-6))),
            ("critic", critic, _plugged(critic, _engine_default(1e-5))),
            ("rollout", rollout, field(default_factory=rollout)),
            ("weight_sync", weight_sync, field(default_factory=weight_sync)),
        ],
        bases=(RLConfig,),
        frozen=True,
    )


def updates_per_step(config: RLConfig) -> int:
    """Optimizer steps per RL step: PPO epochs x mini-batches of the step's samples."""
    samples = config.run.prompts_per_step * config.sampling.n
    mini = config.algorithm.mini_batch_size or samples
    return config.algorithm.ppo_epochs * -(-samples // mini)
