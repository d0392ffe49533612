"""Closing a megatron engine destroys the process groups megatron-core built for it.

megatron-core's ``destroy_model_parallel`` only forgets its groups; torch.distributed keeps
them, and every gloo group keeps its threads. A process that builds engine after engine (the
conformance kit, the test workers) reached over 5000 threads and a load average in the
hundreds, and the 2-rank megatron tests ran past their timeouts."""

import pytest

from megatron_harness import build_tiny_model
from megatron_launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_closed_engines_leave_no_groups_or_threads(tmp_path):
    model = build_tiny_model(str(tmp_path / "llama"), family="llama", layers=2)
    ranks = launch("worker_groups.py", tmp_path, model, "4", nproc=2, timeout=240)
    for report in ranks:
        assert all(r["groups_built"] > 2 for r in report), report  # megatron built its groups
        assert all(r["groups_left"] == 1 for r in report), report  # the launcher's world only
        threads = [r["threads"] for r in report]
        assert threads[-1] <= threads[0] + 4, threads  # not a gloo group's worth per engine
