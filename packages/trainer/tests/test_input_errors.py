"""Bad input fails in one line that names the file and the position, with status 2, before any
engine is built: ``drivetrain sft`` and ``drivetrain grpo`` alike (issue 19, item 8).

The fake engine and rollout keep these fast; the command's training entry points are replaced
by a function that fails the test, so an error reported only once an engine exists fails too.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from drivetrain.trainer.cli import app
from drivetrain.trainer.rl import job as rl_job
from drivetrain.trainer.sft import job as sft_job
from trainer_fixtures import write_jsonl

pytestmark = pytest.mark.fault

runner = CliRunner()
COMMANDS = ["sft", "grpo"]
#: the tiny test model's max_position_embeddings
CONTEXT = 256


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("an engine was built before the input was refused")

    monkeypatch.setattr(sft_job, "run_sft", built)
    monkeypatch.setattr(rl_job, "start", built)


def rows(command: str, count: int = 12) -> list[dict]:
    if command == "sft":
        return [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(count)]
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(count)]


def base_args(command: str, tmp_path: Path, model: Path, data: Path) -> list[str]:
    if command == "sft":
        return [
            "sft", "--engine", "fake", f"engine.model.path={model}",
            f"data.train_path={data}", f"run.output_dir={tmp_path / 'out'}", "run.batch_size=4",
        ]  # fmt: skip
    return [
        "grpo", "--engine", "fake", "--rollout", "fake", f"actor.model.path={model}",
        f"data.train_path={data}", f"run.output_dir={tmp_path / 'out'}",
        "run.prompts_per_step=4", "sampling.n=2",
    ]  # fmt: skip


def refused(args: list[str], *needles: str) -> str:
    """The one error line; asserts status 2 and that it holds every needle."""
    result = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(params=COMMANDS)
def job(request, tmp_path, tiny_model):
    command = request.param
    data = write_jsonl(tmp_path / "train.jsonl", rows(command))
    return command, tmp_path, data, base_args(command, tmp_path, tiny_model, data)


def test_non_utf8_jsonl_names_line_and_byte_offset(job):
    _, _, data, args = job
    lines = data.read_bytes().splitlines(keepends=True)
    bad = lines[2].replace(b'"prompt": "', b'"prompt": "\xff')
    data.write_bytes(b"".join([*lines[:2], bad, *lines[3:]]))
    offset = len(lines[0]) + len(lines[1]) + bad.index(b"\xff")
    refused(args, f"{data}:3: not UTF-8", f"byte offset {offset}")


def test_non_utf8_json_names_line_and_byte_offset(job):
    command, tmp_path, _, args = job
    data = tmp_path / "train.json"
    text = json.dumps(rows(command), indent=1).encode()
    bad = text.index(b'"2+1=') + 1
    data.write_bytes(text[:bad] + b"\xc3\x28" + text[bad:])
    line = text[:bad].count(b"\n") + 1
    refused([*args, f"data.train_path={data}"], f"{data}:{line}: not UTF-8", f"offset {bad}")


def test_yaml_syntax_error_names_line_and_column(job):
    _, tmp_path, _, args = job
    config = tmp_path / "job.yaml"
    config.write_text("run:\n  keep_last: 3\n   extra: 1\n")
    refused([*args, "-c", str(config)], f"{config}:3:9: YAML syntax error", "mapping values")
    config.write_bytes(b"run:\n  output_dir: \xff\n")
    refused([*args, "-c", str(config)], f"{config}:2: not UTF-8", "byte offset 19")


def test_config_path_that_is_a_directory(job):
    _, tmp_path, _, args = job
    refused([*args, "-c", str(tmp_path)], f"config file '{tmp_path}' is a directory")


def test_data_path_that_is_a_directory(job):
    _, tmp_path, _, args = job
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    refused([*args, f"data.train_path={folder}"], f"data file '{folder}' is a directory")


def test_output_dir_that_is_a_file_or_under_one(job):
    _, tmp_path, _, args = job
    file = tmp_path / "taken"
    file.write_text("x")
    refused([*args, f"run.output_dir={file}"], f"run.output_dir={file} is a file")
    refused(
        [*args, f"run.output_dir={file / 'sub' / 'out'}"],
        f"run.output_dir={file / 'sub' / 'out'} is under the file {file}",
    )
    assert file.read_text() == "x"


def _unwritable_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir(mode=0o500)
        return folder
    if not os.access("/proc/sys", os.W_OK):  # root ignores modes; a read-only mount it cannot
        return Path("/proc/sys")
    pytest.skip("no directory here is unwritable for this user")


def test_output_dir_not_writable(job):
    _, tmp_path, _, args = job
    folder = _unwritable_dir(tmp_path)
    refused([*args, f"run.output_dir={folder / 'out'}"], f"{folder} is not writable")
    refused([*args, f"run.output_dir={folder}"], f"{folder} is not writable")


def test_sft_example_longer_than_the_model_context(tmp_path, tiny_model):
    data = write_jsonl(
        tmp_path / "train.jsonl",
        [*rows("sft"), {"prompt": "1" * (CONTEXT + 10), "response": "2"}, *rows("sft")],
    )
    args = base_args("sft", tmp_path, tiny_model, data)
    for extra in ([], ["--dry-run"]):
        refused(
            [*args, *extra, "data.max_length=4096"],
            f"{data}:13:",
            f"longer than the model's context (max_position_embeddings={CONTEXT})",
        )


def test_rl_prompt_plus_new_tokens_longer_than_the_context(tmp_path, tiny_model):
    """Prompts over data.max_prompt_length are dropped (counted); a kept prompt that leaves no
    room for sampling.max_new_tokens in the context is refused at load, by file:line."""
    long_prompt = {"prompt": "1" * 60, "answer": "1"}  # 60 characters, ~64 tokens with template
    data = write_jsonl(tmp_path / "train.jsonl", [*rows("grpo"), long_prompt])
    args = base_args("grpo", tmp_path, tiny_model, data)
    refused(
        [*args, "rollout.max_model_len=70", "sampling.max_new_tokens=8"],
        f"{data}:13: ",
        "+ sampling.max_new_tokens=8",
        "rollout.max_model_len=70",
    )
    refused(
        [*args, "--dry-run", "sampling.max_new_tokens=200"],
        f"{data}:13: ",
        f"max_position_embeddings={CONTEXT}",
    )
    ok = runner.invoke(app, [*args, "--dry-run", "sampling.max_new_tokens=8"])
    assert ok.exit_code == 0, ok.output


def _absent_gpu() -> str:
    return f"cuda:{torch.cuda.device_count()}"  # one past the last visible GPU


@pytest.mark.parametrize(
    ("command", "key"),
    [("sft", "engine.device"), ("grpo", "actor.device"), ("grpo", "rollout.device")],
)
def test_device_that_is_not_here(command, key, tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", rows(command))
    args = base_args(command, tmp_path, tiny_model, data)
    device = _absent_gpu()
    # the fake plugins list only device:cpu: refused for that before the GPU is looked for
    refused([*args, f"{key}={device}"], f"{key}={device} needs the 'device:cuda' capability")
    if key.startswith("rollout"):
        return  # the hf rollout's own config takes no device index: refused there
    args[args.index("--engine") + 1] = "fsdp2"  # lists CUDA: the GPU is looked for
    visible = torch.cuda.device_count()
    refused([*args, f"{key}={device}"], f"{key}={device}", f"{visible} CUDA device")
    assert not (tmp_path / "out").exists()


def test_a_transport_for_an_in_process_rollout_says_where_it_applies(tmp_path, tiny_model):
    """The in-process rollout takes its weights directly: the refusal says what
    --weight-sync is for, not only to drop it."""
    data = write_jsonl(tmp_path / "train.jsonl", rows("grpo"))
    args = [*base_args("grpo", tmp_path, tiny_model, data), "--weight-sync", "broadcast"]
    refused(
        args,
        "placement inprocess hands the weights to a rollout in this process",
        "--weight-sync broadcast has nothing to carry",
        "rollout.python=<interpreter>",
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_model_path_that_does_not_exist_is_said_so(command, tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", rows(command))
    missing = tmp_path / "no-model"
    refused(
        base_args(command, tmp_path, missing, data), f"'{missing}'", "no such file or directory"
    )
