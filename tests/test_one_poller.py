"""Rollout traffic has one owner (issues 40, 56): outside the rollout service's request poller,
no product code polls a rollout (the rollout kit alone does, as the test of the poll contract
itself), and product code builds one rollout service: the placement's."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
#: the one poller, and the rollout kit (its plumbing and checks) that tests ``poll`` itself
ALLOWED = {
    "runtime/request_poller.py",
    "testing/src/drivetrain/testing/rollout_harness.py",
    "testing/src/drivetrain/testing/rollout_kit.py",
    "testing/src/drivetrain/testing/rollout_kit_limits.py",
    "testing/src/drivetrain/testing/rollout_kit_background.py",
}


def _rollout_polls(path: Path) -> list[int]:
    """Lines that call ``.poll(...)`` on something named like a rollout."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        func = node.func if isinstance(node, ast.Call) else None
        polls = isinstance(func, ast.Attribute) and func.attr == "poll"
        if polls and "rollout" in ast.unparse(func.value):
            found.append(node.lineno)
    return found


def test_only_the_rollout_service_polls_rollouts() -> None:
    sources = list(PACKAGES.glob("*/src/drivetrain/**/*.py"))
    polls = {str(p.relative_to(PACKAGES)): lines for p in sources if (lines := _rollout_polls(p))}
    unexpected = {p: lines for p, lines in polls.items() if not p.endswith(tuple(ALLOWED))}
    assert not unexpected, f"rollouts polled outside the rollout service: {unexpected}"
    assert any(p.endswith("runtime/request_poller.py") for p in polls)  # the check sees it


def test_product_code_builds_one_rollout_service_in_the_placement() -> None:
    built = {}
    for path in PACKAGES.glob("*/src/drivetrain/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("RolloutService"):
                built.setdefault(str(path.relative_to(PACKAGES)), []).append(node.lineno)
    assert list(built) == ["trainer/src/drivetrain/trainer/rl/placement.py"], built
    assert len(next(iter(built.values()))) == 1, built
