"""The scheduler's pure logic: KV index, prefix matching, registry TTL, admission and the cost function."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.admission import Rejection, admit
from services.scheduler.affinity import session_key
from services.scheduler.disagg import choose_prefill
from services.scheduler.kv_index import KvIndex, match_prefixes
from services.scheduler.registry import Registry
from services.scheduler.router import Choice, Router, cached_tokens, request_cost
from shared.block_hash import prefix_block_hashes, request_block_key
from shared.config import RouterConfig
from shared.messages import GenerateRequest, KvEvents, WireSamplingParams, WorkerHeartbeat
from shared.sampling_params import SamplingParams
from shared.wire import pack_ids

MODEL = "tiny"
BS = 16
KEY = request_block_key(MODEL, "")


def heartbeat(worker_id: str, seq: int = 1, **kw) -> WorkerHeartbeat:
    fields = dict(worker_id=worker_id, role="mixed", model=MODEL, ready=True, draining=False,
                  generate_subject=f"inferno.worker.{worker_id}.generate",
                  abort_subject=f"inferno.worker.{worker_id}.abort", timestamp=0.0, seq=seq, block_size=BS)
    fields.update(kw)
    return WorkerHeartbeat(**fields)


def request(prompt: list[int], model: str = MODEL, session_id: str | None = None, cache_salt: str = "",
            rid: str = "r") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model=model, prompt_ids=pack_ids(prompt),
                           sampling=WireSamplingParams.from_params(SamplingParams()), reply_to="inbox",
                           session_id=session_id, cache_salt=cache_salt)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def events(worker_id: str, seq: int, stored=(), removed=(), cleared=False) -> KvEvents:
    return KvEvents(worker_id=worker_id, seq=seq, stored=list(stored), removed=list(removed), cleared=cleared)


def make_router(*heartbeats: WorkerHeartbeat, now: float = 0.0, **cfg) -> Router:
    registry = Registry(heartbeat_ttl=cfg.pop("heartbeat_ttl", 3.0))
    for hb in heartbeats:
        registry.on_heartbeat(hb, now)
    return Router(RouterConfig(**cfg), registry)


# ---------------------------------------------------------------------------------------------
# Cost and prefix matching

def test_request_cost_is_uncached_prompt_plus_load():
    assert request_cost(100, 0, 0) == 100
    assert request_cost(100, 64, 0) == 36
    assert request_cost(100, 64, 500) == 536
    assert request_cost(100, 112, 7) == 7  # never negative prefill


def test_match_prefixes_counts_leading_blocks_like_prefix_block_hashes():
    ids = prompt(100)  # 6 full blocks, a 4-token tail
    hashes = prefix_block_hashes(ids, BS, KEY)
    assert len(hashes) == 6
    full, three, gap, other, empty = KvIndex(), KvIndex(), KvIndex(), KvIndex(), KvIndex()
    full.blocks.update(hashes)
    three.blocks.update(hashes[:3])
    gap.blocks.update([hashes[0], hashes[1], hashes[3], hashes[4]])  # block 2 evicted: the chain stops there
    other.blocks.update(prefix_block_hashes(ids, BS, request_block_key(MODEL, "tenant-b")))
    depths = match_prefixes(pack_ids(ids), BS, KEY, [full, three, gap, other, empty, None])
    assert depths == [6, 3, 2, 0, 0, 0]


def test_cache_salt_and_model_separate_chains():
    ids = prompt(64)
    assert prefix_block_hashes(ids, BS, request_block_key("a", "")) != prefix_block_hashes(ids, BS, request_block_key("b", ""))
    assert request_block_key("m", "salt") == b"m\x00salt"


def test_cached_tokens_groups_workers_by_block_size():
    ids = prompt(96)
    router = make_router(heartbeat("w16"), heartbeat("w32", block_size=32))
    reg = router.registry
    reg.workers["w16"].kv.blocks.update(prefix_block_hashes(ids, 16, KEY)[:5])
    reg.workers["w32"].kv.blocks.update(prefix_block_hashes(ids, 32, KEY)[:2])
    workers = [reg.workers["w16"], reg.workers["w32"]]
    assert cached_tokens(workers, request(ids)) == [80, 64]


# ---------------------------------------------------------------------------------------------
# KV index

def test_kv_index_applies_events_in_order_and_resets_on_gap():
    idx = KvIndex()
    a, b, c, d = (bytes([i]) * 16 for i in range(1, 5))
    assert idx.apply(events("w", 1, stored=[a, b, c]), 1.0)
    assert idx.apply(events("w", 2, removed=[b]), 2.0)
    assert idx.blocks == {a, c} and idx.seq == 2 and idx.updated == 2.0
    assert idx.apply(events("w", 3, stored=[d], cleared=True), 3.0)
    assert idx.blocks == {d}
    assert not idx.apply(events("w", 5, stored=[a]), 4.0)  # seq 4 lost: only what 5 says is trusted
    assert idx.blocks == {a} and idx.seq == 5 and idx.resets == 1
    assert not idx.apply(events("w", 1, stored=[b]), 5.0)  # a restarted worker counts from 1 again
    assert idx.blocks == {b} and idx.resets == 2


# ---------------------------------------------------------------------------------------------
# Registry

def test_registry_liveness_follows_heartbeat_ttl():
    reg = Registry(heartbeat_ttl=3.0)
    reg.on_heartbeat(heartbeat("a"), 10.0)
    reg.on_heartbeat(heartbeat("b"), 11.0)
    assert [w.worker_id for w in reg.live(12.9)] == ["a", "b"]
    assert [w.worker_id for w in reg.live(13.0)] == ["b"]  # exactly ttl old: gone
    assert reg.get("a", 13.0) is None and "a" not in reg.workers
    assert reg.sweep(14.5) == ["b"]
    assert reg.live(14.5) == []


def test_registry_drops_index_of_dead_worker_and_resets_on_restart():
    reg = Registry(heartbeat_ttl=3.0)
    h = bytes(16)
    reg.on_heartbeat(heartbeat("a", seq=5), 0.0)
    reg.on_kv_events(events("a", 1, stored=[h]), 0.0)
    assert reg.workers["a"].kv.blocks == {h}
    reg.on_heartbeat(heartbeat("a", seq=6), 1.0)
    assert reg.workers["a"].kv.blocks == {h}
    reg.on_heartbeat(heartbeat("a", seq=1), 2.0)  # seq went backwards: a new process
    assert reg.workers["a"].kv.blocks == set()
    reg.on_kv_events(events("a", 1, stored=[h]), 2.0)
    reg.sweep(5.0)
    assert reg.workers == {} and reg.orphan_indexes == {}
    reg.on_heartbeat(heartbeat("a", seq=1), 6.0)  # back again: starts with an empty index
    assert reg.workers["a"].kv.blocks == set()


def test_kv_events_before_first_heartbeat_are_adopted_or_expire():
    reg = Registry(heartbeat_ttl=3.0)
    h1, h2 = bytes(16), b"\x01" * 16
    reg.on_kv_events(events("a", 1, stored=[h1]), 0.0)
    reg.on_kv_events(events("b", 1, stored=[h2]), 0.0)
    reg.on_heartbeat(heartbeat("a"), 0.5)
    assert reg.workers["a"].kv.blocks == {h1}
    reg.sweep(3.0)
    assert "b" not in reg.orphan_indexes


def test_routed_load_counts_until_next_heartbeat():
    router = make_router(heartbeat("a", num_waiting=2, num_running=3, active_decode_tokens=100,
                                   queued_prefill_tokens=20))
    w = router.registry.workers["a"]
    assert (w.num_waiting, w.num_running, w.load_tokens) == (2, 3, 120)
    w.note_routed(50)
    w.note_routed(30)
    assert (w.num_waiting, w.num_running, w.load_tokens) == (4, 5, 200)
    router.registry.on_heartbeat(heartbeat("a", seq=2, num_waiting=4, active_decode_tokens=180), 1.0)
    assert (w.num_waiting, w.num_running, w.load_tokens) == (4, 0, 180)


# ---------------------------------------------------------------------------------------------
# Admission

def _admit(router: Router, req: GenerateRequest, now: float = 0.0):
    return router.admit(req, now)


def test_admission_errors():
    req = request(prompt(40))
    assert admit([], MODEL, 40, 256, 1.0) == Rejection(503, "service_unavailable", "no worker is available", 1.0)
    r = _admit(make_router(heartbeat("a", model="other")), req)
    assert isinstance(r, Rejection) and (r.status, r.error_type) == (404, "model_not_found")
    assert r.to_reply().error_status == 404 and not r.to_reply().ok
    for hb in (heartbeat("a", ready=False), heartbeat("a", draining=True), heartbeat("a", role="prefill")):
        r = _admit(make_router(hb), req)
        assert isinstance(r, Rejection) and (r.status, r.error_type) == (503, "service_unavailable")
    r = _admit(make_router(heartbeat("a", max_model_len=40)), req)
    assert isinstance(r, Rejection) and r.status == 400
    r = _admit(make_router(heartbeat("a", num_waiting=4), heartbeat("b", num_waiting=5), max_waiting=4), req)
    assert r == Rejection(429, "rate_limit_exceeded", "Every worker has 4 or more requests waiting; retry later.", 1.0)
    reply = r.to_reply()
    assert (reply.error_status, reply.error_type, reply.retry_after) == (429, "rate_limit_exceeded", 1.0)


def test_admission_keeps_only_workers_that_can_take_the_request():
    router = make_router(heartbeat("full", num_waiting=4), heartbeat("draining", draining=True),
                         heartbeat("ok", num_waiting=3), heartbeat("short", max_model_len=20),
                         heartbeat("other", model="x"), max_waiting=4)
    open_ = _admit(router, request(prompt(40)))
    assert [w.worker_id for w in open_] == ["ok"]
    router.registry.workers["ok"].note_routed(40)  # the 4th waiting request: now full too
    assert isinstance(_admit(router, request(prompt(40))), Rejection)


def test_dead_worker_is_not_admitted():
    router = make_router(heartbeat("a"), now=0.0)
    router.registry.on_heartbeat(heartbeat("b"), 2.0)
    assert [w.worker_id for w in _admit(router, request(prompt(8)), 3.5)] == ["b"]


# ---------------------------------------------------------------------------------------------
# Choice

def test_most_cached_prefix_wins_over_lighter_load():
    ids = prompt(1024)
    hashes = prefix_block_hashes(ids, BS, KEY)
    router = make_router(heartbeat("a", active_decode_tokens=300), heartbeat("b", active_decode_tokens=0),
                         heartbeat("c", active_decode_tokens=0))
    router.registry.workers["a"].kv.blocks.update(hashes)  # all 64 blocks
    router.registry.workers["b"].kv.blocks.update(hashes[:10])
    choice = router.route(request(ids), 0.0)
    assert isinstance(choice, Choice)
    assert (choice.worker.worker_id, choice.cached_tokens, choice.cost) == ("a", 1024, 300)


def test_without_cache_least_loaded_wins():
    router = make_router(heartbeat("a", active_decode_tokens=500), heartbeat("b", active_decode_tokens=200,
                         queued_prefill_tokens=100), heartbeat("c", active_decode_tokens=400))
    choice = router.route(request(prompt(50)), 0.0)
    assert (choice.worker.worker_id, choice.cached_tokens, choice.cost) == ("b", 0, 350)


def test_burst_spreads_evenly_over_idle_workers():
    router = make_router(heartbeat("a"), heartbeat("b"))
    picks = [router.route(request(prompt(64), rid=f"r{i}"), 0.0).worker.worker_id for i in range(20)]
    assert picks == ["a", "b"] * 10
    assert router.registry.workers["a"].routed_requests == 10
    assert router.registry.workers["a"].routed_tokens == 640


def test_ties_break_on_running_requests_then_worker_id():
    router = make_router(heartbeat("a", num_running=3), heartbeat("b", num_running=1), heartbeat("c", num_running=1))
    assert router.route(request(prompt(16)), 0.0).worker.worker_id == "b"
    router = make_router(heartbeat("z"), heartbeat("y"))
    assert router.route(request(prompt(16)), 0.0).worker.worker_id == "y"


def test_kv_overloaded_worker_is_passed_over_unless_all_are():
    ids = prompt(256)
    router = make_router(heartbeat("a", kv_usage=0.97), heartbeat("b", kv_usage=0.5, active_decode_tokens=9000))
    router.registry.workers["a"].kv.blocks.update(prefix_block_hashes(ids, BS, KEY))
    assert router.route(request(ids), 0.0).worker.worker_id == "b"
    router = make_router(heartbeat("a", kv_usage=0.97), heartbeat("b", kv_usage=0.99))
    assert router.route(request(ids), 0.0).worker.worker_id == "a"


def test_sticky_only_to_an_admitted_worker_below_the_kv_threshold():
    router = make_router(heartbeat("a"), heartbeat("b", kv_usage=0.96), heartbeat("c", num_waiting=4096))
    req = request(prompt(32))
    open_ = router.admit(req, 0.0)
    assert [w.worker_id for w in open_] == ["a", "b"]
    choice = router.sticky("a", open_, req)
    assert choice is not None and choice.sticky and (choice.worker.worker_id, choice.cost) == ("a", 32)
    assert router.sticky("b", open_, req) is None  # KV nearly full
    assert router.sticky("c", open_, req) is None  # queue full
    assert router.sticky("gone", open_, req) is None


def test_session_keys_are_valid_kv_keys():
    key = session_key("user 42.session/*>")
    assert len(key) == 32 and all(ch in "0123456789abcdef" for ch in key)
    assert key == session_key("user 42.session/*>") != session_key("user 43")


def test_router_config_defaults():
    cfg = RouterConfig()
    assert (cfg.heartbeat_ttl, cfg.max_waiting, cfg.overload_kv_usage, cfg.affinity_bucket) == (
        3.0, 4096, 0.95, "inferno_affinity")
    with pytest.raises(ValueError):
        dataclasses.replace(cfg, overload_kv_usage=1.5)


def test_the_kvstores_pages_count_as_cached_by_what_a_fetch_saves():
    """A prefix the cluster kvstore holds is fetchable by any worker: it counts as cached on each
    by the part of its prefill a fetch saves there (the heartbeat's store_fetch_cost): free on a,
    half on d; nothing on c, which has no store, or on e, where fetching costs more than prefilling."""
    router = make_router(heartbeat("a", store_fetch_cost=0.0), heartbeat("b", store_fetch_cost=0.0),
                         heartbeat("c"), heartbeat("d", store_fetch_cost=0.5), heartbeat("e", store_fetch_cost=1.5))
    p = prompt(64)
    hashes = prefix_block_hashes(p, 16, request_block_key(MODEL))
    router.registry.on_kv_events(events("a", 1, stored=hashes[:1]), 0.0)
    router.registry.on_kv_events(events("kvstore", 1, stored=hashes[:3], cleared=True), 0.0)
    workers = sorted(router.registry.live(0.0), key=lambda w: w.worker_id)
    assert cached_tokens(workers, request(p), router.registry.store_kv) == [48, 48, 0, 24, 0]
    assert cached_tokens(workers, request(p)) == [16, 0, 0, 0, 0]
    assert "kvstore" not in router.registry.workers and "kvstore" not in router.registry.orphan_indexes
    router.registry.on_kv_events(events("kvstore", 2, removed=hashes[1:3]), 0.0)
    assert cached_tokens(workers, request(p), router.registry.store_kv) == [16, 16, 0, 8, 0]

def test_the_worker_is_told_what_the_store_holds_only_when_the_index_is_the_whole_store():
    """The store's depth travels with the request, so a worker asks the store only when it holds
    something; an index that began mid-stream (a scheduler restarted) may lack pages: -1, ask."""
    router = make_router(heartbeat("a"))
    p = prompt(64)
    hashes = prefix_block_hashes(p, 16, request_block_key(MODEL))
    assert router.route(request(p), 0.0).store_tokens == -1  # no report from a store yet
    router.registry.on_kv_events(events("kvstore", 1, cleared=True), 0.0)
    assert router.route(request(p), 0.0).store_tokens == 0  # it holds nothing: no lookup at all
    router.registry.on_kv_events(events("kvstore", 2, stored=hashes[:2]), 0.0)
    assert router.route(request(p), 0.0).store_tokens == 32
    router.registry.on_kv_events(events("kvstore", 4, stored=hashes[2:3]), 0.0)  # report 3 was lost
    assert not router.registry.store_kv.complete
    assert router.route(request(p), 0.0).store_tokens == -1

# ---------------------------------------------------------------------------------------------
# Disaggregation: which prefill worker, and when the decode worker prefills itself

def pair(*prefill_loads: int) -> tuple[Router, Choice]:
    """A decode worker chosen by the router, and prefill workers p0, p1, ... with these queues."""
    router = make_router(heartbeat("d", role="decode"),
                         *[heartbeat(f"p{i}", role="prefill", queued_prefill_tokens=q)
                           for i, q in enumerate(prefill_loads)])
    return router, router.route(request(prompt(600)), 0.0)


def test_the_cheapest_prefill_worker_takes_a_long_prompt():
    router, decode = pair(5000, 1200, 3000)
    assert decode.worker.worker_id == "d"
    live = router.registry.live(0.0)
    choice = choose_prefill(live, decode, request(prompt(600)), min_prefill_tokens=256)
    assert (choice.worker.worker_id, choice.cost) == ("p1", 1800)
    assert choose_prefill(live, decode, request(prompt(200)), min_prefill_tokens=256) is None  # short: local


def test_a_queue_bound_sends_the_prompt_to_its_decode_worker_when_every_prefill_worker_is_behind():
    router, decode = pair(5000, 1200)
    live = router.registry.live(0.0)
    long_prompt = request(prompt(600))
    assert choose_prefill(live, decode, long_prompt, 256, max_queue_tokens=1200).worker.worker_id == "p1"
    assert choose_prefill(live, decode, long_prompt, 256, max_queue_tokens=1199) is None
    assert choose_prefill(live, decode, long_prompt, 256, max_queue_tokens=0).worker.worker_id == "p1"  # no bound
    next(w for w in live if w.worker_id == "p1").note_routed(600)  # what was routed since p1's heartbeat counts as queued too
    assert choose_prefill(live, decode, long_prompt, 256, max_queue_tokens=1200) is None


def test_by_time_the_decode_worker_prefills_when_its_first_token_comes_sooner():
    """Each side's queue and this prompt over the prompt rate it reports, plus the prefill worker's
    recent hand-off time; a side that reports no rate yet leaves the prompt to the prefill worker."""
    router = make_router(heartbeat("d", role="decode", prefill_tokens_per_s=40_000.0, queued_prefill_tokens=1000),
                         heartbeat("p", role="prefill", prefill_tokens_per_s=40_000.0, queued_prefill_tokens=2000,
                                   kv_handoff_p50_ms=5.0))
    decode = router.route(request(prompt(2000)), 0.0)
    live = router.registry.live(0.0)
    d, p = (next(w for w in live if w.worker_id == i) for i in ("d", "p"))
    long_prompt = request(prompt(2000))
    # local (1000 + 2000) / 40k = 75 ms, twice that (the margin) against remote (2000 + 2000) / 40k + 5 ms = 105 ms
    assert choose_prefill(live, decode, long_prompt, 256, by_time=True).worker.worker_id == "p"
    p.note_routed(1600)  # remote now 145 ms: sooner at the decode worker, but not by the margin
    assert choose_prefill(live, decode, long_prompt, 256, by_time=True).worker.worker_id == "p"
    p.note_routed(4000)  # remote now 245 ms
    assert choose_prefill(live, decode, long_prompt, 256, by_time=True) is None
    assert choose_prefill(live, decode, long_prompt, 256, by_time=False).worker.worker_id == "p"
    d.local_prefill_tokens = 3000  # other prompts it prefills itself: local 150 ms
    assert choose_prefill(live, decode, long_prompt, 256, by_time=True).worker.worker_id == "p"
    d.local_prefill_tokens = 0
    p.heartbeat = dataclasses.replace(p.heartbeat, kv_handoff_p50_ms=1000.0)  # a slow link: hand-offs of a second
    p.routed_tokens = 0
    assert choose_prefill(live, decode, long_prompt, 256, by_time=True) is None
    d.heartbeat = dataclasses.replace(d.heartbeat, prefill_tokens_per_s=0.0)  # nothing learnt on the decode side
    assert choose_prefill(live, decode, long_prompt, 256, by_time=True).worker.worker_id == "p"


def test_the_queue_bound_is_a_non_negative_int():
    assert RouterConfig().disagg_max_prefill_queue_tokens == 4096  # past it a decode worker prefills too
    assert RouterConfig().disagg_by_time is False  # weighing by time is for slow links (disagg.py)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            RouterConfig(disagg_max_prefill_queue_tokens=bad)
