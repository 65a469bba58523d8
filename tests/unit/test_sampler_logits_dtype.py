"""The sampler takes the model's bf16 logits as they are and widens only where it changes them."""

from __future__ import annotations

import torch

from services.worker.engine.ops import TorchOps
from services.worker.engine.request import Request
from services.worker.engine.sampler import Sampler
from shared.sampling_params import SamplingParams

VOCAB = 64


class _Recording(TorchOps):
    """The torch reference, noting the logits each draw got."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []
        self.one_shape: list[bool] = []

    def sample(self, logits, *args, chain: bool = True, second_read: bool = True, one_shape: bool = False):
        self.seen.append(logits)
        self.one_shape.append(one_shape)
        return super().sample(logits, *args)

    def sample_warm_rows(self, vocab, max_rows, device):
        return [1, 3]


def test_warm_up_draws_each_logits_dtype():
    """bf16 at every batch-size class; fp32 (widened by penalties) draws in one launch shape, so only
    the two ways of the second read (the first and last sizes: chunked and per row) compile it; each
    dtype's chain-free batch at both too."""
    ops = _Recording()
    sampler = Sampler(ops, VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    assert sampler.warm_up(8) == 8  # (two sizes + the chain-free batch at both) per dtype
    assert [(x.dtype, x.shape[0]) for x in ops.seen] == [
        (torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 1), (torch.bfloat16, 3),
        (torch.float32, 1), (torch.float32, 3), (torch.float32, 1), (torch.float32, 3)]
    assert ops.one_shape == [False] * 4 + [True] * 4
    assert Sampler(_Recording(), VOCAB, torch.device("cpu")).warm_up(8) == 4  # fp32 model: one dtype


def _request(rid: str, params: SamplingParams) -> Request:
    return Request(rid, [1, 2, 3], params, seed=7, num_pending_tokens=1)  # as scheduled for its first token


def test_bf16_logits_reach_the_kernel_unwidened():
    ops = _Recording()
    sampler = Sampler(ops, VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    sampler(logits, [_request("a", SamplingParams(temperature=0.8, top_p=0.9)),
                     _request("b", SamplingParams(temperature=0.7))]).result()
    assert ops.seen[-1] is logits


def test_penalties_apply_in_fp32_on_a_copy():
    ops = _Recording()
    sampler = Sampler(ops, VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    logits = torch.full((1, VOCAB), 8.0, dtype=torch.bfloat16)
    before = logits.clone()
    # +0.01 on 8.0 is lost in bf16 (its step there is 1/16); fp32 keeps it, and the draw must too.
    sampler(logits, [_request("a", SamplingParams(temperature=1.0, logit_bias={5: 0.01}))]).result()
    got = ops.seen[-1]
    assert got.dtype == torch.float32 and ops.one_shape[-1]
    assert got[0, 5].item() == torch.tensor(8.0 + 0.01, dtype=torch.float32).item()
    assert torch.equal(logits, before)  # the step's own logits (logprobs read them) untouched


def test_greedy_bf16_batch_is_argmax_of_the_raw_values():
    sampler = Sampler(_Recording(), VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    logits = torch.randn(3, VOCAB).to(torch.bfloat16)
    got = sampler(logits, [_request(str(i), SamplingParams(temperature=0.0)) for i in range(3)]).result()
    assert got.token_ids == logits.float().argmax(-1).tolist()


def test_logprobs_in_row_chunks_match_one_piece(monkeypatch):
    """Log-probabilities are made LOGPROB_ROWS rows at a time (bounded temporaries): the same values
    as over the whole batch at once, for every row, through the sampler's result."""
    from services.worker.engine import sampler as S

    logits = torch.randn(7, VOCAB).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (7,))
    whole = torch.log_softmax(logits.float(), dim=-1)
    monkeypatch.setattr(S, "LOGPROB_ROWS", 3)
    chosen, top_ids, top_lp = S.log_probs(logits, ids, 5)
    assert torch.equal(chosen, whole.gather(1, ids.view(-1, 1)).squeeze(1))
    want_lp, want_ids = whole.topk(5, dim=-1)
    assert torch.equal(top_lp, want_lp) and torch.equal(top_ids, want_ids)
    assert S.log_probs(logits, ids, 0)[1].shape == (7, 0)
    assert [t.shape for t in S.log_probs(logits[:0], ids[:0], 5)] == [(0,), (0, 5), (0, 5)]

    sampler = Sampler(TorchOps(), VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    reqs = [_request(f"r{i}", SamplingParams(temperature=0.0, logprobs=2)) for i in range(7)]
    got = sampler(logits, reqs).result()
    assert got.token_ids == logits.float().argmax(-1).tolist()
    assert got.logprobs == whole.gather(1, logits.float().argmax(-1).view(-1, 1)).squeeze(1).tolist()


def test_draws_are_sample_refs_while_the_kernels_compile_then_the_kernels():
    """A worker's sampler compiles its kernel variants on a thread (sampler_warmup.py): until every one
    is compiled its draws are sample_ref's (bit for bit the kernels'), then the kernels'."""
    import threading

    release, warming = threading.Event(), threading.Event()

    class Slow(_Recording):
        def sample(self, logits, *args, **kwargs):
            if not release.is_set():  # a warm-up draw: "compiling" until released
                warming.set()
                release.wait(30)
            return super().sample(logits, *args, **kwargs)

    ops = Slow()
    sampler = Sampler(ops, VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    warm = sampler.warm_up_later(8)
    assert not sampler.kernels_ready and not warm.started  # pending: the worker starts it once its graphs are captured
    sampler.start_warm_up()
    assert warming.wait(30) and not sampler.kernels_ready
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    requests = [_request("a", SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
                _request("b", SamplingParams(temperature=0.7, top_k=5, seed=4))]
    seen = len(ops.seen)
    exact = sampler(logits, requests).result().token_ids
    assert len(ops.seen) == seen  # not the kernels
    release.set()
    assert sampler.wait_warm(30) and warm.ready and sampler.kernels_ready and len(ops.seen) == 8
    assert sampler(logits, requests).result().token_ids == exact and ops.seen[-1] is logits


def test_the_exact_draw_a_few_rows_at_a_time_is_the_whole_batchs():
    from services.worker.engine.sampler_warmup import FALLBACK_ROWS, draw_exact
    from services.worker.kernels.sampling_ref import sample_ref

    n = 2 * FALLBACK_ROWS + 5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, VOCAB, generator=g)
    temperature = torch.rand(n, generator=g) + 0.2
    temperature[::7] = 0.0  # some greedy rows
    args = (logits, temperature, torch.randint(0, 10, (n,), generator=g), torch.rand(n, generator=g),
            torch.rand(n, generator=g) * 0.1, torch.arange(n) + 11, torch.randint(0, 50, (n,), generator=g))
    assert torch.equal(draw_exact(*args), sample_ref(*args))


def test_between_steps_captures_the_graphs_then_starts_the_samplers_warm_up():
    """The step thread's work between steps once a model serves (model_build.between_steps): every
    deferred graph first, then the sampler's warm-up thread, whose launches could break a capture."""
    from types import SimpleNamespace

    from services.worker.model_build import between_steps

    log = []

    class Graphs:
        backlog = [8, 16]

        def capture_next(self):
            if self.backlog:
                log.append(f"graph {self.backlog.pop(0)}")
            return bool(self.backlog)

    class Warming:
        kernels_ready = False

        def start_warm_up(self):
            log.append("sampler")

    turn = between_steps(SimpleNamespace(graphs=Graphs(), engine=SimpleNamespace(sampler=Warming())))
    while turn():
        pass
    assert log == ["graph 8", "graph 16", "sampler"]
    ready = SimpleNamespace(kernels_ready=True)
    assert between_steps(SimpleNamespace(graphs=None, engine=SimpleNamespace(sampler=ready))) is None


def test_a_warm_up_stopped_by_its_models_unload_draws_no_more():
    import threading

    release, warming = threading.Event(), threading.Event()
    calls = []

    class Slow(_Recording):
        def sample(self, logits, *args, **kwargs):
            calls.append(logits.shape[0])
            warming.set()
            release.wait(30)
            return super().sample(logits, *args, **kwargs)

    sampler = Sampler(Slow(), VOCAB, torch.device("cpu"), logits_dtype=torch.bfloat16)
    sampler.warm_up_later(8)
    sampler.start_warm_up()
    assert warming.wait(30)
    threading.Timer(0.2, release.set).start()  # the draw under way ends; close() waits for it
    sampler.close()
    assert calls == [1] and not sampler.kernels_ready  # the rest never drawn: the draws stay with sample_ref
