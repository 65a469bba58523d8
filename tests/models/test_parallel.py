"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank): the same tokens as one
process, and as transformers; logits within rounding; pipeline micro-batches really overlap."""

from __future__ import annotations

import pytest

from services.worker.engine.parallel.layout import ParallelConfigError, ParallelLayout
from services.worker.engine.model_config import ModelConfig
from shared.sampling_params import SamplingParams
from tests.models.conftest import eos_ids, hf_greedy, make_engine, random_prompt

# (tensor, pipeline, architecture): Llama has llama3 rope scaling, Qwen2 q/k/v biases, Qwen3 q/k
# norms and a tied head, and the tiny model's 2 KV heads are replicated over 4 tensor ranks.
GROUPS = [(2, 1, "LlamaForCausalLM"), (1, 2, "Qwen2ForCausalLM"), (2, 2, "Qwen3ForCausalLM"),
          (4, 1, "MistralForCausalLM")]
LENGTHS = (5, 37, 16, 70, 3)  # one token, several blocks, an exact block, a partial last block
MAX_NEW = 16


def prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=40 + n) for n in LENGTHS]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7),
            SamplingParams(max_tokens=MAX_NEW - 5, ignore_eos=True, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, top_k=20, seed=3),
            SamplingParams(max_tokens=MAX_NEW + 4, ignore_eos=True, temperature=0.0, frequency_penalty=0.5)]


def run(engine, prompts_, params) -> tuple[list[list[int]], list[list[float]]]:
    """Admits a request every other step (so steps mix prefill chunks and decodes); returns tokens
    and chosen-token logprobs per request."""
    tokens = [[] for _ in prompts_]
    logprobs = [[] for _ in prompts_]

    def take(outputs):
        for out in outputs:
            i = int(out.request_id[1:])
            tokens[i] += out.new_token_ids
            logprobs[i] += out.logprobs or []

    for i, (p, sp) in enumerate(zip(prompts_, params)):
        engine.add_request(f"r{i}", p, sp)
        take(engine.step())
        take(engine.step())
    while engine.has_unfinished():
        take(engine.step())
    return tokens, logprobs


@pytest.fixture(scope="module")
def single_runs(model_dirs):
    """One process, float64: the reference every group must reproduce token for token."""
    cache = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            engine = make_engine(model_dirs[arch], dtype="float64", **kw)
            cache[key] = run(engine, prompts(engine.model_config.vocab_size), mixed_params())
        return cache[key]
    return get


@pytest.mark.parametrize("tp,pp,arch", GROUPS, ids=[f"tp{t}-pp{p}-{a[:5]}" for t, p, a in GROUPS])
def test_group_equals_one_process(tp, pp, arch, model_dirs, single_runs):
    """Greedy, seeded top-p/top-k, penalties and logprobs, with chunked prefill (16-token steps)
    and, for tensor parallelism, overlapped steps whose fed-back tokens the driver broadcasts."""
    overlap = pp == 1
    engine = make_engine(model_dirs[arch], dtype="float64", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                         max_num_batched_tokens=16, overlap=overlap)
    try:
        got_tokens, got_lp = run(engine, prompts(engine.model_config.vocab_size), mixed_params())
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    finally:
        engine.close()
    want_tokens, want_lp = single_runs(arch, max_num_batched_tokens=16, overlap=overlap)
    assert got_tokens == want_tokens
    assert len(got_lp[2]) == MAX_NEW - 5
    assert max(abs(a - b) for a, b in zip(got_lp[2], want_lp[2])) < 1e-9


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_a_tensor_parallel_group_speculates_like_one_process(model_dirs, single_runs, method, tmp_path):
    """Drafts on a TP=2 group with overlapped steps: the ranks compute a draft's rows too, and the
    answers (penalties and logprobs included) are those of one process without drafts. A draft model
    or an EAGLE-3 head is the driver's alone (the head with the target's whole embedding)."""
    import json

    from inferno.tools.make_model import write_eagle3
    from services.worker.engine.speculative import SpeculativeConfig

    arch = "LlamaForCausalLM"
    model = ""
    if method == "draft_model":
        model = str(model_dirs[arch])
    elif method == "eagle3":
        vocab = json.loads((model_dirs[arch] / "config.json").read_text())["vocab_size"]
        model = str(write_eagle3(tmp_path / "head", target_preset="tiny", dtype="float32", target_vocab_size=vocab))
    spec = SpeculativeConfig(method=method, model=model, num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=2)
    engine = make_engine(model_dirs[arch], dtype="float64", tensor_parallel_size=2, max_num_batched_tokens=16,
                         overlap=True, speculative=spec)
    try:
        got_tokens, got_lp = run(engine, prompts(engine.model_config.vocab_size), mixed_params())
        assert engine.spec_draft_tokens > 0
    finally:
        engine.close()
    want_tokens, want_lp = single_runs(arch, max_num_batched_tokens=16, overlap=True)
    assert got_tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(got_lp[2], want_lp[2])) < 1e-6  # logprobs are fp32 (as vLLM's): 1e-15 apart in the logits may round a ulp apart


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_float32_group_matches_transformers(tp, pp, model_dirs, hf_models):
    arch = "LlamaForCausalLM"
    engine = make_engine(model_dirs[arch], tensor_parallel_size=tp, pipeline_parallel_size=pp)
    eos = eos_ids(model_dirs[arch])
    try:
        ps = prompts(engine.model_config.vocab_size)[:3]
        ours = engine.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=0))
        single = make_engine(model_dirs[arch])
        lp = {}
        for name, e in (("group", engine), ("single", single)):
            e.add_request("lp", ps[1], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=0))
            lp[name] = []
            while e.has_unfinished():
                lp[name] += [x for out in e.step() for x in (out.logprobs or [])]
    finally:
        engine.close()
    assert ours == [hf_greedy(hf_models(arch), p, 12, eos) for p in ps]
    assert max(abs(a - b) for a, b in zip(lp["group"], lp["single"])) < 1e-4


def test_pipeline_keeps_two_micro_batches_in_flight(model_dirs):
    """With 2 stages, step N+1 is launched before step N is read, and the two never share a request."""
    engine = make_engine(model_dirs["LlamaForCausalLM"], dtype="float64", pipeline_parallel_size=2)
    launched = []
    launch = engine._launch

    def record(plan):
        launched.append((len(engine._inflight), {s.request.request_id for s in plan.scheduled}))
        return launch(plan)
    engine._launch = record
    try:
        vocab = engine.model_config.vocab_size
        out = engine.generate([random_prompt(n, vocab, seed=n) for n in (4, 9, 13, 20)],
                              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0))
    finally:
        engine.close()
    assert [len(t) for t in out] == [10] * 4
    overlapped = [i for i, (depth, _) in enumerate(launched) if depth == 1]
    assert len(overlapped) > 10
    previous_ids = [launched[i - 1][1] for i in overlapped]
    assert all(not (launched[i][1] & prev) for i, prev in zip(overlapped, previous_ids))
    assert max(depth for depth, _ in launched) == 1


def test_layout_splits_and_refusals():
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128})
    layout = ParallelLayout(tp=4, pp=2, rank=5)
    assert (layout.stage, layout.tp_rank, layout.driver_rank) == (1, 1, 4)
    assert [ParallelLayout(1, 2, s).layer_range(5) for s in (0, 1)] == [(0, 3), (3, 5)]
    local = layout.local_config(cfg)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.vocab_size, local.num_hidden_layers) == (2, 1, 24, 251, 2)
    # 2 KV heads over 4 ranks: ranks 0-1 share head 0, ranks 2-3 head 1.
    assert [ParallelLayout(4, 1, r).kv_head_start(cfg) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ParallelConfigError, match="attention heads"):
        ParallelLayout(tp=3).check(cfg)
    with pytest.raises(ParallelConfigError, match="layers"):
        ParallelLayout(pp=6).check(cfg)
    with pytest.raises(ParallelConfigError):
        ParallelLayout(tp=0)


def test_a_group_refuses_whole_page_transfers(model_dirs):
    engine = make_engine(model_dirs["LlamaForCausalLM"], tensor_parallel_size=2)
    try:
        assert not engine.holds_whole_kv
        with pytest.raises(ValueError, match="split over 2 processes"):
            engine.add_request("h", [1, 2, 3], SamplingParams(max_tokens=2), handoff=True)
        with pytest.raises(ValueError, match="split over 2 processes"):
            engine.reserve_import("i", [1, 2, 3], SamplingParams(max_tokens=2))
    finally:
        engine.close()
