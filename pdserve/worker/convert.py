"""Plain conversions between protobuf messages and engine types (no I/O)."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.sampling_defaults import NEUTRAL, SAMPLING_FIELDS, SamplingDefaults
from pdserve.engine.sequence import SamplingParams, TokenLogprob, Usage
from protos.pdserve.v1 import generation_pb2

DEFAULT_MAX_TOKENS = 128


def sampling_with_defaults(p: generation_pb2.SamplingParams,
                           defaults: SamplingDefaults) -> generation_pb2.SamplingParams:
    """A copy of p with every sampling field it left unset (temperature, top_p, top_k) set to the
    default; a field p sets, 0 included, stays as it is."""
    filled = generation_pb2.SamplingParams()
    filled.CopyFrom(p)
    for name in SAMPLING_FIELDS:
        if not p.HasField(name):
            setattr(filled, name, getattr(defaults, name))
    return filled


def sampling_from_proto(p: generation_pb2.SamplingParams) -> SamplingParams:
    """ValueError naming the field when a value is out of range. An unset sampling field is the
    neutral one: the router sends workers every field set (router/service.py), so this only
    applies to a worker called directly."""
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else NEUTRAL.temperature,
        top_k=p.top_k if p.HasField("top_k") else NEUTRAL.top_k,
        top_p=p.top_p if p.HasField("top_p") else NEUTRAL.top_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


def sampling_to_proto(s: SamplingParams) -> generation_pb2.SamplingParams:
    p = generation_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                      max_tokens=s.max_tokens, stop_token_ids=list(s.stop_token_ids),
                                      stop=list(s.stop), ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    return p


def logprob_to_proto(lp: TokenLogprob) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(p: generation_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, tuple((t.token_id, t.logprob) for t in p.top))


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[generation_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in logprobs]


def logprobs_from_proto(protos: Iterable[generation_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [logprob_from_proto(p) for p in protos]


def usage_to_proto(u: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                                computed_tokens=u.computed_tokens, completion_tokens=u.completion_tokens,
                                host_cached_tokens=u.host_cached_tokens,
                                disk_cached_tokens=u.disk_cached_tokens)
