"""engine-api is the contracts and their kits (issue 40): the machinery that serves them lives
in drivetrain-runtime or where it is used, so the api every plugin pins stays small enough to
read. Its modules stay within 2,780 lines (2,500 until ``Rollout.background_generation``
joined the contract, 2,510 until ``hosting.HostingConfig``, the knobs of a rollout in another
environment, did: its machinery is drivetrain-runtime's; 2,549 until the optional
``Environment.demonstration``; 2,557 until ``numerics`` (an engine's and a rollout's) and the
optional ``trace_ops`` of both, for exact numerics and where a gap comes from; 2,590 until
routing replay's ``routed_experts``: the column, ``RoutedExperts`` on chunks and completions, the
engines' ``OutputSpec.routed_experts``, the rollouts' ``return_routed_experts``; 2,720 until an
engine's optional planner: ``PluginSpec.planner`` and ``plan``'s ``RankWork`` and ``MemoryPlan``);
the kits are drivetrain-testing's."""

from pathlib import Path

import drivetrain.api

BUDGET = 2_780


def test_the_api_outside_its_kits_stays_within_its_budget():
    root = Path(drivetrain.api.__file__).parent
    sizes = {
        p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in root.rglob("*.py")
    }
    assert sum(sizes.values()) <= BUDGET, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert len(sizes) >= 15  # the walk found the package


def test_the_kits_live_in_their_own_distribution():
    """The conformance kits, fakes and the pytest plugin are drivetrain-testing's: installing
    the contracts changes no pytest run and brings no test double."""
    root = Path(drivetrain.api.__file__).parent
    assert not (root / "testing").exists()
    assert not (root / "pytest_plugin.py").exists()
