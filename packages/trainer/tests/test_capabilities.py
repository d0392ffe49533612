"""A job asks its plugins only for what they declare: it adapts the batch layout and the
micro-batching, and refuses the rest in one line naming the plugin, the capability and the
config key."""

from dataclasses import dataclass

import pytest

from drivetrain.api.config import EngineConfig, MicroBatchConfig, RolloutConfig, WeightSyncConfig
from drivetrain.api.errors import ConfigError
from drivetrain.api.plugin import PluginSpec
from drivetrain.trainer import capabilities
from drivetrain.trainer.capabilities import fit_single_engine
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.dpo.config import dpo_config_type
from drivetrain.trainer.dpo.job import fit_engine as fit_dpo_engine
from drivetrain.trainer.rl.capabilities import RLPlugins, fit_plugins
from drivetrain.trainer.rl.config import rl_config_type
from drivetrain.trainer.sft.config import sft_config_type


def spec(name: str, *capabilities: str) -> PluginSpec:
    return PluginSpec(name, "acme.engine:Engine", ">=0.1,<0.2", frozenset(capabilities))


BARE = spec("bare")
CPU_ONLY = spec("cpu_only", "device:cpu")
FULL = spec(
    "full", "packed", "dynamic_batch", "lora", "value_head", "offload", "sleep", "device:cpu",
    "device:cuda",
)  # fmt: skip


def sft(*overrides: str):
    return load_config(sft_config_type(EngineConfig), overrides=["data.max_length=64", *overrides])


