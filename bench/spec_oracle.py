"""Speculative decoding's mechanism at batch 1 (issue 36), with an oracle draft: a first pass records
the target's own greedy continuation; then each step's draft is that continuation from where the
answer stands, each token corrupted with probability 1 - alpha. Decode tok/s against alpha and k,
against plain decoding with overlapped steps (a GPU worker's default).

In bf16 on a GPU a random-weight model's greedy answer parts from the recorded one within a few
dozen tokens (a step of k + 1 tokens does not give a one-token step's logits to the last bit, and
its near-ties flip), and from there the oracle's drafts are wrong whatever alpha says. So the figure
that holds is each k's cost per checking step (ms per forward, every step there checks a draft of
k), and tok/s at alpha is derived from it: (1 - alpha^(k+1)) / (1 - alpha) tokens per step over
that cost ("derived", labelled so). On the CPU in fp32 the answers stay the recorded ones.

    python bench/spec_oracle.py MODEL_DIR [--device cuda] [--tokens 256] [--profile] [--out FILE]
    python bench/spec_oracle.py --replot FILE.json OUT.png   (the α-plot, matplotlib)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from services.worker.engine import drafts as drafts_module
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.speculative import SpeculativeConfig
from shared.sampling_params import SamplingParams

ALPHAS = (0.6, 0.8, 0.9, 1.0)
KS = (1, 2, 4, 8)


def decode(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[list[int], float, int]:
    """One greedy request alone: its output, decode seconds (after the first token), forwards."""
    r = engine.add_request(f"o{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                           ignore_eos=True))
    while r.num_output_tokens < 1:
        engine.step()
    t0, steps0 = time.perf_counter(), engine.steps
    while engine.has_unfinished():
        engine.step()
    return r.output_token_ids, time.perf_counter() - t0, engine.steps - steps0


def profile(engine: LLMEngine, prompt: list[int], overlapped, state: dict) -> dict:
    """Per step: wall ms, the GPU's busy ms (its kernels' time) and the host's top self-time ops, for
    plain decoding overlapped and serial and for checks of k = 1 and 4 (alpha 1)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    out = {}
    spec = engine._spec
    state["alpha"] = 1.0
    for name, overlap, k in (("plain", True, 0), ("plain_serial", False, 0), ("check_k1", False, 1),
                             ("check_k4", False, 4)):
        engine.config = dataclasses.replace(overlapped, overlap=overlap)
        engine._spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=0) if k else None
        decode(engine, prompt, 16)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            n, seconds, forwards = decode(engine, prompt, 64)
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        out[name] = {"wall_ms_per_step": round(1e3 * seconds / forwards, 3),
                     "gpu_ms_per_step": round(gpu_us / 1e3 / forwards, 3),
                     "host_top_us_per_step": {e.key[:40]: round(e.self_cpu_time_total / forwards, 1) for e in top}}
        print(json.dumps({name: out[name]}), flush=True)
    engine.config, engine._spec = overlapped, spec
    return out


def plot(result: dict, path: str) -> None:
    """tok/s against alpha, a line per k (derived from each k's measured ms per checking step), and
    plain decoding: the α-plot of bench/RESULTS.md."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = [0.5 + i / 100 for i in range(51)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({row["k"] for row in result["table"]}):
        rows = [row for row in result["table"] if row["k"] == k]
        ms = sorted(row["ms_per_forward"] for row in rows)[len(rows) // 2]  # the median: one run may be slow
        ax.plot(alphas, [1e3 * (k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)) / ms for a in alphas],
                label=f"k = {k} ({ms:.2f} ms a step)")
    ax.axhline(result["plain_tok_s"], color="grey", linestyle="--", label=f"plain ({result['plain_tok_s']} tok/s)")
    ax.set_xlabel("α, the chance each drafted token is confirmed")
    ax.set_ylabel("decode tok/s at batch 1 (derived)")
    ax.set_title(result.get("title", "oracle draft, 8B, batch 1"))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if len(sys.argv) == 4 and sys.argv[1] == "--replot":  # --replot RESULT.json OUT.png
        _, _, src, dst = sys.argv
        plot(json.load(open(src)), dst)
        return
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="also: GPU busy time per step (torch.profiler), "
                    "plain overlapped, plain serial and checks of k = 1 and 4")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model_dir=args.model, device=args.device, overlap=args.device.startswith("cuda"),
                                    max_num_seqs=32, max_num_batched_tokens=2048, gpu_memory_utilization=0.5))
    vocab = engine.model_config.vocab_size
    prompt = [10 + i % (vocab - 10) for i in range(200)]
    decode(engine, prompt, 32)  # warm-up
    truth, seconds, _ = decode(engine, prompt, args.tokens)
    plain_tok_s = (len(truth) - 1) / seconds
    overlapped = engine.config
    engine.config = dataclasses.replace(overlapped, overlap=False)  # one step after the other, as checks run
    out, seconds, _ = decode(engine, prompt, args.tokens)
    serial_tok_s = (len(out) - 1) / seconds
    engine.config = overlapped
    rng = random.Random(0)
    state = {"alpha": 1.0}
    n_prompt = len(prompt)

    def oracle(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        at = len(tokens) - n_prompt  # outputs known so far: the draft continues the recorded answer
        return [t if rng.random() < state["alpha"] else (t + 1) % vocab for t in truth[at:at + k]]

    drafts_module.ngram_draft = oracle  # the benchmark's drafter in place of prompt lookup
    table, same = [], True
    for k in KS:
        engine._spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=0)
        for alpha in ALPHAS:
            state["alpha"] = alpha
            out, seconds, forwards = decode(engine, prompt, args.tokens)
            same = same and out == truth
            tok_s = (len(out) - 1) / seconds
            step_ms = 1e3 * seconds / forwards
            expected = k + 1 if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
            table.append({"k": k, "alpha": alpha, "measured_tok_s": round(tok_s, 1),
                          "measured_tokens_per_forward": round((len(out) - 1) / forwards, 2),
                          "ms_per_forward": round(step_ms, 3), "x_plain_step": round(step_ms * plain_tok_s / 1e3, 3),
                          "derived_tok_s": round(1e3 * expected / step_ms, 1),
                          "derived_x_plain": round(1e3 * expected / step_ms / plain_tok_s, 2)})
            print(json.dumps(table[-1]), flush=True)
    result = {"plain_tok_s": round(plain_tok_s, 1), "plain_serial_tok_s": round(serial_tok_s, 1),
              "same_answers": same, "table": table}
    if args.profile:
        result["profile"] = profile(engine, prompt, overlapped, state)
    print(json.dumps({k: v for k, v in result.items() if k != "table"}))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
