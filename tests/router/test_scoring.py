"""The KV-aware scorer with worked numbers (default weights unless stated).

Defaults: prefill 1/token, local_prefill 2/token, transfer 4/block, decode_load 64/active
sequence, prefill_load 256/request, blocks_used 32 x fraction, local_prefill_max_tokens 256.
"""

from __future__ import annotations

import random

import pytest

from router.scoring import Candidate, ScoringWeights, choose, usable_blocks

W = ScoringWeights()
P = Candidate("p0", "p0:1", active_requests=0)
D = Candidate("d0", "d0:1", active_requests=0)


def pick(tokens, decode, prefill, held, weights=W, seed=0):
    return choose(tokens, 16, decode, prefill, held, weights, random.Random(seed))


def test_cold_long_prompt_goes_to_the_prefill_worker():
    # 1,040 tokens = 65 blocks, nothing cached anywhere.
    # local on d0: 2 x 1040 = 2080;  p0 -> d0: 1 x 1040 + 4 x 65 = 1300  -> remote wins
    c = pick(1040, [D], [P], {})
    assert (c.prefill, c.decode, c.cost) == (P, D, 1300)


def test_next_chat_turn_stays_on_the_decode_worker_with_no_transfer():
    # 1,100 tokens; d0 holds 64 blocks (1,024 tokens) from the previous turn.
    # d0 lacks 1100 - 1024 = 76 tokens < 256: local only, cost 2 x 76 = 152
    c = pick(1100, [D], [P], {"d0": 64})
    assert (c.prefill, c.cost, c.decode_cached_blocks) == (None, 152, 64)


def test_prefix_held_by_the_prefill_worker_is_reused_and_only_missing_blocks_move():
    # p0 holds the 64-block system prompt, d0 holds nothing; 1,100 tokens = 69 blocks.
    # local on d0: 2 x 1100 = 2200;  p0 -> d0: 1 x (1100 - 1024) + 4 x 69 = 352
    c = pick(1100, [D], [P], {"p0": 64})
    assert (c.prefill, c.cost, c.prefill_cached_blocks) == (P, 352, 64)
    # d0 holding 30 of the blocks: p0 -> d0 sends 69 - 30 = 39 blocks: 76 + 4 x 39 = 232
    # (local on d0 would prefill 1100 - 480 = 620 tokens: 1240)
    c = pick(1100, [D], [P], {"p0": 64, "d0": 30})
    assert (c.prefill, c.cost, c.decode_cached_blocks) == (P, 232, 30)


def test_decode_load_moves_the_request_to_an_idle_worker():
    busy = Candidate("d1", "d1:1", active_requests=3)
    idle = Candidate("d2", "d2:1", active_requests=0)
    # d1 holds 64 blocks of a 1,100-token prompt: local 2 x 76 + 64 x 3 = 344
    # d2 holds nothing: local 2 x 1100 = 2200, or p0 -> d2: 1100 + 4 x 69 = 1376  -> d1 wins
    assert pick(1100, [busy, idle], [P], {"d1": 64}).decode is busy
    # with 20 active on d1: 152 + 64 x 20 = 1432 > 1376  -> p0 -> d2 wins
    swamped = Candidate("d1", "d1:1", active_requests=20)
    c = pick(1100, [swamped, idle], [P], {"d1": 64})
    assert (c.decode, c.prefill, c.cost) == (idle, P, 1376)


def test_kv_pool_pressure_counts_as_load():
    # short prompt, 100 tokens: local only. d1 half full: 200 + 32 x 0.5 = 216 vs d2 empty: 200
    half = Candidate("d1", "d1:1", active_requests=0, used_block_fraction=0.5)
    empty = Candidate("d2", "d2:1", active_requests=0)
    c = pick(100, [half, empty], [P], {})
    assert (c.decode, c.cost) == (empty, 200)


def test_busy_prefill_workers_lose_to_an_idle_one():
    # 1,040 tokens, nothing cached: p_busy 1300 + 256 x 2 = 1812, p_idle 1300
    busy = Candidate("p1", "p1:1", active_requests=2)
    idle = Candidate("p2", "p2:1", active_requests=0)
    assert pick(1040, [D], [busy, idle], {}).prefill is idle


def test_ties_are_broken_by_the_injected_random_source():
    d1, d2 = Candidate("d1", "a", 0), Candidate("d2", "b", 0)
    picks = {pick(100, [d1, d2], [], {}, seed=s).decode.worker_id for s in range(20)}
    assert picks == {"d1", "d2"}
    assert pick(100, [d1, d2], [], {}, seed=3) == pick(100, [d1, d2], [], {}, seed=3)


def test_the_last_token_is_never_counted_as_cached():
    # a 32-token prompt fully held (2 blocks): only 1 block is usable, 16 tokens to compute
    assert usable_blocks(2, 32, 16) == 1
    assert pick(32, [D], [P], {"d0": 2}).cost == 2 * 16


def test_per_request_overrides():
    # forbid local prefill for anything over 10 tokens: a next turn now goes remote
    eager = W.overridden({"local_prefill_max_tokens": 10, "local_prefill": 100})
    assert pick(1100, [D], [P], {"d0": 64}, eager).prefill is P
    with pytest.raises(ValueError, match="unknown routing weight"):
        W.overridden({"transfr": 1})


def test_no_decode_worker_is_an_error():
    with pytest.raises(ValueError, match="no decode worker"):
        pick(10, [], [P], {})


