"""The ``drivetrain`` command."""

from __future__ import annotations

from importlib import metadata

import typer
from rich.console import Console

from drivetrain.api import registry
from drivetrain.trainer.plugin_table import plugin_table
from drivetrain.trainer.rl.command import grpo, ppo
from drivetrain.trainer.sft_command import sft

app = typer.Typer(
    help="drivetrain: modular LLM post-training (SFT, PPO, GRPO) over pluggable engines.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


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
    """drivetrain: modular LLM post-training (SFT, PPO, GRPO) over pluggable engines."""


@app.command()
def engines() -> None:
    """List installed training engines (entry-point group drivetrain.engines)."""
    console.print(plugin_table(registry.engines))


@app.command()
def rollouts() -> None:
    """List installed rollout backends (entry-point group drivetrain.rollouts)."""
    console.print(plugin_table(registry.rollouts))


@app.command("ckpt-engines")
def ckpt_engines() -> None:
    """List installed weight-sync transports (entry-point group drivetrain.ckpt_engines)."""
    console.print(plugin_table(registry.ckpt_engines))


app.command()(sft)
app.command()(grpo)
app.command()(ppo)


def main() -> None:
    app()
