"""The step thread's background work (the CUDA graphs a model captures after it is ready): requests
sent at once are served before it starts, it runs while idle until done, and a failure in it never
stops serving."""

from __future__ import annotations

import threading
import time

from services.worker.step_loop import BACKGROUND_GRACE, AddCommand, StepLoop
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt


def start_loop(engine, background):
    outputs, done = [], threading.Event()

    def on_outputs(outs, routes, finished):
        outputs.extend((time.monotonic(), o) for o in outs)
        if any(getattr(o, "finished", False) for o in outs):
            done.set()
    loop = StepLoop(engine, on_outputs)
    loop.background = background
    loop.start()
    return loop, outputs, done


def test_requests_first_then_background_until_done(model_dirs):
    engine = make_engine(model_dirs["LlamaForCausalLM"])
    calls = []

    def work() -> bool:
        calls.append(time.monotonic())
        return len(calls) < 5
    started = time.monotonic()
    loop, outputs, done = start_loop(engine, work)
    try:
        prompt = random_prompt(20, engine.model_config.vocab_size, seed=1)
        loop.submit(AddCommand("r1", prompt, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0), "inbox"))
        assert done.wait(30)
        deadline = time.monotonic() + 10
        while loop.background is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 5 and loop.background is None  # ran until it said it was done, then no more
        assert calls[0] >= started + BACKGROUND_GRACE * 0.9  # not before the grace period
        assert outputs[0][0] < calls[0]  # the request sent at once got its first token first
    finally:
        loop.stop()
        loop.join(10)


def test_a_failing_background_job_is_dropped_and_serving_goes_on(model_dirs):
    engine = make_engine(model_dirs["LlamaForCausalLM"])

    def broken() -> bool:
        raise RuntimeError("capture failed")
    loop, outputs, done = start_loop(engine, broken)
    try:
        # The job fails after the grace period; logging its traceback can take a while on a busy
        # machine, so wait for the drop instead of a fixed time.
        deadline = time.monotonic() + 10
        while loop.background is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.background is None and loop.is_alive()
        prompt = random_prompt(10, engine.model_config.vocab_size, seed=2)
        loop.submit(AddCommand("r2", prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), "inbox"))
        assert done.wait(30)
        assert sum(len(o.new_token_ids) for _, o in outputs) == 4
    finally:
        loop.stop()
        loop.join(10)
