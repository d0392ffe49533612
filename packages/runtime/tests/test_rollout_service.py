"""The rollout service on the pure-Python fake rollout: futures complete with what the
rollout's own ``generate`` gives, whoever polls; a pause leaves nothing running and resumes
partial rollouts with their tokens and versions; abort, refusals and a failing rollout end
exactly their requests; closing leaves nothing running and nobody waiting."""

from __future__ import annotations

import time
from concurrent.futures import wait
from dataclasses import replace

import pytest

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.api.requests import Request
from drivetrain.runtime.rollout_service import RolloutService, ServiceClosed
from drivetrain.testing.fake_rollout import FakeRollout, FakeRolloutConfig

pytestmark = pytest.mark.timeout(60)

PROMPTS = [(1, 2), (3,), (4, 5, 6)]


def rollout(**overrides) -> FakeRollout:
    return FakeRollout(FakeRolloutConfig(max_model_len=64, seed=3, **overrides))


def requests(prefix: str, max_new_tokens: int = 6) -> list[Request]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [
        Request(f"{prefix}-{i}", ids, replace(params, seed=100 + i), prompt_index=i)
        for i, ids in enumerate(PROMPTS)
    ]


class SlowRollout(FakeRollout):
    """A token step takes 5 ms: a test can act while requests run."""

    def poll(self, timeout_s: float = 0.0):
        time.sleep(0.005)
        return super().poll(timeout_s)


class SlowStepRollout(FakeRollout):
    """A token step takes 5 ms wherever it runs (a poll, or the rollout's own thread)."""

    def _step(self, joining, aborted):
        time.sleep(0.005)
        return super()._step(joining, aborted)


def left_running(r: FakeRollout) -> bool:
    return bool(r.requests._running or r.requests._waiting)


@pytest.mark.parametrize(("threads", "background"), [(True, False), (False, False), (True, True)])
def test_futures_complete_with_what_generate_gives(threads: bool, background: bool) -> None:
    ours, theirs = rollout(), rollout()
    with RolloutService([ours], threads=threads, background=background) as service:
        assert service.background == [background]
        futures = service.submit_many(0, requests("a"))
        while not threads and not all(f.done() for f in futures):
            service.pump()
        got = [f.result(timeout=30) for f in futures]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [
        theirs.generate([Prompt(token_ids=ids)], replace(params, seed=100 + i))[0]
        for i, ids in enumerate(PROMPTS)
    ]
    assert [(c.token_ids, c.log_probs) for c in got] == [(c.token_ids, c.log_probs) for c in want]
    assert not left_running(ours)


@pytest.mark.parametrize(("threads", "background"), [(True, False), (False, False), (True, True)])
def test_a_pause_aborts_and_resumes_partial_rollouts(threads: bool, background: bool) -> None:
    """Inside ``paused`` nothing of the service runs on the rollout (another caller generates);
    resumable requests continue afterwards with their first tokens' versions kept, the others
    end with what they had."""
    slow = SlowStepRollout if background else SlowRollout
    r = slow(FakeRolloutConfig(max_model_len=64, seed=3))
    service = RolloutService([r], threads=threads, background=background)
    try:
        resumed = service.submit_many(0, requests("a", max_new_tokens=40), resume_aborted=True)
        ended = service.submit(0, requests("b", max_new_tokens=40)[0])
        if threads:
            deadline = time.monotonic() + 30
            while r.steps < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            service.pump(2)
        with service.paused():
            assert not left_running(r)
            r.update_weights([], version=1)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
            assert len(r.generate([Prompt(token_ids=(1,))], greedy)) == 1
        assert ended.result(timeout=30).finish_reason is FinishReason.ABORT
        while not threads and not all(f.done() for f in resumed):
            service.pump()
        for future in resumed:
            c = future.result(timeout=30)
            assert len(c.token_ids) == 40 and c.finish_reason is FinishReason.LENGTH
            assert c.token_versions[0] == 0 and c.token_versions[-1] == 1
    finally:
        service.close()
    assert not left_running(r)


def test_abort_ends_a_request_for_good() -> None:
    r = rollout()
    with RolloutService([r], threads=False) as service:
        future = service.submit(0, requests("a", max_new_tokens=30)[0], resume_aborted=True)
        service.pump(2)
        service.abort("a-0")
        while not future.done():
            service.pump()
        completion = future.result()
    assert completion.finish_reason is FinishReason.ABORT
    assert 2 <= len(completion.token_ids) < 30


def test_a_refused_request_fails_its_own_futures_only() -> None:
    r = rollout()
    too_long = Request("x", (1,) * 60, SamplingParams(max_new_tokens=10), prompt_index=0)
    with RolloutService([r]) as service:
        refused = service.submit(0, too_long)
        fine = service.submit_many(0, requests("a"))
        with pytest.raises(ValueError, match="max_model_len"):
            refused.result(timeout=30)
        assert all(f.result(timeout=30).finish_reason is FinishReason.LENGTH for f in fine)


class CountingSubmits(FakeRollout):
    def submit(self, requests):
        super().submit(requests)
        self.submitted = [*getattr(self, "submitted", []), len(requests)]


