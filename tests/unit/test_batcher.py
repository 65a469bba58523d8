"""Batcher: token budget, running-first order, chunking, prefix hits, preemption, aborts, stops."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.worker.engine.batcher import Batcher, BatchPlan, RequestRejected, SchedulerConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request, RequestStatus
from shared.sampling_params import SamplingParams


def make_batcher(num_blocks=64, block_size=16, **config) -> Batcher:
    config.setdefault("max_model_len", 4096)
    cfg = SchedulerConfig(**config)
    return Batcher(cfg, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching))


def make_request(request_id, prompt, max_tokens=4, eos=(), **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=tuple(eos))


def next_token(tokens) -> int:
    """The fake model: a deterministic function of every token of the context."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7919 + len(tokens)) % 997 + 3


def reference_output(prompt, max_tokens) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    """Writes each computed position's "KV" (a key of its whole prefix) into the slot that the
    request's block table gives, and before sampling checks that every slot the request attends
    to holds its own prefix. A wrong block id, a stale prefix hit or a lost chunk fails here."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self.block_size = batcher.block_manager.block_size
        self.kv: dict[tuple[int, int], tuple] = {}

    def execute(self, plan: BatchPlan) -> list[int]:
        """The sampled tokens, one per plan.sampling row (as the engine hands them over)."""
        sampled = self.execute_by_id(plan)
        return [sampled[r.request_id] for r in plan.sampling]

    def execute_by_id(self, plan: BatchPlan) -> dict[str, int]:
        cfg = self.batcher.config
        assert plan.num_batched_tokens == sum(s.num_new_tokens for s in plan.scheduled)
        assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(plan.scheduled) <= cfg.max_num_seqs
        sampled = {}
        for s in plan.scheduled:
            r, bs = s.request, self.block_size
            assert s.start == r.num_computed_tokens and s.num_new_tokens >= 1
            assert s.num_new_tokens <= cfg.max_tokens_per_request_step
            assert s.num_new_tokens == 1 or s.num_new_tokens <= cfg.prefill_budget
            assert s.samples == (s.start + s.num_new_tokens == r.num_tokens)
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.kv[r.block_ids[pos // bs], pos % bs] = tuple(r.all_token_ids[:pos + 1])
            if s.samples:
                for pos in range(r.num_tokens):
                    assert self.kv[r.block_ids[pos // bs], pos % bs] == tuple(r.all_token_ids[:pos + 1])
                sampled[r.request_id] = next_token(r.all_token_ids)
        return sampled

    def step(self) -> tuple[BatchPlan, list[Request]]:
        plan = self.batcher.schedule()
        return plan, self.batcher.update_from_output(plan, self.execute(plan))

    def run(self, max_steps=10_000) -> list[BatchPlan]:
        plans = []
        while self.batcher.has_unfinished():
            plans.append(self.step()[0])
            assert len(plans) < max_steps
        return plans


def summary(plan: BatchPlan) -> list[tuple[str, int, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.start, s.samples) for s in plan.scheduled]


def test_token_budget_running_first_then_waiting():
    batcher = make_batcher(max_num_batched_tokens=64)
    for rid, base in (("a", 0), ("b", 1000), ("c", 2000)):  # no shared prefix
        batcher.add_request(make_request(rid, range(base, base + 100), max_tokens=3))
    runner = FakeRunner(batcher)
    plans = runner.run()
    assert [summary(p) for p in plans] == [
        [("a", 64, 0, False)],
        [("a", 36, 64, True), ("b", 28, 0, False)],
        [("a", 1, 100, True), ("b", 63, 28, False)],
        [("a", 1, 101, True), ("b", 9, 91, True), ("c", 54, 0, False)],
        [("b", 1, 100, True), ("c", 46, 54, True)],
        [("b", 1, 101, True), ("c", 1, 100, True)],
        [("c", 1, 101, True)],
    ]
    assert batcher.block_manager.num_free_blocks == 64


def test_long_prefill_threshold_gives_exact_chunks():
    batcher = make_batcher(long_prefill_token_threshold=7)
    batcher.add_request(make_request("a", range(20), max_tokens=2))
    batcher.add_request(make_request("b", range(50, 59), max_tokens=1))
    plans = FakeRunner(batcher).run()
    assert [summary(p) for p in plans] == [
        [("a", 7, 0, False), ("b", 7, 0, False)],
        [("a", 7, 7, False), ("b", 2, 7, True)],
        [("a", 6, 14, True)],
        [("a", 1, 20, True)],
    ]


def test_chunked_prefill_size_caps_the_prompt_tokens_of_a_step_not_its_decodes():
    """A decode worker's own prefills (chunked_prefill_size 8 here): every request's prompt
    tokens together stay within the cap, and decodes run beside them whatever the cap."""
    batcher = make_batcher(chunked_prefill_size=8)
    batcher.add_request(make_request("d", range(900, 902), max_tokens=6))
    batcher.add_request(make_request("a", range(10), max_tokens=2))
    batcher.add_request(make_request("b", range(50, 56), max_tokens=1))
    plans = FakeRunner(batcher).run()
    assert [summary(p) for p in plans] == [
        [("d", 2, 0, True), ("a", 6, 0, False)],
        [("d", 1, 2, True), ("a", 4, 6, True), ("b", 4, 0, False)],
        [("d", 1, 3, True), ("a", 1, 10, True), ("b", 2, 4, True)],
        [("d", 1, 4, True)],
        [("d", 1, 5, True)],
        [("d", 1, 6, True)],
    ]
    for plan in plans:
        assert sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1) <= 8


def test_decodes_lead_the_step_before_running_prompts_chunks():
    """A step's one-token rows come first (attention gives them to the decode kernel at once),
    even when an earlier-admitted prompt is still being chunked."""
    batcher = make_batcher(long_prefill_token_threshold=7)
    batcher.add_request(make_request("a", range(20), max_tokens=2))
    batcher.add_request(make_request("b", range(50, 52), max_tokens=3))
    plans = FakeRunner(batcher).run()
    assert [summary(p) for p in plans] == [
        [("a", 7, 0, False), ("b", 2, 0, True)],
        [("b", 1, 2, True), ("a", 7, 7, False)],
        [("b", 1, 3, True), ("a", 6, 14, True)],
        [("a", 1, 20, True)],
    ]


def test_request_added_later_joins_the_running_batch():
    batcher = make_batcher()
    runner = FakeRunner(batcher)
    a = make_request("a", range(10), max_tokens=5)
    batcher.add_request(a)
    assert summary(runner.step()[0]) == [("a", 10, 0, True)]
    batcher.add_request(make_request("b", range(30, 35), max_tokens=2))
    assert summary(runner.step()[0]) == [("a", 1, 10, True), ("b", 5, 0, True)]
    assert batcher.num_running == 2 and batcher.num_waiting == 0
    runner.run()
    assert a.output_token_ids == reference_output(range(10), 5)
    assert a.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("first_still_running", [True, False])
def test_prefix_hit_reuses_the_exact_blocks(first_still_running):
    batcher = make_batcher(num_blocks=16)
    bm, runner = batcher.block_manager, FakeRunner(batcher)
    shared = list(range(500, 532))
    a = make_request("a", shared + [1] * 8, max_tokens=3)
    batcher.add_request(a)
    runner.step()
    a_blocks = list(a.block_ids)
    assert a_blocks == [0, 1, 2]
    if not first_still_running:
        runner.run()
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits

    b = make_request("b", shared + [2] * 8, max_tokens=3)
    batcher.add_request(b)
    plan, _ = runner.step()
    assert summary(plan)[-1] == ("b", 8, 32, True)
    assert b.block_ids[:2] == a_blocks[:2] and b.num_cached_tokens == 32
    assert bm.prefix_cache_hits - hits == 32 and bm.prefix_cache_queries - queries == 40
    assert bm.ref_count(0) == (2 if first_still_running else 1)
    runner.run()
    assert b.output_token_ids == reference_output(shared + [2] * 8, 3)
    assert bm.num_free_blocks == 16


@pytest.mark.parametrize("num_blocks", [7, 8])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_and_matches_an_unconstrained_run(num_blocks, prefix_caching):
    prompts = {"a": range(6), "b": range(20, 26), "c": range(40, 46)}

    def run(blocks):
        batcher = make_batcher(num_blocks=blocks, block_size=4, enable_prefix_caching=prefix_caching)
        requests = [make_request(rid, p, max_tokens=8) for rid, p in prompts.items()]
        for r in requests:
            batcher.add_request(r)
        plans = FakeRunner(batcher).run()
        assert batcher.block_manager.num_free_blocks == blocks
        return requests, plans

    reference, plans = run(100)
    assert not any(p.preempted for p in plans)
    requests, plans = run(num_blocks)
    preemptions = [[r.request_id for r in p.preempted] for p in plans if p.preempted]
    assert preemptions[0] == ["c"]  # the latest admitted goes first, whoever ran short
    assert requests[2].num_preemptions >= 1
    for r, ref in zip(requests, reference):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == ref.output_token_ids == reference_output(prompts[r.request_id], 8)


def test_preemption_skips_admission_and_requeues_at_the_front():
    batcher = make_batcher(num_blocks=7, block_size=4)
    runner = FakeRunner(batcher)
    for rid, base in (("a", 0), ("b", 20), ("c", 40)):
        batcher.add_request(make_request(rid, range(base, base + 6), max_tokens=8))
    for _ in range(3):  # prompt, then tokens 7 and 8: two blocks each, one left free
        runner.step()
    batcher.add_request(make_request("d", range(60, 62), max_tokens=1))
    plan, _ = runner.step()  # token 9 of each needs a third block
    assert summary(plan) == [("a", 1, 8, True), ("b", 1, 8, True)]
    assert [r.request_id for r in plan.preempted] == ["c"]
    c = batcher.get("c")
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_ids == []
    assert [r.request_id for r in batcher.waiting_requests()] == ["c", "d"]
    assert [r.request_id for r in batcher.running_requests()] == ["a", "b"]
    assert batcher.num_waiting == 2 and batcher.num_running == 2 and batcher.num_preemptions_total == 1


def test_max_num_seqs_limits_the_running_set():
    batcher = make_batcher(max_num_seqs=2)
    for i in range(4):
        batcher.add_request(make_request(f"r{i}", range(i, i + 5), max_tokens=2))
    runner = FakeRunner(batcher)
    plan, _ = runner.step()
    assert [s.request.request_id for s in plan.scheduled] == ["r0", "r1"]
    assert batcher.num_running == 2 and batcher.num_waiting == 2
    plans = runner.run()
    assert all(len(p.scheduled) <= 2 for p in plans)


def test_abort_frees_blocks_at_once():
    batcher = make_batcher(num_blocks=16)
    runner = FakeRunner(batcher)
    a, b = make_request("a", range(40)), make_request("b", range(40))
    batcher.add_request(a)
    runner.step()
    batcher.add_request(b)
    assert batcher.block_manager.num_free_blocks == 13
    assert batcher.abort("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert batcher.block_manager.num_free_blocks == 16 and batcher.num_running == 0
    assert batcher.abort("a") is None and batcher.abort("nope") is None
    assert batcher.abort("b") is b  # waiting
    assert not batcher.has_unfinished() and batcher.num_waiting == 0


def test_abort_between_schedule_and_update_is_skipped():
    batcher = make_batcher(num_blocks=16)
    runner = FakeRunner(batcher)
    a, b = make_request("a", range(20)), make_request("b", range(30, 50))
    batcher.add_request(a)
    batcher.add_request(b)
    plan = batcher.schedule()
    sampled = runner.execute(plan)
    batcher.abort("a")
    assert batcher.update_from_output(plan, sampled) == []
    assert a.num_computed_tokens == 0 and a.num_output_tokens == 0
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1
    assert batcher.block_manager.num_free_blocks == 14


def test_finish_with_error_leaves_the_others_alone():
    batcher = make_batcher(num_blocks=16)
    runner = FakeRunner(batcher)
    a, b = make_request("a", range(20)), make_request("b", range(30, 50))
    batcher.add_request(a)
    batcher.add_request(b)
    runner.step()
    assert batcher.finish_with_error("a", "boom") is a
    assert a.status == RequestStatus.FINISHED_ERROR and a.error == "boom" and a.block_ids == []
    runner.run()
    assert b.output_token_ids == reference_output(range(30, 50), 4)
    # A sampled token the engine forgot fails that request only.
    c, d = make_request("c", range(5)), make_request("d", range(9))
    batcher.add_request(c)
    batcher.add_request(d)
    plan = batcher.schedule()
    finished = batcher.update_from_output(plan, {"d": 7})
    assert finished == [c] and c.status == RequestStatus.FINISHED_ERROR and "no sampled token" in c.error
    assert d.output_token_ids == [7] and batcher.num_running == 1


def test_never_fitting_requests_are_rejected_with_the_numbers():
    batcher = make_batcher(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match=r"64 tokens.*maximum context length of 64"):
        batcher.add_request(make_request("long", range(64)))
    with pytest.raises(RequestRejected, match=r"need 5 KV blocks of 4 tokens.*only 4 blocks"):
        batcher.add_request(make_request("big", range(10), max_tokens=10))
    with pytest.raises(RequestRejected, match="empty"):
        batcher.add_request(make_request("empty", []))
    ok = make_request("ok", range(10), max_tokens=7)  # 16 tokens of KV: exactly 4 blocks
    batcher.add_request(ok)
    with pytest.raises(RequestRejected, match="already queued"):
        batcher.add_request(make_request("ok", range(3)))
    FakeRunner(batcher).run()
    assert ok.output_token_ids == reference_output(range(10), 7)
    assert not batcher.has_unfinished()


def test_stop_conditions():
    def finish(request, tokens, max_model_len=4096):
        batcher = make_batcher(max_model_len=max_model_len)
        batcher.add_request(request)
        for token in tokens:
            finished = batcher.update_from_output(batcher.schedule(), {request.request_id: token})
        assert finished == [request] and batcher.block_manager.num_free_blocks == 64
        return request.status, request.output_token_ids

    assert finish(make_request("a", [1], eos=[2]), [5, 2]) == (RequestStatus.FINISHED_STOPPED, [5, 2])
    assert finish(make_request("b", [1], eos=[2], min_tokens=3), [2, 2, 2]) == (
        RequestStatus.FINISHED_STOPPED, [2, 2, 2])
    assert finish(make_request("c", [1], eos=[2], ignore_eos=True), [2, 2, 2, 2]) == (
        RequestStatus.FINISHED_LENGTH, [2, 2, 2, 2])
    assert finish(make_request("d", [1], stop_token_ids=[9], ignore_eos=True), [3, 9]) == (
        RequestStatus.FINISHED_STOPPED, [3, 9])
    assert finish(make_request("e", [1], eos=[2], max_tokens=2), [5, 2]) == (
        RequestStatus.FINISHED_STOPPED, [5, 2])
    assert finish(make_request("f", [1, 1], max_tokens=100), [3, 3, 3], max_model_len=5) == (
        RequestStatus.FINISHED_LENGTH, [3, 3, 3])


def test_random_finishes_and_aborts_return_every_block():
    rng = random.Random(7)
    num_blocks = 12
    batcher = make_batcher(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=48,
                           long_prefill_token_threshold=13, max_num_seqs=6)
    runner = FakeRunner(batcher)
    bases = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
    requests, aborted = [], set()
    for step in range(400):
        if len(requests) < 60 and rng.random() < 0.5:
            prompt = rng.choice(bases)[:rng.randrange(1, 25)] + [rng.randrange(1000)]
            r = make_request(f"r{len(requests)}", prompt, max_tokens=rng.randrange(1, 21))
            batcher.add_request(r)
            requests.append(r)
        plan = batcher.schedule()
        sampled = runner.execute(plan)
        if plan.scheduled and rng.random() < 0.1:  # abort one mid-step
            victim = rng.choice(plan.scheduled).request
            batcher.abort(victim.request_id)
            aborted.add(victim.request_id)
        batcher.update_from_output(plan, sampled)
        if requests and rng.random() < 0.05:
            rid = rng.choice(requests).request_id
            if batcher.abort(rid) is not None:
                aborted.add(rid)
    runner.run()
    bm = batcher.block_manager
    assert bm.num_free_blocks == num_blocks
    assert bm.prefix_cache_hits > 0 and any(r.num_preemptions for r in requests)
    for r in requests:
        assert r.status.finished and r.block_ids == []
        if r.request_id not in aborted:
            max_tokens = r.sampling_params.max_tokens
            assert r.output_token_ids == reference_output(r.prompt_token_ids, max_tokens)


def test_config_is_validated_and_frozen():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=16, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(max_model_len=16, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=1)
    cfg = SchedulerConfig(max_model_len=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 3
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Batcher(cfg, BlockManager(4, enable_prefix_caching=False))