def every_cheapest_option(tokens, bs, decode, prefill, held, w):
    """The oracle: every (D, P or None) priced by the module docstring's formulas, D x P of them,
    and the ones that cost the least."""
    n = -(-tokens // bs)
    options = []
    for d in decode:
        d_held = usable_blocks(held.get(d.worker_id, 0), tokens, bs)
        d_load = w.decode_load * d.active_requests + w.blocks_used * d.used_block_fraction
        lacking = tokens - bs * d_held
        options.append((w.local_prefill * lacking + d_load, d.worker_id, None))
        if lacking < w.local_prefill_max_tokens:
            continue
        for p in prefill:
            p_held = usable_blocks(held.get(p.worker_id, 0), tokens, bs)
            cost = (w.prefill * (tokens - bs * p_held) + w.transfer * (n - d_held)
                    + w.prefill_load * p.active_requests + d_load)
            options.append((cost, d.worker_id, p.worker_id))
    best = min(c for c, _, _ in options)
    return best, {(d, p) for c, d, p in options if c == best}


@pytest.mark.parametrize("seed", range(200))
def test_choose_finds_a_cheapest_option_of_all_d_times_p_and_can_pick_each(seed):
    rng = random.Random(seed)
    bs, tokens = 16, rng.randrange(1, 2048)
    decode = [Candidate(f"d{i}", "", rng.randrange(3), rng.choice([0.0, 0.5]))
              for i in range(rng.randrange(1, 5))]
    prefill = [Candidate(f"p{i}", "", rng.randrange(3)) for i in range(rng.randrange(0, 5))]
    held = {c.worker_id: rng.choice([0, 0, tokens // 32, tokens // 16]) for c in decode + prefill}
    best, cheapest = every_cheapest_option(tokens, bs, decode, prefill, held, W)
    picked = set()
    for tie_seed in range(4 * len(cheapest)):
        c = choose(tokens, bs, decode, prefill, held, W, random.Random(tie_seed))
        assert c.cost == best
        picked.add((c.decode.worker_id, c.prefill.worker_id if c.prefill else None))
    assert picked <= cheapest
    assert len(picked) > 1 or len(cheapest) == 1  # ties are broken among them, not always the first


def test_a_host_tier_hit_is_credited_below_a_device_hit_and_above_none():
    from router.scoring import LowerHeld
    d_dev, d_host, d_none = (Candidate(w, w, 0) for w in ("dev", "host", "none"))
    held = {"dev": 10, "host": 10}
    lower = {"host": LowerHeld(host=10)}
    w = ScoringWeights(local_prefill_max_tokens=10_000)
    cost = {c.worker_id: choose(200, 16, [c], [], held, w, random.Random(0), lower).cost
            for c in (d_dev, d_host, d_none)}
    assert cost["dev"] < cost["host"] < cost["none"]
    # the host hit costs exactly its measured reload fraction of a recompute of those 160 tokens
    assert cost["host"] - cost["dev"] == pytest.approx(w.local_prefill * 160 * w.host_reload)


def test_held_by_tier_follows_each_workers_device_run_with_its_host_then_disk_run():
    from pdserve.engine.events import Tier, index_key
    from router.scoring import LowerHeld, held_by_tier
    hashes = [bytes([i]) * 16 for i in range(6)]
    holds = {"a": set(hashes[:2]) | {index_key(h, Tier.HOST) for h in hashes[2:4]}
             | {index_key(hashes[4], Tier.DISK)},
             "b": {index_key(h, Tier.HOST) for h in hashes[:3]}}

    def match(keys):
        out = {}
        for w, held in holds.items():
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            out[w] = n
        return out

    held, lower = held_by_tier(match, hashes, tiered={"a", "b"})
    assert held == {"a": 5, "b": 3}
    assert lower == {"a": LowerHeld(host=2, disk=1), "b": LowerHeld(host=3)}


def test_held_by_tier_asks_the_index_once_when_no_worker_has_a_lower_tier():
    """The hot path: a cluster without host or disk tiers pays one match a decision, not one per
    tier and distinct run length (each with a tier key hashed per block)."""
    from router.scoring import held_by_tier
    hashes = [bytes([i]) * 16 for i in range(64)]
    runs = {f"w{i}": i for i in range(16)}  # 16 distinct device runs
    calls = []

    def match(keys):
        calls.append(len(keys))
        return runs if keys[0] == hashes[0] else {}

    held, lower = held_by_tier(match, hashes, tiered=set())
    assert (held, lower) == ({w: n for w, n in runs.items() if n}, {})
    assert calls == [64]


def test_held_by_tier_reads_a_prompts_hashes_only_as_far_as_some_worker_holds_them():
    """The decision's hashing stops with the index's match: blocks after the deepest held run, in any
    tier, are never hashed (the same figures as hashing the whole prompt)."""
    from pdserve.engine.events import Tier, index_key
    from pdserve.engine.hashing import PromptHashes, hash_blocks
    from pdserve.index.base import WorkerKey
    from pdserve.index.memory import InMemoryPrefixIndex
    from router.scoring import LowerHeld, held_by_tier
    tokens, salt = list(range(16 * 128)), b"s" * 16
    whole = hash_blocks(tokens, 16, salt)
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    a, b = WorkerKey("a", 1), WorkerKey("b", 1)
    for w in (a, b):
        index.set_live(w, 60)
    index.apply(a, whole[:10], [])
    index.apply(a, [index_key(h, Tier.HOST) for h in whole[10:20]], [])  # a: 10 device + 10 host
    index.apply(b, whole[:5], [])

    lazy = PromptHashes(tokens, 16, salt)
    held, lower = held_by_tier(index.match, lazy, tiered={"a"})
    assert (held, lower) == held_by_tier(index.match, whole, tiered={"a"})
    assert held == {"a": 20, "b": 5} and lower == {"a": LowerHeld(host=10)}
    assert lazy.computed <= 21 + PromptHashes.CHUNK_BLOCKS  # the 21 blocks read, in chunks; not all 128
