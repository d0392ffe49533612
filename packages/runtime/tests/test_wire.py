"""The JSON wire codec: plain data round-trips; anything else is refused and nothing runs."""

from __future__ import annotations

import os
import pickle

import pytest

from drivetrain.api.rollout import FinishReason, SamplingParams
from drivetrain.runtime.wire import PLAIN, Codec, WireError

pytestmark = pytest.mark.fault


def test_plain_data_round_trips_with_its_types():
    message = ("bucket", 1, {"version": 3, "tensors": [("w", (2, 3), "float32", 0, 24)]},
               {1: b"\x00\xff"}, {"$odd": None}, [1.5, True])  # fmt: skip
    assert PLAIN.decode(PLAIN.encode(message)) == message


def test_classes_only_where_the_codec_allows_them():
    codec = Codec((SamplingParams, FinishReason))
    message = (SamplingParams(n=2, temperature=0.5), FinishReason.ABORT)
    assert codec.decode(codec.encode(message)) == message
    with pytest.raises(WireError, match="not allowed"):
        PLAIN.decode(codec.encode(message))
    with pytest.raises(WireError, match="plain data only"):
        PLAIN.encode(object())


class _Runs:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(
    "data", [pickle.dumps(_Runs()), b'{"$dataclass": "os:system", "fields": {}}', b"\xff"]
)
def test_anything_else_is_a_wire_error(data):
    with pytest.raises(WireError, match="not a drivetrain wire message"):
        PLAIN.decode(data)


def test_a_class_decoded_once_is_still_checked_every_time():
    """The decoder remembers a class it allowed: later messages of it still run its
    constructor's checks, and a class it never allowed is still refused."""
    codec = Codec((SamplingParams,))
    good = codec.encode([SamplingParams(n=2), SamplingParams(n=3, seed=7)])
    assert codec.decode(good) == [SamplingParams(n=2), SamplingParams(n=3, seed=7)]
    bad = good.replace(b'"n":3', b'"n":0')  # the constructor refuses n < 1
    with pytest.raises(WireError, match="n=0 must be >= 1"):
        codec.decode(bad)
    with pytest.raises(WireError, match="not allowed"):
        codec.decode(good.replace(b"SamplingParams", b"Prompt"))
    with pytest.raises(WireError, match="not allowed"):
        codec.decode(b'{"$dataclass": "os:system", "fields": {}}')
