"""What ``drivetrain plan`` says: a job's plan (and its step time on paper) as JSON and lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain.api.plan import GiB
from drivetrain.trainer.plan_target import PlanTarget
from drivetrain.trainer.plan_time import ModelShape, StepTime, StepWork, step_time
from drivetrain.trainer.planning import JobPlan, PlanInputs, refusal


def time_of(
    inputs: PlanInputs, target: PlanTarget, *, rollout_gpus: int = 0, rollout_tp: int = 1
) -> StepTime | None:
    """The step's time on paper (:mod:`~drivetrain.trainer.plan_time`) at the limits of its
    lengths: the first training role's model shape; generation on the training GPUs when the
    rollout is colocated, else on ``rollout_gpus``. None without a model config."""
    path = Path(inputs.roles[0].config.model.path) / "config.json"
    if not path.is_file():
        return None
    from transformers import AutoConfig

    shape = ModelShape.of(AutoConfig.from_pretrained(path.parent))
    trained = sum(r.train for r in inputs.roles)
    work = StepWork(
        sequences=inputs.sequences,
        prompt=inputs.prompt or inputs.length,
        new=inputs.new,
        trained=trained,
        scored=len(inputs.roles) - trained + inputs.old_log_probs,
        epochs=inputs.epochs,
        checkpointing=inputs.roles[0].config.model.gradient_checkpointing,
    )
    generating = target.gpus if inputs.colocated else rollout_gpus
    return step_time(
        shape, work, target.device, train_gpus=target.gpus,
        rollout_gpus=generating if inputs.new else 0, rollout_tp=rollout_tp,
    )  # fmt: skip


def report(job: str, plan: JobPlan, fixes: list[Any], time: StepTime | None) -> dict[str, Any]:
    """The JSON of ``drivetrain plan --json``."""
    target, peak = plan.target, plan.peak
    return {
        "job": job,
        "gpus": target.gpus,
        "nodes": target.nodes,
        "gpu": target.device.name,
        "device_gib": target.device.memory_gib,
        "fits": plan.fits(),
        "peak_gib": round(peak.bytes / GiB, 2) if peak else None,
        "busiest": peak.name if peak else None,
        "phases": [
            {
                "phase": p.name,
                "gib": round(p.bytes / GiB, 2),
                "parts": {k: round(v / GiB, 3) for k, v in p.parts.items()},
            }
            for p in plan.phases
        ],
        "roles": [r.row() for r in plan.roles],
        "unplanned": list(plan.unplanned),
        "fits_with": [setting for setting, _ in fixes],
        "step_time": time.row(target.gpus) if time else None,
    }


def lines(result: dict[str, Any], plan: JobPlan, fixes: list[Any]) -> list[str]:
    """The plain report: a line per role, per phase, the verdict, the step time."""
    out = []
    for role in result["roles"]:
        if not role["planned"]:
            out.append(f"{role['role']} ({role['engine']}): unplanned: {role['reason']}")
            continue
        parts = ", ".join(f"{k} {v:.3g}" for k, v in role["gib"].items() if v)
        verb = "trains" if role["trains"] else "scores"
        out.append(
            f"{role['role']} ({role['engine']}, {role['world_size']} ranks) {verb} "
            f"{role['tokens']} tokens a micro-batch: own peak {role['peak_gib']:g} GiB "
            f"({parts})"
        )
    flipped = result.get("checkpointing_flipped")
    if flipped:
        out.append(
            f"{flipped['role']} with gradient_checkpointing="
            f"{str(flipped['gradient_checkpointing']).lower()}: own peak {flipped['peak_gib']:g} "
            f"GiB (activations {flipped['activations_gib']:.3g})"
        )
    for phase in result["phases"]:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in phase["parts"].items())
        out.append(f"  {phase['phase']}: {phase['gib']:g} GiB ({parts})")
    for reason in result["unplanned"]:
        if reason.startswith("rollout"):
            out.append(f"{reason}: unplanned")
    time = result["step_time"]
    if time:
        out.append(
            f"step time on paper: {time['roofline_s']:.3g} s at the roofline (generate "
            f"{time['generate_s']:.3g}, score {time['score_s']:.3g}, train "
            f"{time['train_s']:.3g}); {time['at_measured_mfu_s']:.3g} s with training at "
            f"fsdp2's measured MFU: {time['tokens_per_s_per_gpu']:,.0f} tokens/s a GPU"
        )
    if result["fits"] is False:
        out.append(refusal(plan, fixes))
    elif result["peak_gib"] is not None:
        verdict = "fits" if result["fits"] else "fits, as far as planned"
        out.append(
            f"peak {result['peak_gib']:g} GiB a rank ({result['busiest']}) of "
            f"{result['device_gib']:g} on {result['gpus']} x {result['gpu']}: {verdict}"
        )
    return out
