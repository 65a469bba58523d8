"""CUDA graphs captured after ready, one bucket between two steps, give the eager path's tokens
while they come in: a kind's steps run eagerly until all its buckets are captured, then replay
them. On the CPU the graphs are stand-ins that rerun the forward on the same static buffers, so
every line of the staging path runs."""

from __future__ import annotations

import pytest

from services.worker.engine.cuda_graphs import graph_buckets
from services.worker.engine.mixed_graphs import token_buckets
from services.worker.engine.staged_graphs import StagedGraphs
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt

ARCH = "LlamaForCausalLM"
KW = dict(max_num_seqs=80, max_num_batched_tokens=300)
DECODE, MIXED = graph_buckets(80), token_buckets(300)


def staggered_with_backlog(engine, graphs, prompts, params):
    """Requests join every other step; one bucket is captured between any two steps, as the
    worker's step thread does."""
    out = {f"r{i}": [] for i in range(len(prompts))}
    queue = list(enumerate(zip(prompts, params)))
    step = 0
    while queue or engine.has_unfinished():
        if queue and step % 2 == 0:
            i, (p, sp) = queue.pop(0)
            engine.add_request(f"r{i}", p, sp)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if graphs is not None:
            graphs.capture_next()
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


def workload(vocab):
    prompts = [random_prompt(n, vocab, seed=700 + n) for n in (9, 70, 4, 33, 120, 2, 47, 15, 260, 8)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (20, 7, 33, 12, 25, 40, 3, 30, 9, 35)]
    params[3] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=8)
    return prompts, params


def counting(graphs):
    """Which kind of graph each step replayed, in order."""
    used = []
    for kind, runner in (("decode", graphs.decode), ("mixed", graphs.mixed)):
        def counted(step, *args, launch=runner.launch, kind=kind):
            used.append(kind)
            return launch(step, *args)
        runner.launch = counted
    return used


@pytest.mark.parametrize("overlap", [False, True])
def test_graphs_captured_between_steps_match_eager(overlap, model_dirs):
    model_dir = model_dirs[ARCH]
    prompts, params = workload(make_engine(model_dir).model_config.vocab_size)
    eager = staggered_with_backlog(make_engine(model_dir, **KW), None, prompts, params)

    engine = make_engine(model_dir, overlap=overlap, **KW)
    graphs = StagedGraphs(engine)
    graphs.capture_ready()  # nothing before ready by default
    assert graphs.count == 0 and engine.runner.graphs is None and engine.runner.mixed_graphs is None
    # The largest bucket of each kind first (it sizes the pool), then the others ascending.
    assert graphs.backlog == ([(graphs.decode, 80)] + [(graphs.decode, b) for b in DECODE[:-1]]
                              + [(graphs.mixed, 300)] + [(graphs.mixed, t) for t in MIXED[:-1]])
    used = counting(graphs)
    assert staggered_with_backlog(engine, graphs, prompts, params) == eager
    assert not graphs.backlog and graphs.decode.buckets == DECODE and graphs.mixed.buckets == MIXED
    assert engine.runner.graphs is graphs.decode and engine.runner.mixed_graphs is graphs.mixed
    assert set(graphs.decode.graphs) == set(DECODE) and graphs.count == len(DECODE) + len(MIXED)
    # Steps ran eagerly, then replayed decode graphs once all were there, then mixed ones too.
    assert "decode" in used and "mixed" in used and used.index("decode") < used.index("mixed")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_graphs_captured_before_ready_serve_from_the_start(model_dirs):
    engine = make_engine(model_dirs[ARCH], **KW)
    graphs = StagedGraphs(engine, before_ready=len(DECODE))
    graphs.capture_ready()
    assert engine.runner.graphs is graphs.decode and graphs.decode.buckets == DECODE
    assert engine.runner.mixed_graphs is None and len(graphs.backlog) == len(MIXED)
    used = counting(graphs)
    prompts, params = workload(engine.model_config.vocab_size)
    staggered_with_backlog(engine, None, prompts[:3], params[:3])
    assert used and set(used) == {"decode"}


def test_capture_next_leaves_the_kv_cache_alone(model_dirs):
    """The dummy inputs of a capture between steps write no KV slot: the cached prefix of a
    finished request is still served from the cache, with the same tokens."""
    engine = make_engine(model_dirs[ARCH], max_num_seqs=16)
    graphs = StagedGraphs(engine)
    prompt = random_prompt(64, engine.model_config.vocab_size, seed=3)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    first = engine.generate([prompt], greedy)[0]
    pool_before = engine.kv_cache.pool.clone()
    while graphs.capture_next():
        pass
    assert (engine.kv_cache.pool == pool_before).all()
    r = engine.add_request("again", prompt, greedy)
    while not r.status.finished:
        engine.step()
    assert r.output_token_ids == first and r.num_cached_tokens == 48


def test_warm_logits_runs_the_head_at_every_padded_count(model_dirs):
    """The LM head runs outside the graphs, at the row counts _logits pads to: the warm-up runs it at
    each of them, the GEMV's small counts included (their kernel variants compiled mid-run on a GPU),
    largest first, so that no step is the first at its count."""
    from services.worker.engine.runner import logits_rows

    engine = make_engine(model_dirs[ARCH], max_num_seqs=80)
    seen = []
    head = engine.model.compute_logits

    def recording(hidden):
        seen.append(hidden.shape[0])
        return head(hidden)

    engine.model.compute_logits = recording
    assert engine.runner.warm_logits(80) == len(seen)
    want = sorted({logits_rows(m) for m in range(1, 81)}, reverse=True)
    assert seen == want
    assert {1, 2, 3, 4} <= set(seen) and max(seen) == logits_rows(80)


def test_a_broken_capture_is_retried_and_a_bucket_that_never_captures_leaves_only_its_kind_eager(model_dirs):
    """A capture that another thread broke (seen on an H200 while UCX was set up) is tried again;
    after CAPTURE_ATTEMPTS failures of one bucket its kind stays eager and the other kind goes on."""
    from services.worker.engine.staged_graphs import CAPTURE_ATTEMPTS

    engine = make_engine(model_dirs[ARCH], max_num_seqs=16, max_num_batched_tokens=64)
    graphs = StagedGraphs(engine)
    capture, broken = graphs._capture, []

    def flaky(runner, size):
        if runner is graphs.decode and size == 4 and len(broken) < CAPTURE_ATTEMPTS - 1:
            broken.append(size)
            raise RuntimeError("operation failed due to a previous error during capture")
        if runner is graphs.mixed and size == 64:
            raise RuntimeError("never")
        capture(runner, size)

    graphs._capture = flaky
    while graphs.capture_next():
        pass
    assert broken == [4] * (CAPTURE_ATTEMPTS - 1)
    assert engine.runner.graphs is graphs.decode and graphs.decode.buckets == graph_buckets(16)
    assert engine.runner.mixed_graphs is None and graphs.mixed.buckets == [] and not graphs.backlog
