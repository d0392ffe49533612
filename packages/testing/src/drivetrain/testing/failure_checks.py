"""Conformance check that a failure on one rank reaches every rank.

An engine's ranks run collectives in lockstep: a rank that raises before a collective its peers
have entered leaves them waiting until the process group's timeout (30 minutes by default), and
the job looks hung instead of failed. The micro-batch driver
(:mod:`drivetrain.runtime.micro_batching`) shares the failure with every rank first; this check
holds any engine to that.
"""

from __future__ import annotations

import unittest

from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.errors import BatchError
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.steps import LENGTHS, capabilities, data, gather, make, token_mean_nll


def check_split_failure_reaches_every_rank(h: EngineHarness) -> None:
    """A shard that one rank cannot cut into micro-batches (a sample longer than the token
    budget) makes every rank raise a ``BatchError``, the same one, from ``forward_backward``.
    Under data parallelism only the rank holding the long sample fails to cut its shard."""
    if "dynamic_batch" not in capabilities(h):
        raise unittest.SkipTest("only a token budget can fail to cut a shard (no dynamic_batch)")
    engine = make(h, MicroBatchConfig(max_tokens=max(LENGTHS) - 1))
    outcome = "forward_backward raised nothing"
    try:
        shard = engine.parallel.shard_of(data(h))
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward(shard, token_mean_nll)
    except BatchError as exc:
        outcome = f"BatchError: {exc}"
    finally:
        engine.close()
    outcomes = gather(h, outcome)
    assert all(o.startswith("BatchError: ") for o in outcomes), (
        f"a sample over the token budget must fail every rank with a BatchError: {outcomes}"
    )
    assert len(set(outcomes)) == 1, f"the ranks raised different errors: {outcomes}"
