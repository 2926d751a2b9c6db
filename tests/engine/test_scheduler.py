"""Scheduler: token budget, FCFS, prefix hits, preemption order; no model involved."""

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, StepShape
from pdserve.engine.sequence import SamplingParams, Sequence, SequenceStatus

SALT = b"s" * 16


def make_request(i: int, num_tokens: int, first_token: int = 0) -> Sequence:
    ids = [first_token + t for t in range(num_tokens)]
    return Sequence(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=8), arrival=i)


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, BlockPool(num_blocks, block_size), SALT)


def run_step(s: Scheduler, sampled_token: int = 1) -> SchedulerOutput:
    """Schedule, pretend the model ran, append one token to each sequence that sampled."""
    out = s.schedule()
    s.after_step(out.chunks)
    for c in out.chunks:
        if c.samples:
            c.seq.token_ids.append(sampled_token)
    return out


def chunks_of(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def finish_all(s: Scheduler) -> None:
    for seq in list(s.running) + list(s.waiting):
        s.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert s.pool.leaked_blocks() == []
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_chunked_prefill_spends_the_budget_fcfs():
    s = make_scheduler(budget=6)
    a, b = make_request(0, 10), make_request(1, 3, first_token=100)
    s.add(a)
    s.add(b)
    assert chunks_of(run_step(s)) == [("r0", 0, 6)]
    assert chunks_of(run_step(s)) == [("r0", 6, 4), ("r1", 0, 2)]
    assert chunks_of(run_step(s)) == [("r0", 10, 1), ("r1", 2, 1)]  # decode + rest of b's prefill
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3]
    finish_all(s)


def test_step_shape_counts_a_prompts_last_token_as_prefill_and_a_generated_one_as_decode():
    s = make_scheduler(budget=6)
    a, b = make_request(0, 10), make_request(1, 3, first_token=100)
    s.add(a)
    s.add(b)
    assert StepShape.of(run_step(s).chunks) == StepShape(((6, 0),), 0, 0)
    assert StepShape.of(run_step(s).chunks) == StepShape(((4, 6), (2, 0)), 0, 0)
    # a decodes its first generated token (context 11); b's one-token chunk is still its prompt's
    assert StepShape.of(run_step(s).chunks) == StepShape(((1, 2),), 1, 11)
    assert StepShape.of(run_step(s).chunks) == StepShape((), 2, 12 + 4)
    finish_all(s)


def test_prefix_hit_is_whole_blocks_and_leaves_last_token_to_compute():
    s = make_scheduler(block_size=4)
    first = make_request(0, 8)
    s.add(first)
    run_step(s)
    s.finish(first, SequenceStatus.FINISHED_STOPPED)  # its 2 full blocks stay cached
    same = make_request(1, 8)  # identical prompt: only 1 block reusable (last token computed)
    s.add(same)
    assert chunks_of(run_step(s)) == [("r1", 4, 4)]
    assert same.usage.cached_tokens == 4 and same.usage.computed_tokens == 4
    longer = make_request(2, 11)
    s.add(longer)
    assert chunks_of(run_step(s))[-1] == ("r2", 8, 3)
    assert longer.usage.cached_tokens == 8
    finish_all(s)


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 4 blocks of 2 tokens; two 3-token prompts take 2 blocks each, then grow.
    s = make_scheduler(num_blocks=4, block_size=2, budget=64)
    old, new = make_request(0, 3), make_request(1, 3, first_token=50)
    s.add(old)
    s.add(new)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    run_step(s)  # both at 4 tokens computed... still 2 blocks each
    out = run_step(s)  # old needs a third block: the newest (r1) is preempted
    assert [seq.request_id for seq in out.preempted] == ["r1"]
    assert chunks_of(out) == [("r0", 4, 1)]
    assert new.status is SequenceStatus.WAITING and new.block_ids == []
    assert list(s.waiting) == [new] and new.usage.preemptions == 1
    finish_all(s)


def test_waiting_request_that_does_not_fit_blocks_the_queue_without_leaking():
    s = make_scheduler(num_blocks=2, block_size=4)
    s.add(make_request(0, 6))  # 2 blocks
    s.add(make_request(1, 2, first_token=40))  # would need 1 more
    out = run_step(s)
    assert chunks_of(out) == [("r0", 0, 6)]
    assert len(s.waiting) == 1
    finish_all(s)


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add(make_request(i, 2, first_token=10 * i))
    assert [c.seq.request_id for c in run_step(s).chunks] == ["r0", "r1"]
    finish_all(s)


def test_full_blocks_are_committed_after_the_step_that_computed_them():
    s = make_scheduler(block_size=4, budget=5)
    seq = make_request(0, 9)
    s.add(seq)
    run_step(s)  # 5 computed: block 0 full
    assert s.pool.num_cached_blocks == 1
    run_step(s)  # 9 computed: blocks 0, 1 full
    assert s.pool.num_cached_blocks == 2
    finish_all(s)
