"""A rollout in another process, through one proxy and one host:

    caller ── RemoteRollout ──(Channel)──▶ RolloutHost ── rollout

where the channel is a pipe to a server process (another Python environment) or a Ray actor.

Every call is a method name and positional arguments (plain data: :mod:`drivetrain.runtime.wire`
on a pipe), dispatched by name on the far side among :data:`ROLLOUT_CALLS` and nothing else.
The host keeps the rollout's receiving end of the weight path
(:class:`~drivetrain.runtime.weight_receiver.WeightReceiver`) next to the weights; the proxy's
:meth:`RemoteRollout.weight_receiver` reaches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from drivetrain.api.config import RolloutConfig, WeightSyncConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.registry import ckpt_engines
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, Prompt, Rollout, SamplingParams
from drivetrain.api.weight_sync import SyncStats, Topology
from drivetrain.runtime.request_queue import QueuedRollout
from drivetrain.runtime.weight_receiver import Receiving, WeightReceiver
from drivetrain.runtime.wire import config_fields

#: what a proxy may ask of the far side
ROLLOUT_CALLS = frozenset(
    {
        "generate",
        "submit",
        "poll",
        "abort",
        "pause_generation",
        "resume_generation",
        "weight_version",
        "weights_fingerprint",
        "sleep",
        "wake_up",
        "shutdown",
        "weights_connect",
        "weights_receive",
        "weights_disconnect",
        "background_generation",
    }
)
#: the calls that answer within a token step (they queue, collect or flag; none waits for
#: generation or weights): a channel bounds each by the rollout's ``stall_timeout_s`` plus its
#: own wait, whatever the far side says of being alive, so a host hung inside one is named
QUICK_CALLS = frozenset(
    {"submit", "poll", "abort", "resume_generation", "background_generation", "weight_version"}
)


class Channel(Protocol):
    """How a proxy reaches its host."""

    def call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        """``host.call(method, *args)`` on the far side; ``wait_s``: seconds the call may
        take beyond the channel's own timeout (a poll that waits)."""

    def send_weights_inline(self, weights: Iterable[NamedTensor], version: int) -> None:
        """``rollout.update_weights`` on the far side with this stream, the tensors inline on
        the channel: the path of a caller that holds the rollout without a transport
        (``drivetrain diagnose``, the rollout kit). A training run never takes it (its weights
        arrive through the weight-sync transport, ``weights_receive``); a channel without it
        raises ``NotImplementedError``."""

    def close(self) -> None:
        """After ``shutdown``: release the process or actor."""


class RolloutHost:
    """The far side: one rollout and its weight receiver, answering calls by name. A host
    whose owner serves calls in a loop (``steps_between_calls``: the rollout server process)
    runs a queued rollout's background generation itself, one token step between calls
    (:meth:`step`), so no second thread contends for the process's GIL."""

    def __init__(self, rollout: Rollout, *, steps_between_calls: bool = False) -> None:
        self.rollout = rollout
        #: the queue this host steps between calls (a queued rollout's, when asked to)
        self._queue = (
            rollout.requests if steps_between_calls and isinstance(rollout, QueuedRollout) else None
        )
        # a host of a proxy (a Ray actor whose rollout runs in a server process) forwards the
        # receiving end to the proxy's host, next to the weights, instead of receiving here
        # and copying every tensor over the pipe
        self.weights: Receiving = (
            rollout.weight_receiver()
            if isinstance(rollout, RemoteRollout)
            else WeightReceiver(rollout)
        )

    def call(self, method: str, *args: Any) -> Any:
        if method not in ROLLOUT_CALLS:
            raise ValueError(f"{method!r} is not a rollout call")
        match method:
            case "weight_version":
                return self.rollout.weight_version
            case "pause_generation":
                return self.rollout.pause_generation(abort=bool(args[0]))
            case "weights_connect":
                transport, fields, rank, topology, endpoint = args
                config = _transport_config(transport, fields)
                return self.weights.connect(
                    transport, config, rank=rank, topology=topology, endpoint=endpoint
                )
            case "weights_receive":
                return self.weights.receive(*args)
            case "weights_disconnect":
                return self.weights.disconnect()
            case "background_generation" if self._queue is not None:
                self._queue.step_between_calls(bool(args[0]))
                return bool(args[0])
            case "shutdown":
                try:
                    self.rollout.background_generation(False)  # nothing steps on what it frees
                    self.weights.disconnect()
                finally:  # a transport that fails to leave does not keep the rollout alive
                    self.rollout.shutdown()
                return None
        return getattr(self.rollout, method)(*args)

    def step(self) -> bool:
        """One token step of background generation run by this host; whether it ran."""
        return self._queue is not None and self._queue.step_if_work()


def _transport_config(transport: str, fields: Mapping[str, Any]) -> WeightSyncConfig:
    """``transport``'s config class, as installed here, built from ``fields``: a transport
    missing in this environment raises the registry's one line naming what to install."""
    config_class = ckpt_engines.load_config_class(transport, WeightSyncConfig)
    return config_class(**fields)


class RemoteReceiver:
    """A rollout's receiving end, reached through its proxy's channel."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def connect(
        self,
        transport: str,
        config: WeightSyncConfig,
        *,
        rank: int,
        topology: Topology,
        endpoint: Mapping[str, Any],
    ) -> None:
        # the config's fields, rebuilt by plugin name on the far side: an environment without
        # the transport answers with its one-line install hint, not a wire decoding error
        fields = config_fields(config)
        self.channel.call("weights_connect", transport, fields, rank, topology, dict(endpoint))

    def receive(self, version: int) -> SyncStats:
        return self.channel.call("weights_receive", version)

    def disconnect(self) -> None:
        self.channel.call("weights_disconnect")


class RemoteRollout(Rollout):
    """The proxy: the rollout contract forwarded by name over ``channel``."""

    def __init__(self, config: RolloutConfig, channel: Channel) -> None:
        super().__init__(config)
        self.channel = channel

    def weight_receiver(self) -> Receiving:
        """The receiving end of this rollout's weight path, in the host's process."""
        return RemoteReceiver(self.channel)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self.channel.call("generate", list(prompts), params)

    def submit(self, requests: Sequence[Request]) -> None:
        self.channel.call("submit", list(requests))

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        return self.channel.call("poll", timeout_s, wait_s=timeout_s)

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        return self.channel.call("abort", None if request_ids is None else list(request_ids))

    def pause_generation(self, *, abort: bool = False) -> int:
        return self.channel.call("pause_generation", abort)

    def resume_generation(self) -> None:
        self.channel.call("resume_generation")

    def background_generation(self, enabled: bool) -> bool:
        return bool(self.channel.call("background_generation", bool(enabled)))

    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        self.channel.send_weights_inline(weights, version)

    @property
    def weight_version(self) -> int:
        return self.channel.call("weight_version")

    def weights_fingerprint(self, expected: Mapping[str, str]) -> Mapping[str, str] | None:
        return self.channel.call("weights_fingerprint", dict(expected))

    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)  # validates the level here
        return self.channel.call("sleep", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        super().wake_up(tags)
        self.channel.call("wake_up", None if tags is None else tuple(tags))

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # a host that is gone already is shut down
            self.channel.call("shutdown")
        self.channel.close()
