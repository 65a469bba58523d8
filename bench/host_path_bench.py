"""CPU cost per output token of the serving host path, worker and gateway, with no model time:
the engine's step (schedule → stage inputs → a trivial forward → sample → update → outputs), the
step thread's hand-over, the TokenBatch per gateway (packing, encoding), then the gateway's side
(decoding, routing, deltas through each request's choice, detokenizer, SSE chunk, one socket write
per connection). Everything the W2 path runs per step except the model, NATS and HTTP themselves.

The forward is replaced by an embedding lookup (the logits are the tiny model's head), so the
figures are the Python around a GPU step; the CUDA-graph runner's static-input path is used as on
the GPU (its CPU stand-in replays the trivial forward). CPU time is the thread's own
(time.thread_time), so other processes on the machine do not inflate it.

Usage: python bench/host_path_bench.py [--running 256] [--requests 1000] [--overlap/--no-overlap]
       [--decode-only] [--uvloop] [--phases] [--profile out.prof] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.gateway.completions import CompletionFormat  # noqa: E402
from services.gateway.gateway import Gateway  # noqa: E402
from services.gateway.generation import Generation  # noqa: E402
from services.gateway.schemas import parse_completion  # noqa: E402
from services.gateway.serving import _stream  # noqa: E402
from services.gateway.sse import SseWriter  # noqa: E402
from services.worker.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from services.worker.engine.engine import LLMEngine  # noqa: E402
from services.worker.engine.engine_config import EngineConfig  # noqa: E402
from inferno.tools.make_model import write_model  # noqa: E402
from services.worker.step_loop import StepLoop  # noqa: E402
from services.worker.token_batches import token_batches  # noqa: E402
from shared.config import GatewayConfig  # noqa: E402
from shared.gc_tuning import tune_gc  # noqa: E402
from shared.messages import TokenBatch  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from shared.wire import decode, encode  # noqa: E402


class _Clock:
    """CPU seconds of this thread per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)
        seconds = self.seconds
        now = time.thread_time

        def timed(*args, **kwargs):
            t = now()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += now() - t
        setattr(obj, name, timed)


class _Transport:
    """A socket that takes every write (counted) and is never closing."""

    def __init__(self) -> None:
        self.writes = 0
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)

    def is_closing(self) -> bool:
        return False


class _Sink(SseWriter):
    """The HTTP stream's own send path, to a counting transport instead of aiohttp's."""

    def __init__(self, transport: _Transport) -> None:  # noqa: D107 - no aiohttp request behind it
        self.request = self.response = None
        self.closed = False
        self.transport = transport
        self.chunked = True

    async def open(self) -> None:
        pass

    async def finish(self, events: bytes = b"", last: bytes = b"") -> None:
        self.send(events + last + b"data: [DONE]\n\n")


def _trivial_model(model, vocab: int) -> None:
    """A forward of no cost: the hidden state is the token id and the logits pick a fixed next
    token for each (a permutation of the vocabulary, so the text keeps changing)."""
    nxt = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    table = torch.full((vocab, vocab), -1.0)
    table[torch.arange(vocab), nxt] = 1.0

    def forward(input_ids, positions, kv_caches, meta):
        return input_ids.unsqueeze(1).float()

    def compute_logits(hidden):
        return table.index_select(0, hidden[:, 0].long())
    model.forward = forward
    model.compute_logits = compute_logits


def _hand_over(loop_thread):
    """StepLoop.hand_over, or the same work inline for commits before it existed (before/after runs)."""
    if hasattr(loop_thread, "hand_over"):
        return loop_thread.hand_over

    def hand_over(outputs):
        routes = {o.request_id: loop_thread.reply_to.get(o.request_id, "") for o in outputs}
        finished = False
        for o in outputs:
            if o.finished or o.handoff is not None:
                finished = True
                loop_thread.reply_to.pop(o.request_id, None)
        loop_thread._refresh_stats(force=finished and time.monotonic() - loop_thread._stats_at >= 0.01)
        if outputs:
            loop_thread.on_outputs(outputs, routes, finished)
    return hand_over