def refused(match: str, fit, *args) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        fit(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("engine", [BARE, CPU_ONLY])
def test_an_engine_without_packed_and_dynamic_batch_gets_padded_fixed_micro_batches(engine):
    """The bug of issue 22: a device:cpu-only engine got packed batches cut by a budget."""
    fitted = fit_single_engine(engine, sft(), sft())
    assert fitted.data.packing is False
    # the job's 8192-token budget at 64 tokens a sample: the same peak
    assert fitted.engine.micro_batch == MicroBatchConfig(micro_batch_size=128)


def test_an_engine_declaring_them_keeps_packing_and_the_budget():
    user = sft("engine.micro_batch.max_tokens=4096")
    assert fit_single_engine(FULL, user, sft()) == user
    assert user.data.packing and user.engine.micro_batch.max_tokens == 4096


def test_a_budget_the_user_sets_needs_dynamic_batch():
    user = sft("engine.micro_batch.max_tokens=4096")
    message = refused("dynamic_batch", fit_single_engine, CPU_ONLY, user, sft())
    assert message == (
        "engine.micro_batch.max_tokens=4096 needs the 'dynamic_batch' capability, which engine "
        "'cpu_only' does not declare (it declares device:cpu)"
    )
    fixed = sft("engine.micro_batch.max_tokens=null", "engine.micro_batch.micro_batch_size=4")
    assert fit_single_engine(CPU_ONLY, fixed, sft()).engine.micro_batch.micro_batch_size == 4


@pytest.mark.parametrize(
    ("override", "shown", "capability"),
    [
        ("engine.model.lora.rank=8", "engine.model.lora.rank=8", "lora"),
        ("engine.offload.optimizer=true", "engine.offload.optimizer=true", "offload"),
        ("engine.device=cuda", "engine.device=cuda", "device:cuda"),
        ("engine.device=npu:1", "engine.device=npu:1", "device:npu"),
    ],
)
def test_what_the_engine_config_asks_for(override, shown, capability):
    message = refused(capability, fit_single_engine, CPU_ONLY, sft(override), sft())
    assert message.startswith(f"{shown} needs the '{capability}' capability, which engine")


def test_auto_device_and_an_engine_without_device_claims(monkeypatch):
    monkeypatch.setattr(capabilities, "_cuda_available", lambda: False)
    cuda_only = spec("cuda_only", "device:cuda")
    message = refused("device:cpu", fit_single_engine, cuda_only, sft(), sft())
    assert message.startswith("engine.device=auto (cpu on this machine) needs the 'device:cpu'")
    # the ranks on a Ray cluster this process cannot see resolve auto themselves
    fit_single_engine(cuda_only, sft("workers.ray_address=auto"), sft())
    fit_single_engine(BARE, sft("engine.device=cuda"), sft())  # it claims no device
    monkeypatch.setattr(capabilities, "_cuda_available", lambda: True)
    assert fit_single_engine(cuda_only, sft(), sft()).engine.device == "auto"
    # auto: the CPU it lists, pinned, or the engine would resolve auto to this machine's GPU
    assert fit_single_engine(CPU_ONLY, sft(), sft()).engine.device == "cpu"
    assert fit_single_engine(BARE, sft(), sft()).engine.device == "auto"
    fitted = fit_plugins(rl(), rl(), plugins(CPU_ONLY, rollout=CPU_ONLY), "colocated")
    assert fitted.actor.device == fitted.rollout.device == "cpu"  # no sleep asked on the CPU


def test_dpo_adapter_reference_needs_lora():
    def dpo(*overrides: str):
        return load_config(dpo_config_type(EngineConfig), overrides=list(overrides))

    lora = spec("lora_less", "packed", "dynamic_batch")
    user = dpo("engine.model.lora.rank=8")
    message = refused("lora", fit_dpo_engine, lora, user, dpo())
    assert message.startswith(
        "reference.mode=auto (the actor with its adapter disabled) needs the 'lora' capability"
    )
    fitted = fit_dpo_engine(BARE, dpo(), dpo())  # frozen-engine reference: nothing asked
    assert not fitted.data.packing and fitted.engine.micro_batch.micro_batch_size == 8


RL = rl_config_type(EngineConfig, EngineConfig, RolloutConfig, WeightSyncConfig)


def rl(*overrides: str):
    return load_config(RL, overrides=list(overrides))


def plugins(actor=FULL, critic=FULL, rollout=FULL, transport=None) -> RLPlugins:
    return RLPlugins(actor, critic, rollout, transport)


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        (["algorithm.advantage=gae"], "algorithm.advantage=gae (a critic)"),
        (["reward.model_path=/rm"], "reward.model_path (a reward model)"),
    ],
)
def test_critic_and_reward_model_need_value_head(overrides, shown):
    no_head = spec("no_head", "packed", "dynamic_batch", "device:cpu")
    message = refused("value_head", fit_plugins, rl(*overrides), rl(), plugins(critic=no_head), "x")
    assert message.startswith(f"{shown} needs the 'value_head' capability, which engine 'no_head'")
    fit_plugins(rl(), rl(), plugins(critic=no_head), "inprocess")  # no value-head role: fine


def test_rl_adapter_reference_needs_lora():
    user = rl("actor.model.lora.rank=8", "algorithm.kl.coef=0.1", "reference.mode=adapter")
    message = refused("lora", fit_plugins, user, rl(), plugins(actor=CPU_ONLY), "inprocess")
    assert message.startswith("reference.mode=adapter needs the 'lora' capability")


def test_rl_engines_without_dynamic_batch_get_fixed_micro_batches():
    head_only = spec("head_only", "value_head")
    fitted = fit_plugins(rl("algorithm.advantage=gae"), rl(), plugins(BARE, head_only), "x")
    # 8192 tokens at 512 prompt + 64 new tokens a sample
    assert (
        fitted.actor.micro_batch
        == fitted.critic.micro_batch
        == MicroBatchConfig(micro_batch_size=14)
    )


def test_colocated_on_an_accelerator_needs_the_rollouts_sleep():
    awake = spec("awake", "device:cpu", "device:cuda")
    user = rl("rollout.device=cuda")
    message = refused("sleep", fit_plugins, user, rl(), plugins(rollout=awake), "colocated")
    assert message.startswith(
        "placement.mode=auto (colocated) on cuda needs the 'sleep' capability, which rollout "
        "'awake' does not declare"
    )
    fit_plugins(user, rl(), plugins(rollout=awake), "separate")
    fit_plugins(rl("rollout.device=cpu"), rl(), plugins(rollout=awake), "colocated")  # no VRAM


