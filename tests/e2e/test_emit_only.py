"""The model-free worker (`--emit-only`, the serving-overhead benchmark's) serves through the stack."""

from __future__ import annotations

from tests.e2e.conftest import MODEL_NAME, start_stack


def test_an_emit_only_stack_answers(tiny_model, tmp_path):
    from openai import OpenAI

    stack = start_stack(tmp_path, tiny_model, emit_only=True, kvstore_capacity_gb=0)
    try:
        client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=12, temperature=0)
        assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    finally:
        stack.stop()