async def run(args) -> dict:
    model_dir = Path(tempfile.gettempdir()) / "inferno-host-path-tiny"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, preset="tiny", seed=0, dtype="float32")
    n = args.running
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=n * 32, max_num_seqs=n,
                                    max_num_batched_tokens=8192, overlap=args.overlap, max_model_len=1024))
    _trivial_model(engine.model, engine.model_config.vocab_size)
    graphs = CudaGraphRunner(engine.model, engine.kv_cache, n, 1024, engine.device)
    graphs.capture()
    engine.runner.graphs = graphs

    tokenizer = Tokenizer.from_path(str(model_dir))
    vocab = engine.model_config.vocab_size
    gw = Gateway(GatewayConfig(model_name="tiny", model_dir=str(model_dir)), tokenizer,
                 max_model_len=1024, vocab_size=vocab)
    transport = _Transport()

    published: list[tuple[str, bytes]] = []
    loop_thread = StepLoop(engine, lambda outputs, routes, finished: published.extend(
        (subject, encode(batch)) for subject, batch in token_batches("w0", outputs, routes)))

    rng = random.Random(0)
    handlers: list[asyncio.Task] = []
    total = args.requests if not args.decode_only else n

    def add_request(i: int) -> None:
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(100, 340) if not args.decode_only else 220)]
        max_tokens = rng.randint(100, 300) if not args.decode_only else 700
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0}
        spec = parse_completion(body, gw.limits)
        gen = Generation(gw, f"cmpl-{i}", spec, prompt, None, time.monotonic())
        gen.stream = gw.router.open(gen.request_ids)
        gw.router.assign(gen.stream, gen.request_ids[0], "w0")
        handlers.append(asyncio.ensure_future(_stream(gw, gen, CompletionFormat(gw.texts, False),
                                                      _Sink(transport), gw.keys.default)))
        engine.add_request(gen.request_ids[0], prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True))
        loop_thread.reply_to[gen.request_ids[0]] = gw.inbox

    added = 0
    while added < min(total, n):
        add_request(added)
        added += 1
    await asyncio.sleep(0)
    tune_gc()

    clock = _Clock()
    if args.phases:  # each wrapper costs a little itself: the totals are taken without them
        b = engine.batcher
        clock.wrap(b, "schedule", "worker: batcher.schedule")
        clock.wrap(b, "update_from_output", "worker: batcher.update_from_output")
        clock.wrap(engine.runner, "execute", "worker: runner.execute (stage, launch, sample)")
        clock.wrap(engine, "_outputs", "worker: engine._outputs")
        loop_thread.hand_over = _hand_over(loop_thread)
        clock.wrap(loop_thread, "hand_over", "worker: step loop hand-over + TokenBatch + encode")
    fwd = engine.model.forward
    clock.wrap(engine.model, "forward", "model: forward (trivial)")
    clock.wrap(engine.model, "compute_logits", "model: logits")
    if engine.model.forward is fwd:
        raise RuntimeError("forward not wrapped")

    hand_over = _hand_over(loop_thread) if not args.phases else loop_thread.hand_over
    # Warm up past the first prefill, then measure.
    warm_steps = 20
    steps = 0
    out_tokens = 0
    worker_s = gateway_s = 0.0
    prof = cProfile.Profile() if args.profile else None
    now = time.thread_time
    measuring = False
    t_wall = 0.0
    while engine.has_unfinished():
        if steps == warm_steps:
            clock.seconds.clear()
            worker_s = gateway_s = 0.0
            out_tokens = 0
            transport.writes = transport.bytes = 0
            measuring = True
            t_wall = time.perf_counter()
            if prof:
                prof.enable()
        t0 = now()
        outputs = engine.step()
        hand_over(outputs)
        t1 = now()
        worker_s += t1 - t0
        if hasattr(outputs, "token_counts"):  # StepOutputs (columns)
            out_tokens += int(outputs.token_counts.sum())
            finished = sum(1 for o in outputs.special.values() if o.finished)
        else:  # a list of RequestOutputs (commits before 2026-11-28)
            out_tokens += sum(len(o.new_token_ids) for o in outputs)
            finished = sum(1 for o in outputs if o.finished)
        t1 = now()
        batches, published[:] = list(published), []
        for subject, data in batches:
            gw.router.on_batch(decode(TokenBatch, data))
        await asyncio.sleep(0)  # the inbox's hand-over, then the handlers that ended
        await asyncio.sleep(0)
        t2 = now()
        gateway_s += t2 - t1
        for _ in range(finished):
            if added < total:
                add_request(added)
                added += 1
        steps += 1
        if args.steps and measuring and steps - warm_steps >= args.steps:
            break
    wall = time.perf_counter() - t_wall
    if prof:
        prof.disable()
        prof.dump_stats(args.profile)
    await asyncio.gather(*handlers, return_exceptions=True) if not args.steps else None
    model_s = clock.seconds["model: forward (trivial)"] + clock.seconds["model: logits"]
    worker_host = worker_s - model_s
    per = 1e6 / max(out_tokens, 1)
    result = {
        "running": n, "requests": total, "overlap": args.overlap, "steps": steps - warm_steps,
        "output_tokens": out_tokens, "socket_writes": transport.writes, "wall_s": round(wall, 3),
        "worker_us_per_token": round(worker_host * per, 2),
        "gateway_us_per_token": round(gateway_s * per, 2),
        "total_us_per_token": round((worker_host + gateway_s) * per, 2),
        "phases_us_per_token": {k: round(v * per, 2) for k, v in sorted(clock.seconds.items())},
        "loop": type(asyncio.get_running_loop()).__module__,
    }
    return result


def main() -> int:
    torch.set_num_threads(1)  # the service's host path is one thread; the trivial model needs no more
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=256, help="max running requests (the batch)")
    ap.add_argument("--requests", type=int, default=1000, help="W2-like: requests in all, new ones as others end")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--decode-only", action="store_true", help="`running` requests decoding for ever")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many measured steps (0: run out)")
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--phases", action="store_true", help="time the worker's phases too (adds a little)")
    ap.add_argument("--profile", help="write cProfile stats of the measured steps here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.decode_only and not args.steps:
        args.steps = 200
    if args.uvloop:
        import uvloop
        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    gc.collect()
    sys.exit(main())
