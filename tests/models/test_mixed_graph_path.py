"""The mixed-step graph path (static buffers per token bucket, padded tokens and sequences, the
attention work list, tokens fed back on the device) gives the eager path's tokens. On the CPU the
graphs are stand-ins that rerun the forward on the same static buffers."""

from __future__ import annotations

import pytest

from services.worker.engine.mixed_graphs import MixedGraphRunner, token_buckets
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt
from tests.models.test_graph_decode_path import staggered, with_graphs

ARCH = "LlamaForCausalLM"


def with_mixed_graphs(engine, max_graph_len: int = 256):
    mixed = MixedGraphRunner(engine.model, engine.kv_cache, engine.config.max_num_seqs,
                             engine.config.max_num_batched_tokens, max_graph_len, engine.device)
    mixed.capture()
    engine.runner.mixed_graphs = mixed
    return mixed


def test_buckets():
    assert token_buckets(8192) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets(300) == [64, 128, 192, 256, 300]
    assert token_buckets(64) == [64]


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_graphs_match_eager(overlap, model_dirs):
    model_dir = model_dirs[ARCH]
    vocab = make_engine(model_dir).model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=500 + n) for n in (9, 70, 4, 33, 120, 2, 47)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (20, 7, 33, 12, 25, 40, 3)]
    params[3] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=8)
    # 48-token steps: long prompts go in chunks beside the decodes.
    eager = staggered(make_engine(model_dir, max_num_seqs=8, max_num_batched_tokens=48), prompts, params)

    engine = make_engine(model_dir, max_num_seqs=8, max_num_batched_tokens=48, overlap=overlap)
    with_graphs(engine)
    mixed = with_mixed_graphs(engine)
    used = []
    launch = mixed.launch

    def counted(step, *args):
        used.append((step.lens[0], step.lens[7]))
        return launch(step, *args)
    mixed.launch = counted
    assert staggered(engine, prompts, params) == eager
    assert len(used) >= 8 and any(t > 1 for t, _ in used)
    assert any(fed for _, fed in used) == overlap  # overlapped mixed steps take tokens on the device
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_steps_beyond_the_buckets_run_eagerly(model_dirs):
    engine = make_engine(model_dirs[ARCH], max_num_seqs=4, max_num_batched_tokens=512)
    mixed = with_mixed_graphs(engine, max_graph_len=64)
    vocab = engine.model_config.vocab_size
    launched = []
    launch = mixed.launch
    mixed.launch = lambda step, *a: launched.append(step) or launch(step, *a)
    # 100 tokens of context exceed the graphs' 64: eager, and still right.
    want = make_engine(model_dirs[ARCH]).generate([random_prompt(100, vocab, seed=1)],
                                                  SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.generate([random_prompt(100, vocab, seed=1)], SamplingParams(max_tokens=3, temperature=0.0)) == want
    assert launched == []
