"""Worker calls name the worker class's method, never a string; ranks dispatch by name, so a
subclass's override runs; the reference is a role object, not a mode string."""

import pytest

from drivetrain.api import Batch
from drivetrain.api.engine import ParallelInfo
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.workers.group import LocalWorkerGroup, method_name
from drivetrain.trainer.workers.role_worker import ACTOR, REFERENCE


class BaseWorker:
    def initialize(self) -> ParallelInfo:
        return ParallelInfo()

    def shard(self, batch: Batch) -> Batch:
        return batch.select([0])

    def close(self) -> None:
        pass

    def save(self, path: str, step: int) -> str:
        return f"base {path} {step}"

    def count(self, shard: Batch, extra: int) -> int:
        return len(shard) + extra


class Override(BaseWorker):
    def save(self, path: str, step: int) -> str:
        return f"override {path} {step}"


def test_calls_dispatch_by_name_to_the_ranks_worker():
    group = LocalWorkerGroup(Override)
    assert group.run_all(BaseWorker.save, "/ckpt", 3) == "override /ckpt 3"
    batch = Batch.from_columns({"input_ids": [[1, 2], [3]]}, seq_lens=[2, 1])
    assert group.run_sharded(BaseWorker.count, batch, 10) == 11  # the rank's shard: 1 sample
    assert group.gather_sharded(BaseWorker.count, batch, 0) == [1]


def test_a_method_name_as_a_string_is_refused_before_any_rank_runs():
    group = LocalWorkerGroup(BaseWorker)
    with pytest.raises(
        TypeError, match=r"worker class's method \(e.g. RoleWorker.train\), not 'save'"
    ):
        group.run_all("save", "/ckpt", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not a method of a worker class"):
        method_name(len)
    with pytest.raises(TypeError, match=r"positional arguments, not \['step'\]"):
        group.run_all(BaseWorker.save, "/ckpt", step=3)
    with pytest.raises(AttributeError):
        BaseWorker.svae  # noqa: B018 (a typo fails where the controller names the method)


def test_reference_role_object():
    assert not Reference("none").enabled and not Reference("none").computed
    engine, adapter = Reference("engine"), Reference("adapter")
    assert (engine.role, engine.adapter_off, engine.needs_engine) == (REFERENCE, False, True)
    assert (adapter.role, adapter.adapter_off, adapter.needs_engine) == (ACTOR, True, False)
    precomputed = Reference("precomputed")
    assert precomputed.enabled and not precomputed.computed
    with pytest.raises(ValueError, match="not computed by any role"):
        _ = precomputed.role
    with pytest.raises(ValueError, match="reference mode must be one of"):
        Reference("auto")
