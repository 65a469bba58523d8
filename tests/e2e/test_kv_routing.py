"""KV-aware routing without session affinity: an agent's next turn, sent the moment the last one
ends, goes to the worker that holds its dialogue. The worker publishes its new KV blocks and the
load a finished request freed right away, not at its next periodic heartbeat."""

from __future__ import annotations

import openai

from inferno.loadgen.workload import WORDS
from tests.e2e.conftest import MODEL_NAME, start_stack

BLOCK_SIZE = 16


def test_next_turn_follows_its_cached_dialogue(tiny_model, tmp_path):
    # Periodic heartbeats every 2 s (the scheduler's TTL is 3 s): the turns follow each other far
    # faster, so only the prompt updates can inform their routing.
    stack = start_stack(tmp_path, tiny_model, workers=2, worker_args=("--heartbeat-interval", "2"))
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": " ".join(WORDS[i % len(WORDS)] for i in range(300))}]
        prompts, cached = [], []
        for turn in range(4):
            messages.append({"role": "user", "content": f"turn {turn}: " + " ".join(WORDS[turn * 7:turn * 7 + 12])})
            r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
            prompts.append(r.usage.prompt_tokens)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    finally:
        stack.stop()
    assert prompts[0] > 300
    for turn in range(1, 4):  # every full block of the previous prompt was found where it lives
        assert cached[turn] >= prompts[turn - 1] // BLOCK_SIZE * BLOCK_SIZE, (prompts, cached)
