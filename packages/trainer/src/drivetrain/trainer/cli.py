"""The ``drivetrain`` command."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Annotated

import typer

from drivetrain.api import registry
from drivetrain.trainer.commands.diagnose import mismatch
from drivetrain.trainer.commands.dpo import dpo
from drivetrain.trainer.commands.plan import plan
from drivetrain.trainer.commands.rl import distill, grpo, ppo
from drivetrain.trainer.commands.sft import sft
from drivetrain.trainer.console import plain_console, print_error
from drivetrain.trainer.plugin_table import plugin_table

app = typer.Typer(
    help="drivetrain: modular LLM post-training (SFT, GRPO, PPO, DPO) over pluggable engines.",
    no_args_is_help=True,
    add_completion=False,
)
console = plain_console(stderr=False)


def drivetrain_distributions() -> list[tuple[str, str]]:
    """(name, version) of every installed distribution named drivetrain-*."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower().startswith("drivetrain-"):
            found[name] = dist.version
    return sorted(found.items())


def _version_callback(value: bool) -> None:
    if value:
        for name, version in drivetrain_distributions():
            console.print(f"{name} {version}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version_callback,
        is_eager=True,
        help="Show the versions of every installed drivetrain distribution and exit.",
    ),
) -> None:
    """drivetrain: modular LLM post-training (SFT, GRPO, PPO, DPO) over pluggable engines."""


Check = Annotated[
    bool,
    typer.Option("--check", help="Import each plugin's code and report whether it works."),
]


@app.command()
def engines(check: Check = False) -> None:
    """List installed training engines (entry-point group drivetrain.engines)."""
    console.print(plugin_table(registry.engines, check=check))


@app.command()
def rollouts(check: Check = False) -> None:
    """List installed rollout backends (entry-point group drivetrain.rollouts)."""
    console.print(plugin_table(registry.rollouts, check=check))


@app.command("ckpt-engines")
def ckpt_engines(check: Check = False) -> None:
    """List installed weight-sync transports (entry-point group drivetrain.ckpt_engines)."""
    console.print(plugin_table(registry.ckpt_engines, check=check))


@app.command()
def environments(check: Check = False) -> None:
    """List installed RL environments (entry-point group drivetrain.environments)."""
    console.print(plugin_table(registry.environments, check=check))


diagnose_app = typer.Typer(help="Find what is wrong with a run's parts.", no_args_is_help=True)
diagnose_app.command()(mismatch)
app.add_typer(diagnose_app, name="diagnose")
app.command()(sft)
app.command()(grpo)
app.command()(ppo)
app.command()(dpo)
app.command()(distill)
app.command()(plan)


@app.command("import-gguf")
def import_gguf_command(
    gguf_file: Annotated[Path, typer.Argument(help="The .gguf file.")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the Hugging Face model dir.")],
    dtype: Annotated[str, typer.Option(help="dtype of the saved weights.")] = "bfloat16",
) -> None:
    """Convert a GGUF checkpoint (dequantised) into a Hugging Face model directory."""
    from drivetrain.api.errors import DrivetrainError
    from drivetrain.trainer.gguf_import import import_gguf

    try:
        import_gguf(gguf_file, out_dir, dtype=dtype)
    except DrivetrainError as exc:
        print_error(console, exc)
        raise typer.Exit(2) from None
    console.print(f"wrote {out_dir}")


@app.command("new-plugin")
def new_plugin_command(
    kind: Annotated[
        str,
        typer.Argument(help="What to make: engine, rollout, transport (weight sync), environment."),
    ],
    name: Annotated[str, typer.Argument(help="The distribution's name, e.g. acme-words.")],
    into: Annotated[Path, typer.Option(help="The folder to make it in.")] = Path("."),
) -> None:
    """Make a plugin package whose kit passes on its working stub: edit it into yours."""
    from drivetrain.api.errors import DrivetrainError
    from drivetrain.trainer.new_plugin import new_plugin

    try:
        target = new_plugin(kind, name, into)
    except DrivetrainError as exc:
        print_error(plain_console(stderr=True), exc)
        raise typer.Exit(2) from None
    console.print(f"wrote {target}: pip install -e '{target}[test]' && pytest {target}")


def main() -> None:
    app()
