"""A model-free stand-in for the engine that emits one token per request per step.

Only for measuring serving overhead (gateway, NATS, scheduler, worker plumbing) with no model
time in the way; never used to answer real traffic.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from services.worker.engine.engine_stats import EngineStats
from services.worker.engine.step_outputs import RequestOutput, StepOutputs
from shared.sampling_params import SamplingParams


class TokenEmitter:
    def __init__(self, vocab_size: int, max_model_len: int, step_seconds: float = 0.0):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.running: OrderedDict[str, tuple[list[int], SamplingParams, int]] = OrderedDict()
        self.steps = 0

    def add_request(self, request_id, prompt_token_ids, params: SamplingParams, eos_token_ids=(), cache_salt=b"",
                    handoff: bool = False, matcher=None):
        """LLMEngine.add_request's signature; a grammar's matcher never comes (the emitter builds no grammars)."""
        params.validate(self.vocab_size)
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens exceeds max_model_len {self.max_model_len}")
        self.running[request_id] = (prompt_token_ids, params, 0)

    def abort(self, request_id: str) -> bool:
        return self.running.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> StepOutputs:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        outputs = []
        for rid, (prompt, params, n) in list(self.running.items()):
            n += 1
            token = 10 + (len(prompt) + n) % (self.vocab_size - 10)
            out = RequestOutput(rid, [token], len(prompt), 0, n)
            if n >= params.max_tokens:
                out.finish_reason = "length"
                del self.running[rid]
            else:
                self.running[rid] = (prompt, params, n)
            outputs.append(out)
        return StepOutputs.of(outputs)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=0, queued_prefill_tokens=0,
                           active_decode_tokens=sum(len(p) + n for p, _, n in self.running.values()),
                           kv_usage=0.0, num_free_blocks=0, num_total_blocks=0, prefix_cache_hits=0,
                           prefix_cache_queries=0, steps=self.steps)