def test_a_turns_submits_and_continuations_reach_the_rollout_in_one_call() -> None:
    """A rollout stepping between the calls it serves steps once per call: six requests of
    two submits, and their six continuations after a pause, are one call each time."""
    r = CountingSubmits(FakeRolloutConfig(max_model_len=64, seed=3))
    with RolloutService([r], threads=False) as service:
        futures = service.submit_many(0, requests("a", max_new_tokens=20), resume_aborted=True)
        futures += service.submit_many(0, requests("b", max_new_tokens=20), resume_aborted=True)
        service.pump(2)
        with service.paused():
            r.update_weights([], version=1)
        while not all(f.done() for f in futures):
            service.pump()
        assert r.submitted == [6, 6]
    for future in futures:
        c = future.result()
        assert len(c.token_ids) == 20 and c.token_versions[0] == 0 and c.token_versions[-1] == 1


def test_a_refused_request_in_a_turn_with_others_fails_alone() -> None:
    r = CountingSubmits(FakeRolloutConfig(max_model_len=64, seed=3))
    too_long = Request("x", (1,) * 60, SamplingParams(max_new_tokens=10), prompt_index=0)
    with RolloutService([r], threads=False) as service:
        fine = service.submit_many(0, requests("a")[:1])
        refused = service.submit(0, too_long)
        fine += service.submit_many(0, requests("a")[1:])
        while not all(f.done() for f in fine):
            service.pump()
        with pytest.raises(ValueError, match="max_model_len"):
            refused.result(timeout=30)
    assert all(f.result().finish_reason is FinishReason.LENGTH for f in fine)
    assert r.submitted == [1, 2]  # the call of all three was refused whole: one call each


class FailingRollout(FakeRollout):
    def poll(self, timeout_s: float = 0.0):
        if self.steps >= 2 and not getattr(self, "healed", False):
            raise ConnectionError("the rollout process died")
        return super().poll(timeout_s)


def test_a_failing_poll_fails_that_replicas_requests_and_the_service_goes_on() -> None:
    bad, good = FailingRollout(FakeRolloutConfig(max_model_len=64)), rollout()
    with RolloutService([bad, good]) as service:
        failed = service.submit_many(0, requests("a"))
        fine = service.submit_many(1, requests("b"))
        for future in failed:
            with pytest.raises(ConnectionError, match="process died"):
                future.result(timeout=30)
        assert all(f.result(timeout=30).token_ids for f in fine)
        bad.healed = True
        assert service.submit(0, requests("c")[0]).result(timeout=30).token_ids


def test_closing_drains_what_runs_and_fails_what_waits() -> None:
    r = rollout()
    service = RolloutService([r], threads=False)
    running = service.submit(0, requests("a", max_new_tokens=30)[0], resume_aborted=True)
    service.pump(2)
    queued = service.submit(0, requests("b")[0])
    service.close()
    assert running.result().finish_reason is FinishReason.ABORT  # what it generated, kept
    with pytest.raises(ServiceClosed):
        queued.result()
    with pytest.raises(ServiceClosed):
        service.submit(0, requests("c")[0]).result()
    assert not left_running(r)


def test_threads_poll_only_replicas_with_work_and_never_wait_in_a_poll() -> None:
    class Counting(FakeRollout):
        polls: list[float]

        def poll(self, timeout_s: float = 0.0):
            self.polls.append(timeout_s)
            return super().poll(timeout_s)

    idle, busy = Counting(FakeRolloutConfig(max_model_len=64)), Counting(FakeRolloutConfig())
    idle.polls, busy.polls = [], []
    with RolloutService([idle, busy]) as service:
        wait(service.submit_many(1, requests("a")), timeout=30)
        polled = len(busy.polls)
        time.sleep(0.2)  # an idle replica's thread waits for commands, without polling
        assert len(busy.polls) == polled and not idle.polls
    assert set(busy.polls) == {0.0}


