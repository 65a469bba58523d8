"""INFERNO_STEP_TRACE: the step thread writes one line per step, and the summary script reads them."""

from __future__ import annotations

import json
import threading
import time

from bench.step_trace_summary import summarize
from services.worker.step_loop import AddCommand, StepLoop
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt


def test_each_step_is_traced_and_summarized(model_dirs, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("INFERNO_STEP_TRACE", str(path))
    engine = make_engine(model_dirs["LlamaForCausalLM"])
    done = threading.Event()

    def on_outputs(outs, routes, finished):
        if any(o.finish_reason is not None for o in outs):
            done.set()
    start = time.time()
    loop = StepLoop(engine, on_outputs)
    loop.start()
    try:
        prompt = random_prompt(20, engine.model_config.vocab_size, seed=1)
        loop.submit(AddCommand("r1", prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), "inbox"))
        assert done.wait(30)
        deadline = time.monotonic() + 10  # written when the engine goes idle
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.prefill_rate.rate == 0.0  # 20 prompt tokens say nothing of a prompt rate
        done.clear()
        long_prompt = random_prompt(300, engine.model_config.vocab_size, seed=2)
        t0 = time.perf_counter()
        loop.submit(AddCommand("r2", long_prompt, SamplingParams(max_tokens=1, temperature=0.0), "inbox"))
        assert done.wait(30)
        # what the heartbeat reports to the scheduler's P/D choice: no faster than the whole request went
        assert 299 / (time.perf_counter() - t0) <= loop.prefill_rate.rate < float("inf")  # 300 less its row
    finally:
        loop.stop()
        loop.join(10)
    steps = [json.loads(line) for line in path.read_text().splitlines()][:4]
    assert [s["tokens"] for s in steps] == [20, 1, 1, 1]  # the prompt, then one token per step
    assert all(s["rows"] == 1 and s["seconds"] > 0 and s["t"] >= start for s in steps)
    summary = summarize(steps, start)
    assert summary["steps"] == 4 and summary["tokens"] == 23
    assert summary["with_prompt_tokens"]["tokens"] == 20
    assert summary["decode_rows_1_64"]["steps"] == 3
    assert summary["before_first_step_s"] >= 0
