"""What a built-in job trains before it starts, told instead of done: ``--print-config`` and
``--dry-run`` never train, they say which cached model is missing and how the run makes it."""

from __future__ import annotations

from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.student import STUDENT_SFT_STEPS, cached_student_model
from drivetrain.trainer.builtin.tool_warm_start import ToolTaskAssets, cached_sft_model
from drivetrain.trainer.job_config import TaskLayers


def untrained_prerequisites(
    assets: addition.AdditionAssets, *, engine: str, student: bool = False
) -> list[str]:
    """One line per model the built-in job (on ``engine``) would train first; none when every
    one is cached. ``student``: the distillation demo's student too."""
    lines = []
    if addition.cached_sft_model(assets.root.parent) is None:
        lines.append(
            f"the built-in SFT model {assets.root / addition.SFT_MODEL} does not exist yet: the "
            f"run trains it first with the SFT default (`drivetrain sft --engine {engine}`)"
        )
    if student and cached_student_model(assets) is None:
        lines.append(
            f"the distillation student does not exist yet: the run trains it first "
            f"({STUDENT_SFT_STEPS} SFT steps on --engine {engine})"
        )
    return lines


def untrained_tool_task(assets: ToolTaskAssets, *, engine: str) -> list[str]:
    """A built-in agentic job's line (``env=calculator``, or an environment's demonstrated
    warm start), when its tool-using SFT model is not cached."""
    if cached_sft_model(assets) is not None:
        return []
    return [
        f"the {assets.task} task's SFT model {assets.sft_model} does not exist yet: the run "
        f"trains it first ({assets.sft_path}, --engine {engine})"
    ]


def untrained(task: TaskLayers | None, *, engine: str, student: bool = False) -> list[str]:
    """The lines of the built-in task a job runs (none for the user's own data and model)."""
    if task is None:
        return []
    if isinstance(task.assets, ToolTaskAssets):
        return untrained_tool_task(task.assets, engine=engine)
    return untrained_prerequisites(task.assets, engine=engine, student=student)