def test_colocated_auto_on_a_gpu_machine_needs_sleep_from_a_rollout_claiming_no_device(
    monkeypatch,
):
    """A rollout listing no device resolves auto to this machine's GPU itself."""
    monkeypatch.setattr(capabilities, "_cuda_available", lambda: True)
    message = refused("sleep", fit_plugins, rl(), rl(), plugins(rollout=BARE), "colocated")
    assert "on cuda needs the 'sleep' capability, which rollout 'bare'" in message
    monkeypatch.setattr(capabilities, "_cuda_available", lambda: False)
    fit_plugins(rl(), rl(), plugins(rollout=BARE), "colocated")


def test_rollout_and_transport_devices():
    cpu = rl("rollout.device=cpu", "weight_sync.device=cpu")
    cuda_only = spec("cuda_only", "device:cuda")
    message = refused("device:cpu", fit_plugins, cpu, rl(), plugins(rollout=cuda_only), "x")
    assert message.startswith("rollout.device=cpu needs the 'device:cpu' capability, which rollout")
    sync = plugins(rollout=CPU_ONLY, transport=cuda_only)
    message = refused("device:cpu", fit_plugins, cpu, rl(), sync, "separate")
    assert message.startswith(
        "weight_sync.device=cpu needs the 'device:cpu' capability, which ckpt"
    )


@dataclass(frozen=True)
class ProcessRolloutConfig(RolloutConfig):
    python: str = ""  # as the first-party backends': the interpreter of its own environment


def test_a_rollout_process_of_its_own_needs_separate_process():
    own = rl_config_type(EngineConfig, EngineConfig, ProcessRolloutConfig, WeightSyncConfig)
    user = load_config(own, overrides=["rollout.python=/venv/bin/python"])
    message = refused("separate_process", fit_plugins, user, rl(), plugins(rollout=CPU_ONLY), "x")
    assert message.startswith("rollout.python=/venv/bin/python needs the 'separate_process'")


EXACT = spec("exact", "exact_numerics", "device:cpu")


def test_numerics_exact_reaches_the_actor_and_the_rollout_that_declare_it():
    fitted = fit_plugins(rl("numerics=exact"), rl(), plugins(EXACT, rollout=EXACT), "inprocess")
    assert (fitted.actor.numerics, fitted.rollout.numerics) == ("exact", "exact")
    fitted = fit_plugins(rl(), rl(), plugins(EXACT, rollout=EXACT), "inprocess")
    assert (fitted.actor.numerics, fitted.rollout.numerics) == ("default", "default")


@pytest.mark.parametrize("side", ["engine", "rollout"])
def test_numerics_exact_is_refused_by_a_plugin_without_the_capability(side):
    chosen = plugins(CPU_ONLY, rollout=EXACT) if side == "engine" else plugins(EXACT, rollout=BARE)
    message = refused("exact_numerics", fit_plugins, rl("numerics=exact"), rl(), chosen, "x")
    assert f"numerics=exact needs the 'exact_numerics' capability, which {side}" in message


def test_numerics_is_one_setting_of_the_job():
    message = refused(
        "the job's one setting", fit_plugins, rl("rollout.numerics=exact"), rl(),
        plugins(EXACT, rollout=EXACT), "x",
    )  # fmt: skip
    assert message.startswith("rollout.numerics=exact: set numerics=exact")
    refused("unset sampling.top_k and sampling.top_p", rl, "numerics=exact", "sampling.top_k=5")
    refused("is not one of default, exact", rl, "numerics=bitwise")
    refused("other arithmetic", rl, "numerics=exact", "actor.model.lora.rank=8")
