"""The RL loop stays the algorithm (issue 40): its step is short, the run's mode is read where
the source is chosen (and where config refuses what does not fit), and an update sends the
columns its loss reads."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from drivetrain.trainer.rl import trainer, update_losses
from drivetrain.trainer.rl.batch_ops import ENGINE_COLUMNS
from drivetrain.trainer.rl.update_losses import ActorLoss, CriticLoss

RL = Path(trainer.__file__).parent
#: where ``algorithm.mode`` may be compared: choosing the source, and refusing in config
MODE_READERS = {"source_choice.py", "config.py", "job.py"}


def test_the_step_is_at_most_40_lines():
    source = inspect.getsource(trainer.RLTrainer.step)
    assert len(source.splitlines()) <= 40, len(source.splitlines())


def _mode_comparisons(path: Path) -> list[int]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Attribute) and side.attr == "mode":
                    owner = side.value
                    name = (
                        owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    )
                    if name in ("alg", "algorithm"):
                        found.append(node.lineno)
    return found


def test_the_mode_is_compared_only_where_the_source_is_chosen():
    readers = {p.name: lines for p in RL.glob("*.py") if (lines := _mode_comparisons(p))}
    assert set(readers) <= MODE_READERS, readers
    assert "source_choice.py" in readers  # the check sees the comparisons it allows


def _batch_reads(fn: object) -> set[str]:
    """The columns ``fn`` reads from its mini-batch ``mb`` (``mb[NAME]``, ``NAME in mb``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "mb":
            names.add(node.slice)
        if isinstance(node, ast.Compare) and any(
            getattr(c, "id", "") == "mb" for c in node.comparators
        ):
            names.add(node.left)
    return {getattr(update_losses, n.id) for n in names if isinstance(n, ast.Name)}


def test_an_update_sends_exactly_the_columns_its_loss_reads():
    for loss in (ActorLoss, CriticLoss):
        read = _batch_reads(loss.__call__) - set(ENGINE_COLUMNS)
        assert read == set(loss.reads), (loss.__name__, read ^ set(loss.reads))
