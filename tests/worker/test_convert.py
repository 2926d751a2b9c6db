"""The proto conversions carry every sampling field and logprob across the wire unchanged."""

from __future__ import annotations

import struct

from pdserve.engine.sequence import SamplingParams, TokenLogprob
from pdserve.worker.convert import (
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from protos.pdserve.v1 import generation_pb2


def float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_logprobs_unset_stays_unset_and_zero_stays_zero():
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).logprobs is None
    assert not sampling_to_proto(SamplingParams()).HasField("logprobs")
    for k in (0, 5, 20):
        assert sampling_from_proto(sampling_to_proto(SamplingParams(logprobs=k))).logprobs == k


def test_token_logprobs_round_trip_exactly_through_bytes():
    """float32 values (what the engine computes) survive the proto's float fields bit for bit."""
    value = float32(-0.123456789)
    logprobs = [TokenLogprob(7, value, ((7, value), (3, float32(-2.5)))), TokenLogprob(9, -1.0, ())]
    sent = [p.SerializeToString() for p in logprobs_to_proto(logprobs)]
    wire = [generation_pb2.TokenLogprob.FromString(data) for data in sent]
    assert logprobs_from_proto(wire) == logprobs
