"""CUDA graphs captured in two stages (some before ready, the rest between steps) give the eager
path's tokens while the buckets fill in. On the CPU the graphs are stand-ins that rerun the forward
on the same static buffers, so every line of the staging path runs."""

from __future__ import annotations

import pytest

from services.worker.engine.cuda_graphs import graph_buckets
from services.worker.engine.mixed_graphs import token_buckets
from services.worker.engine.staged_graphs import READY_DECODE_ROWS, StagedGraphs
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt

ARCH = "LlamaForCausalLM"


def staggered_with_backlog(engine, graphs: StagedGraphs, prompts, params):
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
        graphs.capture_next()
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", [False, True])
def test_graphs_captured_between_steps_match_eager(overlap, model_dirs):
    model_dir = model_dirs[ARCH]
    kw = dict(max_num_seqs=80, max_num_batched_tokens=300)
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=700 + n) for n in (9, 70, 4, 33, 120, 2, 47)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (20, 7, 33, 12, 25, 40, 3)]
    params[3] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=8)
    eager_engine = make_engine(model_dir, **kw)
    eager = staggered_with_backlog(eager_engine, _NoGraphs(), prompts, params)

    engine = make_engine(model_dir, overlap=overlap, **kw)
    graphs = StagedGraphs(engine)
    graphs.capture_ready()
    assert graphs.decode.buckets == sorted({*READY_DECODE_ROWS, 80}) and graphs.mixed.buckets == [256, 300]
    assert engine.runner.graphs is graphs.decode and engine.runner.mixed_graphs is graphs.mixed
    pending = len(graphs.backlog)
    assert pending == len(graph_buckets(80)) - 4 + len(token_buckets(300)) - 2
    used = {"decode": [], "mixed": []}
    for kind, runner in (("decode", graphs.decode), ("mixed", graphs.mixed)):
        def counted(step, *args, launch=runner.launch, kind=kind, runner=runner):
            used[kind].append(list(runner.buckets))
            return launch(step, *args)
        runner.launch = counted
    assert staggered_with_backlog(engine, graphs, prompts, params) == eager
    # Steps replayed graphs while the buckets were still coming in, and after.
    assert len(used["decode"]) > 20 and len(used["mixed"]) > 4
    assert used["decode"][0] != used["decode"][-1] and used["mixed"][0] != used["mixed"][-1]
    # Every bucket came in, in order, while requests ran on the buckets already there.
    assert not graphs.backlog and graphs.decode.buckets == graph_buckets(80)
    assert graphs.mixed.buckets == token_buckets(300) and graphs.count == len(graph_buckets(80)) + len(token_buckets(300))
    assert set(graphs.decode.graphs) == set(graph_buckets(80))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_capture_next_leaves_the_kv_cache_alone(model_dirs):
    """The dummy inputs of a capture between steps write no KV slot: the cached prefix of a
    finished request is still served from the cache, with the same tokens."""
    engine = make_engine(model_dirs[ARCH], max_num_seqs=16)
    graphs = StagedGraphs(engine)
    graphs.capture_ready()
    vocab = engine.model_config.vocab_size
    prompt = random_prompt(64, vocab, seed=3)
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


class _NoGraphs:
    def capture_next(self) -> bool:
        return False