def test_a_rollout_generating_on_its_own_is_polled_at_an_interval() -> None:
    """Background generation: the rollout steps on its own thread, the service collects every
    ``BACKGROUND_POLL_S`` (several token steps a poll, never waiting in one), the outputs are
    those of a polled rollout, and closing stops the rollout's thread."""

    class Counting(SlowStepRollout):
        polls = 0

        def poll(self, timeout_s: float = 0.0):
            self.polls += 1
            return super().poll(timeout_s)

    ours, theirs = Counting(FakeRolloutConfig(max_model_len=64, seed=3)), rollout()
    with RolloutService([ours], background=True) as service:
        assert ours.requests.in_background
        got = [f.result(timeout=30) for f in service.submit_many(0, requests("a", 40))]
    assert not ours.requests.in_background
    assert ours.steps >= 40 and ours.polls < ours.steps / 2  # 5 ms steps, 20 ms polls
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = [
        theirs.generate([Prompt(token_ids=ids)], replace(params, seed=100 + i))[0]
        for i, ids in enumerate(PROMPTS)
    ]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_a_failing_step_in_the_background_fails_the_next_poll() -> None:
    """The rollout's own thread ends at a step that raises; its requests end aborted and the
    next poll raises the error (as a polled step would have), polls step again afterwards."""
    r = rollout()
    real = r._step

    def broken(joining, aborted):
        r._step = real  # once
        raise RuntimeError("the backend crashed mid-step")

    r._step = broken
    r.requests._step = broken
    r.background_generation(True)
    r.submit(requests("a"))
    with pytest.raises(RuntimeError, match="crashed mid-step"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r.poll(0.1)
    assert not r.requests.in_background
    chunks = r.poll(0.0)
    assert {c.finish_reason for c in chunks} == {FinishReason.ABORT}


class BrokenAbort(FakeRollout):
    def abort(self, request_ids=None):
        raise ConnectionError("the rollout's channel is gone")


def test_closing_ends_every_future_even_when_the_rollout_cannot_abort() -> None:
    r = BrokenAbort(FakeRolloutConfig(max_model_len=64))
    service = RolloutService([r], threads=False)
    running = service.submit(0, requests("a", max_new_tokens=30)[0])
    service.pump(2)
    queued = service.submit(0, requests("b")[0])
    service.close()  # logs the failed abort; raises nothing
    with pytest.raises(ConnectionError, match="channel is gone"):
        running.result(timeout=1)
    with pytest.raises(ServiceClosed):
        queued.result(timeout=1)


class StepFailsOnce(FakeRollout):
    def _step(self, joining, aborted):
        if self.steps == 2 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("a CUDA error, say")
        return super()._step(joining, aborted)


def test_a_failed_generate_leaves_nothing_for_the_next_caller() -> None:
    r = StepFailsOnce(FakeRolloutConfig(max_model_len=64, seed=3))
    params = SamplingParams(max_new_tokens=6, seed=1)
    with pytest.raises(RuntimeError, match="a CUDA error"):
        r.generate([Prompt(token_ids=ids) for ids in PROMPTS], params)
    assert not left_running(r)
    assert len(r.generate([Prompt(token_ids=(1,))], params)) == 1  # no stray chunks


def test_closing_gives_a_sequence_between_segments_what_it_generated() -> None:
    """Aborted by a weight update, its continuation queued: closing ends it with its tokens."""
    r = rollout()
    service = RolloutService([r], threads=False)
    future = service.submit(0, requests("a", max_new_tokens=30)[0], resume_aborted=True)
    service.pump(3)
    r.pause_generation(abort=True)
    service.pump()  # collects the abort; the continuation waits in the queue
    service.close()
    completion = future.result(timeout=1)
    assert completion.finish_reason is FinishReason.ABORT and len(completion.token_ids) == 3


def test_nothing_is_pumped_while_paused() -> None:
    r = rollout()
    with RolloutService([r], threads=False) as service, service.paused():
        service.submit(0, requests("a")[0])
        assert service.pump(3) == 0 and not left_running(r)


def test_a_bug_in_a_poller_fails_its_waiters_and_refuses_later_submits(monkeypatch) -> None:
    def broken(self, replica, poll_s):
        raise KeyError("a bug")

    monkeypatch.setattr(RolloutService, "_poll", broken)
    r = rollout()
    with RolloutService([r]) as service:
        with pytest.raises(ServiceClosed, match="failed: 'a bug'"):
            service.submit(0, requests("a")[0]).result(timeout=30)
        with pytest.raises(ServiceClosed, match="stopped"):
            service.submit(0, requests("b")[0]).result(timeout=1)
    assert not left_running(r)


def test_users_take_turns_and_each_release_leaves_nothing_running() -> None:
    """The placement's one service: a user polls it in threads, releases it (what it left
    running is drained, its queued submits fail), and the next user starts clean."""
    r = SlowRollout(FakeRolloutConfig(max_model_len=64, seed=3))
    service = RolloutService([r], threads=False)
    service.poll_in_threads()
    first = service.submit_many(0, requests("first", max_new_tokens=40))
    service.release()
    assert all(f.done() for f in first) and not left_running(r) and not service.alive
    service.poll_in_threads()
    again = service.submit_many(0, requests("again"))
    wait(again, timeout=30)
    assert [f.result().finish_reason for f in again] == [FinishReason.LENGTH] * len(PROMPTS)
    service.release()
    service.shutdown()


def test_generate_splits_prompts_over_the_replicas_in_order() -> None:
    """Each replica's contiguous share through its own batch generate; prompt indices are the
    call's, and with one replica the completions are the rollout's own."""
    one, a, b = rollout(), rollout(), rollout()
    prompts = [Prompt(token_ids=ids) for ids in PROMPTS]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=7)
    service = RolloutService([a, b], threads=False)
    split = service.generate(prompts, params)
    assert [c.prompt_index for c in split] == [0, 1, 2]
    assert [c.token_ids for c in split[:2]] == [
        c.token_ids for c in one.generate(prompts[:2], params)
    ]
    alone = RolloutService([one], threads=False)
    assert alone.generate(prompts, params) == one.generate(prompts, params)
    service.shutdown()
    alone.shutdown()
