"""Every family pdserve serves, on its tiny twin (write_tiny_model(arch=...)), against transformers
and against the no-cache reference.

For each of llama, llama3 (Llama with Llama 3's rope scaling), mistral (a sliding window on every
layer), qwen2 (q/k/v biases, tied embeddings), qwen3 (q/k norms, head_dim apart from hidden/heads)
and gemma3 (everything in families.py's Gemma row, a window on its local layer):

- transformers' AutoModelForCausalLM on the same directory: logits within LOGIT_TOL on torch's
  kernels (what transformers runs), dense and paged; 32 greedy tokens identical, on torch's kernels
  and on the defaults (native where the extension builds: they sum in other orders);
- the exactness suite (tests/engine/test_exactness.py's check) on the defaults: batched, prefix
  hits, chunked prefill, preemption, the host and disk tiers, int8 and fp8 caches, on prompts
  longer than every window and than llama3's original_max_position_embeddings (64);
- the KV audit finds every cached block within its dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.audit import TOLERANCE, KVAuditor
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.tiny_model import TINY_ARCHS
from tests.conftest import TORCH_KERNELS, assert_no_leaks, make_engine
from tests.engine.test_exactness import check_against_reference, varied_prompts
from tests.engine.test_oracle import CONTINUATION, LOGIT_TOL, hf_greedy, hf_logits, paged_last_logits

ARCHS = tuple(TINY_ARCHS)
LONG = 100  # tokens: longer than every tiny window (40, 24) and than llama3's original 64 positions


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    models = {}

    def get(directory):
        if directory not in models:
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
            models[directory] = model.eval()
        return models[directory]

    return get


def long_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(44)
    return [*varied_prompts(vocab), torch.randint(0, vocab, (LONG,), generator=g).tolist()]


def prompt_of(length: int, vocab: int, seed: int = 3) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(family_model, hf_model, arch):
    directory, loaded = family_model(arch)
    ids = prompt_of(LONG, loaded.config.vocab_size)
    theirs = hf_logits(hf_model(directory), ids)
    engine = make_engine(loaded, **TORCH_KERNELS)
    with torch.inference_mode():
        dense = engine.model.reference_logits(ids)
    assert (dense - theirs).abs().max().item() <= LOGIT_TOL
    assert (paged_last_logits(engine, ids) - theirs[-1]).abs().max().item() <= LOGIT_TOL
    assert_no_leaks(engine)


@pytest.mark.parametrize("kernels", ["torch", "defaults"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(family_model, hf_model, arch, kernels):
    directory, loaded = family_model(arch)
    ids = prompt_of(70, loaded.config.vocab_size, seed=5)
    chosen = TORCH_KERNELS if kernels == "torch" else {}
    engine = make_engine(loaded, block_size=4, budget=16, **chosen)  # chunked, many blocks
    [ours] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=CONTINUATION, ignore_eos=True),
                             detokenize=False)
    assert ours.token_ids == hf_greedy(hf_model(directory), ids, CONTINUATION)
    assert_no_leaks(engine)


def batched(loaded, kv_dtype, prompts):
    check_against_reference(make_engine(loaded, kv_dtype=kv_dtype), prompts)


def prefix_hits(loaded, kv_dtype, prompts):
    engine = make_engine(loaded, kv_dtype=kv_dtype)
    check_against_reference(engine, prompts)
    assert sum(r.usage.cached_tokens for r in check_against_reference(engine, prompts)) > 0


def chunked(loaded, kv_dtype, prompts):
    check_against_reference(make_engine(loaded, budget=7, kv_dtype=kv_dtype), prompts)


def preempted(loaded, kv_dtype, prompts):
    engine = make_engine(loaded, block_size=8, num_blocks=18, budget=32, kv_dtype=kv_dtype)
    assert sum(r.usage.preemptions for r in check_against_reference(engine, prompts)) > 0


def host_tier(loaded, kv_dtype, prompts):
    engine = make_engine(loaded, block_size=8, num_blocks=18, budget=32, kv_dtype=kv_dtype, host_blocks=96)
    check_against_reference(engine, prompts)
    assert sum(r.usage.host_cached_tokens for r in check_against_reference(engine, prompts)) > 0


PATHS = (batched, prefix_hits, chunked, preempted, host_tier)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_cache_path_matches_the_reference(family_model, arch, path):
    _, loaded = family_model(arch)
    path(loaded, "float32", long_prompts(loaded.config.vocab_size))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_caches_match_their_reference(family_model, arch, kv_dtype):
    _, loaded = family_model(arch)
    prompts = long_prompts(loaded.config.vocab_size)
    prefix_hits(loaded, kv_dtype, prompts)
    chunked(loaded, kv_dtype, prompts)


@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_come_back_from_the_disk_tier_exactly(family_model, arch, tmp_path):
    _, loaded = family_model(arch)
    prompts = long_prompts(loaded.config.vocab_size)
    engine = make_engine(loaded, block_size=8, num_blocks=18, budget=32, host_blocks=4,
                         disk_dir=str(tmp_path))
    check_against_reference(engine, prompts)
    results = check_against_reference(engine, prompts)
    assert sum(r.usage.host_cached_tokens for r in results) > 0  # host and disk hits are counted together


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_audit_finds_every_cached_block_within_tolerance(family_model, arch, kv_dtype):
    _, loaded = family_model(arch)
    engine = make_engine(loaded, block_size=8, num_blocks=24, budget=32, kv_dtype=kv_dtype)
    check_against_reference(engine, long_prompts(loaded.config.vocab_size))
    report = KVAuditor(engine).audit()
    assert report.mismatched == 0 and report.checked > 0, report
    assert report.max_rel_diff <= TOLERANCE[kv_dtype] / 4, report
    assert_no_leaks(engine)
