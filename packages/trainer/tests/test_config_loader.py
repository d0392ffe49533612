import pytest

from drivetrain.api import ConfigError, EngineConfig, MicroBatchConfig
from drivetrain.testing import FakeEngineConfig
from drivetrain.trainer.config_loader import load_config, peek, to_yaml


def test_defaults_files_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 0.5\n  betas: [0.8, 0.9]\nmicro_batch:\n  micro_batch_size: 4\n")
    config = load_config(EngineConfig, files=[path], overrides=["optim.lr=1e-6", "seed=3"])
    assert config.optim.lr == 1e-6 and config.optim.betas == (0.8, 0.9)
    assert config.micro_batch == MicroBatchConfig(micro_batch_size=4)
    assert config.seed == 3
    with pytest.raises(AttributeError):
        config.seed = 4  # frozen


def test_subclassed_engine_config_keeps_its_fields():
    config = load_config(FakeEngineConfig, overrides=["vocab_size=32", "model.lora.rank=8"])
    assert isinstance(config, FakeEngineConfig) and config.vocab_size == 32
    assert config.model.lora.enabled


def test_unknown_key_names_the_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config(EngineConfig, overrides=["optim.lrr=1"])
    message = str(err.value)
    assert "unknown config key 'optim.lrr'" in message
    assert "valid keys at 'optim': lr, betas, eps, weight_decay, clip_grad" in message


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="valid keys at the top level: model, optim, micro_batch"):
        load_config(EngineConfig, overrides=["optimizer.lr=1"])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  pth: /tmp/x\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.pth'.*path, dtype"):
        load_config(EngineConfig, files=[path])


def test_wrong_type_and_invalid_value():
    with pytest.raises(ConfigError, match="invalid config value for 'optim.lr'"):
        load_config(EngineConfig, overrides=["optim.lr=fast"])
    with pytest.raises(ConfigError, match="optim.scheduler='step' is not one of"):
        load_config(EngineConfig, overrides=["optim.scheduler=step"])
    with pytest.raises(ConfigError, match="set exactly one of micro_batch_size and max_tokens"):
        load_config(EngineConfig, overrides=["micro_batch.max_tokens=512"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(EngineConfig, overrides=["optim.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(EngineConfig, files=[tmp_path / "missing.yaml"])


def test_yaml_round_trip(tmp_path):
    config = load_config(
        EngineConfig,
        overrides=[
            "optim.lr=0.25",
            "micro_batch.micro_batch_size=null",
            "micro_batch.max_tokens=64",
        ],
    )
    path = tmp_path / "printed.yaml"
    path.write_text(to_yaml(config))
    assert load_config(EngineConfig, files=[path]) == config


@pytest.mark.fault
def test_yaml_file_errors_name_the_position(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  lr: 0.5\n   eps: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3:7: YAML syntax error: mapping values"):
        load_config(EngineConfig, files=[path])
    path.write_bytes(b"optim:\n  lr: \xe9\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: not UTF-8 \(byte offset 13"):
        load_config(EngineConfig, files=[path])
    path.write_text("42\n")
    with pytest.raises(ConfigError, match="bad.yaml: not a YAML mapping"):
        load_config(EngineConfig, files=[path])
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(EngineConfig, files=[tmp_path])


def test_a_tuple_layer_sits_between_files(tmp_path):
    """A command's own defaults are a layer: above the file before them, below the files and
    overrides after (`drivetrain ppo`'s sampling.n=1 used to beat the user's file)."""
    from drivetrain.trainer.rl.config import RLConfig

    before, after = tmp_path / "before.yaml", tmp_path / "after.yaml"
    before.write_text("sampling:\n  n: 3\n  top_k: 5\n")
    after.write_text("sampling:\n  n: 4\n")
    config = load_config(
        RLConfig, files=[before, ("sampling.n=1", "sampling.top_k=7", "seed=2"), after],
        overrides=["seed=9"],
    )  # fmt: skip
    assert (config.sampling.n, config.sampling.top_k, config.seed) == (4, 7, 9)


def test_ppo_defaults_yield_to_the_users_file(tmp_path):
    from drivetrain.trainer.rl.job import load_rl_job

    user = tmp_path / "ppo.yaml"
    user.write_text("sampling:\n  n: 4\n")
    job = load_rl_job(
        "ppo", engine="fsdp2", files=[user],
        overrides=["data.train_path=x.jsonl", "actor.model.path=m"],
    )  # fmt: skip
    assert job.config.sampling.n == 4 and job.config.algorithm.advantage == "gae"


def test_a_key_of_another_installed_rollout_says_whose_it_is():
    from drivetrain.api import RolloutConfig, WeightSyncConfig, registry
    from drivetrain.trainer.rl.config import rl_config_type

    vllm = registry.rollouts.load_config_class("vllm", RolloutConfig)
    config_type = rl_config_type(EngineConfig, EngineConfig, vllm, WeightSyncConfig)
    with pytest.raises(ConfigError) as err:
        load_config(config_type, overrides=["rollout.max_batch_size=8"])
    assert str(err.value).startswith(
        "rollout.max_batch_size is an option of the hf rollout; the vllm rollout has "
        "max_num_seqs; valid keys at 'rollout': "
    )


def test_a_key_of_other_installed_engines_names_them():
    with pytest.raises(ConfigError) as err:
        load_config(FakeEngineConfig, overrides=["tensor_parallel=2"])
    assert str(err.value).startswith(
        "tensor_parallel is an option of the megatron and megatron_fsdp engines; valid keys at "
    )  # no counterpart among the fake engine's own knobs: none suggested


def test_a_renamed_key_fails_in_one_line_naming_the_new_one():
    """One word, one meaning ("workers": the actor's ranks): an old key names its new one."""
    from drivetrain.trainer.config_loader import RENAMED
    from drivetrain.trainer.rl.config import RLConfig

    for old, new in RENAMED.items():
        with pytest.raises(ConfigError) as info:
            load_config(RLConfig, overrides=[f"{old}=2"])
        assert str(info.value) == f"config key '{old}' is now '{new}'"
        value = load_config(RLConfig)
        for part in new.split("."):  # the new key exists
            value = getattr(value, part)
        assert load_config(RLConfig, overrides=[f"{new}={value}"]) == load_config(RLConfig)


def test_a_renamed_key_in_a_file_names_the_file(tmp_path):
    from drivetrain.trainer.rl.config import RLConfig

    path = tmp_path / "old.yaml"
    path.write_text("algorithm:\n  correction: tis\n  dynamic_sampling: true\n")
    with pytest.raises(ConfigError) as info:
        load_config(RLConfig, files=[path])
    assert str(info.value) == (
        f"config key 'algorithm.correction' is now 'algorithm.correction.method' (in {path})"
    )


def test_peek_reads_a_key_before_the_config_type_exists(tmp_path):
    """``rollout.python`` picks the rollout's config type, so it is read from the layers first:
    files in order, a layer of overrides, then the user's overrides (an empty one unsets)."""
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  python: /envs/a/bin/python\n  env: [A=1]\n")
    layers = [("rollout.max_batch_size=4",), path]
    assert peek(layers, [], "rollout.python") == "/envs/a/bin/python"
    assert peek(layers, [], "rollout.env") == ["A=1"]
    assert peek(layers, ["rollout.python=/envs/b/bin/python"], "rollout.python").endswith(
        "b/bin/python"
    )
    assert not peek(layers, ["rollout.python="], "rollout.python")
    assert peek([], ["seed=3"], "rollout.python") is None
