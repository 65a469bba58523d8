"""The decode path of the CUDA graphs (static buffers, bucket padding, block-table rows kept
between steps, tokens fed back on the device) gives the eager path's tokens. On the CPU the
graphs are stand-ins that rerun the forward on the same static buffers."""

from __future__ import annotations

import pytest

from services.worker.engine.cuda_graphs import CudaGraphRunner, graph_buckets
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt

ARCH = "Qwen2ForCausalLM"  # qkv bias: every projection path


def with_graphs(engine, max_graph_len: int = 256):
    graphs = CudaGraphRunner(engine.model, engine.kv_cache, engine.config.max_num_seqs, max_graph_len,
                             engine.device)
    graphs.capture()
    engine.runner.graphs = graphs
    return graphs


def staggered(engine, prompts, params):
    """Requests join every other step and leave at different lengths, so graph rows shift."""
    out = {f"r{i}": [] for i in range(len(prompts))}
    queue = list(enumerate(zip(prompts, params)))
    step = 0
    while queue or engine.has_unfinished():
        if queue and step % 2 == 0:
            i, (p, sp) = queue.pop(0)
            engine.add_request(f"r{i}", p, sp)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_buckets_cover_every_batch_size():
    buckets = graph_buckets(256)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 256
    assert graph_buckets(5) == [1, 2, 4, 5]


@pytest.mark.parametrize("overlap", [False, True])
def test_graph_decode_matches_eager(overlap, model_dirs):
    model_dir = model_dirs[ARCH]
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=300 + n) for n in (9, 31, 4, 17, 50, 2, 23)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (20, 7, 33, 12, 25, 40, 3)]
    params[3] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=8)
    eager = staggered(make_engine(model_dir, max_num_seqs=8), prompts, params)

    engine = make_engine(model_dir, max_num_seqs=8, overlap=overlap)
    graphs = with_graphs(engine)
    replays = {b: 0 for b in graphs.buckets}
    for b, g in graphs.graphs.items():
        original = g.replay

        def counted(b=b, original=original):
            replays[b] += 1
            original()
        g.replay = counted
    fed = []
    stage = graphs.stage

    def stage_and_count(scheduled, *args):
        fed.append(sum(s.pending_input for s in scheduled))
        return stage(scheduled, *args)
    graphs.stage = stage_and_count
    assert staggered(engine, prompts, params) == eager
    assert (sum(fed) > 40) if overlap else (sum(fed) == 0)  # overlapped steps take tokens on the device
    assert sum(replays.values()) > 40 and replays[8] > 0 and replays[1] > 0  # padded buckets too
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_contexts_beyond_the_graphs_run_eagerly(model_dirs):
    model_dir = model_dirs[ARCH]
    vocab = make_engine(model_dir).model_config.vocab_size
    prompt = random_prompt(40, vocab, seed=5)
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    eager = make_engine(model_dir).generate([prompt], params)[0]
    engine = make_engine(model_dir, overlap=True)
    with_graphs(engine, max_graph_len=48)  # the request crosses 48 tokens halfway
    assert engine.generate([prompt], params)[0] == eager
