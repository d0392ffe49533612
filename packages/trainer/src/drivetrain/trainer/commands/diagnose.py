"""``drivetrain diagnose mismatch``: load a model into an engine and a rollout, sync the
engine's weights into the rollout (or leave the rollout on its own checkpoint), and name the
first stage where they disagree (:mod:`drivetrain.trainer.diagnose`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from drivetrain.api.errors import DrivetrainError
from drivetrain.trainer.console import plain_console, print_error

console = plain_console()

DEFAULT_PROMPTS = ("What is 12 + 30?", "Name a colour.", "Count to five.")


def mismatch(
    model: Annotated[
        Path, typer.Argument(help="The Hugging Face model directory the trainer loads.")
    ],
    rollout: Annotated[str, typer.Option(help="Rollout backend (`drivetrain rollouts`).")] = "hf",
    engine: Annotated[str, typer.Option(help="Training engine (`drivetrain engines`).")] = "fsdp2",
    rollout_model: Annotated[
        Path | None,
        typer.Option(help="The rollout's own checkpoint, compared as it is (no sync)."),
    ] = None,
    prompt: Annotated[
        list[str] | None, typer.Option(help="A prompt (chat message); repeat for more.")
    ] = None,
    dtype: Annotated[str, typer.Option(help="dtype of both sides.")] = "float32",
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "cpu",
    tolerance: Annotated[
        float | None, typer.Option(help="log-prob tolerance (default from the dtype).")
    ] = None,
    numerics: Annotated[
        str, typer.Option(help="default, or exact (both sides: the ops should all agree).")
    ] = "default",
) -> None:
    """Name the first stage (weights, log-probs, ops) where a rollout and the trainer
    diverge, and the op where their forwards part; exits 1 when one diverges."""
    from drivetrain.api import ModelConfig, Prompt, registry
    from drivetrain.api.config import EngineConfig, RolloutConfig, coerce_config
    from drivetrain.trainer.diagnose import diagnose
    from drivetrain.trainer.preflight import load_tokenizer

    try:
        if numerics != "default":  # refused by a side that does not build it, never ignored
            from drivetrain.trainer.capabilities import require

            require("engine", registry.engines.spec(engine), "exact_numerics", "--numerics")
            require("rollout", registry.rollouts.spec(rollout), "exact_numerics", "--numerics")
        engine_cls = registry.engines.load_config_class(engine, EngineConfig)
        trainer = registry.engines.load(engine)(
            engine_cls(
                model=ModelConfig(path=str(model), dtype=dtype), device=device, numerics=numerics
            )
        )
        trainer.initialize()
        rollout_cls = registry.rollouts.load_config_class(rollout, RolloutConfig)
        served = str(rollout_model or model)
        config = coerce_config(
            RolloutConfig(model_path=served, dtype=dtype, device=device, numerics=numerics),
            rollout_cls,
        )
        sampler = registry.rollouts.load(rollout)(config)
        try:
            if rollout_model is None:  # the weight path under test: the trainer's export in
                with trainer.eval_mode():
                    sampler.update_weights(trainer.export_weights(), version=1)
            tokenizer = load_tokenizer(str(model))
            prompts = [
                Prompt(messages=({"role": "user", "content": text},))
                for text in (prompt or DEFAULT_PROMPTS)
            ]
            found = diagnose(
                trainer,
                sampler,
                prompts,
                dtype=dtype,
                tolerance=tolerance,
                pad_token_id=tokenizer.pad_token_id or 0,
            )
        finally:
            sampler.shutdown()
            trainer.close()
    except DrivetrainError as exc:
        print_error(console, exc)
        raise typer.Exit(2) from None
    for stage in found.stages:
        verdict = {True: "agrees", False: "DIVERGES", None: "not checked"}[stage.agrees]
        console.print(f"{stage.name:<14} {verdict:<12} {stage.detail}")
    console.print(found.summary())
    if found.first_divergence is not None:
        raise typer.Exit(1)
