"""The sglang rollout's request machinery without sglang: :class:`LoopStreams` behind a
:class:`RequestQueue`, reading (with the backend's own :func:`stream_event`) an asyncio
streaming server that answers as SGLang's ``async_generate(stream=True)`` does: every output is
the request's whole output so far, it knows requests by the id it was given (the backend id,
not the request's), and it forgets a request a little after it ended, as SGLang's tokenizer
manager does once its scheduler reported the end."""

import asyncio

import pytest

from drivetrain.api.requests import Request
from drivetrain.api.rollout import FinishReason, SamplingParams
from drivetrain.rollout.sglang.requests import stream_event
from drivetrain.rollout.sglang.streams import LoopStreams
from drivetrain.runtime.collector import Collector
from drivetrain.runtime.request_queue import RequestQueue

pytestmark = pytest.mark.timeout(60)


class TokenServer:
    """Request ``r`` streams tokens ``last prompt token + 1, + 2, ...``, one per tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop, forget_after_s: float = 0.02) -> None:
        self.loop = loop
        self.forget_after_s = forget_after_s
        self.held: set[str] = set()  # backend ids
        self.rids: dict[str, list[str]] = {}  # request id -> the backend ids it ran under
        self.failing: set[str] = set()
        self.cancelled: list[str] = []
        self.closed: list[str] = []

    async def open(self, request: Request, rid: str):
        if rid in self.held:
            raise ValueError(f"Duplicate request ID {rid}")  # as SGLang refuses one
        self.held.add(rid)
        self.rids.setdefault(request.request_id, []).append(rid)
        return self._stream(request, rid)

    async def _stream(self, request: Request, rid: str):
        tokens: list[int] = []
        budget = request.params.max_new_tokens
        try:
            while len(tokens) < budget:
                await asyncio.sleep(0.002)
                if request.request_id in self.failing:
                    raise ValueError(f"the server failed on {request.request_id}")
                tokens.append(request.prompt_ids[-1] + len(tokens) + 1)
                done = len(tokens) == budget
                yield {
                    "output_ids": tokens,
                    "meta_info": {
                        "finish_reason": {"type": "length"} if done else None,
                        "output_token_logprobs": [(-t / 100, t, None) for t in tokens],
                        "completion_tokens": len(tokens),
                    },
                }
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.closed.append(request.request_id)
            if self.forget_after_s is not None:
                self.loop.call_later(self.forget_after_s, self.held.discard, rid)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def queue_over(server: TokenServer, capacity: int = 8, version=lambda: 0):
    streams = LoopStreams(server.loop, server.open, stream_event, server.held.__contains__)
    queue = RequestQueue(streams.step, version, capacity=capacity, reset=streams.reset)
    return queue, streams


def request(request_id: str, last: int, tokens: int) -> Request:
    return Request(request_id, (1, last), SamplingParams(temperature=0, max_new_tokens=tokens))


def run(queue: RequestQueue, collector: Collector, polls: int = 2000) -> None:
    for _ in range(polls):
        if collector.done:
            return
        collector.add(queue.poll(0.05))
    raise AssertionError("the requests did not finish")


def submit_tracked(queue, requests) -> Collector:
    """Submit ``requests`` with a collector tracking them."""
    collector = Collector()
    for r in requests:
        collector.track(r)
    queue.submit(requests, lambda r: None)
    return collector


def test_requests_stream_their_tokens_and_log_probs_and_end_with_the_servers_reason(loop):
    server = TokenServer(loop)
    queue, _ = queue_over(server)
    requests = [request("a", 10, 5), request("b", 20, 3)]
    collector = submit_tracked(queue, requests)
    run(queue, collector)
    a, b = collector.completions()
    assert a.token_ids == (11, 12, 13, 14, 15) and b.token_ids == (21, 22, 23)
    assert a.log_probs == pytest.approx([-0.11, -0.12, -0.13, -0.14, -0.15])
    assert a.finish_reason is FinishReason.LENGTH and set(a.token_versions) == {0}
    assert sorted(server.closed) == ["a", "b"]  # finished streams are closed, not left open


def test_backend_ids_are_fresh_and_never_a_prefix_of_each_other(loop):
    """SGLang aborts every request whose id starts with the aborted one's and refuses an id
    still in use: ``a1`` and ``a10`` must not reach it as such, nor an id reused at once."""
    server = TokenServer(loop, forget_after_s=1.0)
    queue, _ = queue_over(server, capacity=16)
    requests = [request(f"a{i}", 10, 2) for i in range(12)]
    collector = submit_tracked(queue, requests)
    run(queue, collector)
    again = request("a1", 10, 2)  # the same id again while the server still holds the first
    collector = submit_tracked(queue, [again])
    run(queue, collector)
    rids = [rid for ids in server.rids.values() for rid in ids]
    assert len(set(rids)) == 13 and len(server.rids["a1"]) == 2
    assert not any(x != y and y.startswith(x) for x in rids for y in rids)


def test_an_aborted_request_keeps_its_tokens_so_far_and_the_others_run_on(loop):
    server = TokenServer(loop)
    queue, streams = queue_over(server)
    requests = [request("long", 10, 400), request("short", 50, 20)]
    collector = submit_tracked(queue, requests)
    started = False
    while not started:
        chunks = queue.poll(0.05)
        collector.add(chunks)
        started = any(c.request_id == "long" and c.token_ids for c in chunks)
    assert queue.abort(["long"]) == 1
    run(queue, collector)
    long, short = collector.completions()
    assert long.finish_reason is FinishReason.ABORT and 0 < len(long.token_ids) < 400
    assert long.token_ids == tuple(range(11, 11 + len(long.token_ids)))  # what it had, in order
    assert short.token_ids == tuple(range(51, 71)) and short.finish_reason is FinishReason.LENGTH
    assert server.cancelled == ["long"]
    with queue.lock:
        streams.settle(5.0)  # the server forgets the aborted request a little later
    assert server.rids["long"][0] not in server.held


def test_settle_gives_up_on_a_backend_that_keeps_an_aborted_request(loop):
    server = TokenServer(loop, forget_after_s=None)
    queue, streams = queue_over(server)
    queue.submit([request("stuck", 10, 400)], lambda r: None)
    while not queue.poll(0.05):
        pass
    queue.abort(["stuck"])
    queue.poll(0.0)
    with pytest.raises(RuntimeError, match=r"still holds 1 aborted requests .*'stuck'"):
        streams.settle(0.1)


def test_a_failing_stream_ends_every_running_request_and_raises(loop):
    server = TokenServer(loop)
    queue, streams = queue_over(server)
    server.failing.add("bad")
    queue.submit([request("bad", 10, 50), request("good", 20, 400)], lambda r: None)
    with pytest.raises(ValueError, match="the server failed on bad"):
        for _ in range(200):
            queue.poll(0.05)
    ended = {c.request_id: c.finish_reason for c in queue.poll(0.0) if c.finished}
    assert ended == {"bad": FinishReason.ABORT, "good": FinishReason.ABORT}
    assert streams.running == set() and "good" in server.cancelled
    collector = submit_tracked(queue, [request("again", 30, 4)])  # it serves the next ones
    run(queue, collector)
    assert collector.completion("again").token_ids == (31, 32, 33, 34)


def test_capacity_holds_requests_in_the_queue_until_one_ends(loop):
    server = TokenServer(loop)
    queue, streams = queue_over(server, capacity=2)
    requests = [request(f"r{i}", 10 * i, 6) for i in range(1, 6)]
    collector = submit_tracked(queue, requests)
    most = 0
    while not collector.done:
        collector.add(queue.poll(0.05))
        most = max(most, len(streams.running))
    assert most == 2
    assert [c.token_ids[0] for c in collector.completions()] == [11, 21, 31, 41, 51]


def test_finish_running_lets_running_requests_end_under_the_old_version_and_starts_none(loop):
    server = TokenServer(loop)
    version = [0]
    queue, streams = queue_over(server, capacity=1, version=lambda: version[0])
    first, waiting = request("first", 10, 30), request("waiting", 20, 3)
    collector = submit_tracked(queue, [first, waiting])
    collector.add(queue.poll(0.05))
    with queue.lock:  # as a weight update does
        queue.finish_running()
        assert streams.running == set()
        version[0] = 1
    run(queue, collector)
    assert set(collector.completion("first").token_versions) == {0}
    assert len(collector.completion("first").token_ids) == 30
    assert set(collector.completion("waiting").token_versions) == {1}
