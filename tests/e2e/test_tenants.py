"""Tenants on the whole stack (tiny model): the prefix cache is isolated per tenant unless shared, and
a tenant's limit is answered with 429 and x-ratelimit-* headers."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, start_stack

LEGACY = "sk-legacy"
TENANTS = {"tenants": {"a": {}, "b": {}, "lab1": {"share_prefix_cache": True}, "lab2": {"share_prefix_cache": True},
                       "tight": {"requests_per_minute": 1}},
           "keys": {"sk-a": "a", "sk-b": "b", "sk-lab1": "lab1", "sk-lab2": "lab2", "sk-tight": "tight"}}


@pytest.fixture(scope="module")
def tenant_stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys_file = tmp / "keys.yaml"
    keys_file.write_text(json.dumps(TENANTS))  # JSON is YAML too
    s = start_stack(tmp, tiny_model, api_keys=(LEGACY,), gateway_args=("--api-keys-file", str(keys_file)))
    yield s
    s.stop()


def cached(stack, key: str, prompt: list[int]) -> int:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    return r.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_is_per_tenant_unless_shared(tenant_stack):
    prompt = list(range(100, 164))  # 4 full blocks of 16
    assert cached(tenant_stack, "sk-a", prompt) == 0
    assert cached(tenant_stack, "sk-b", prompt) == 0  # the same prompt, another tenant: no hit to time
    assert cached(tenant_stack, "sk-a", prompt) > 0
    assert cached(tenant_stack, LEGACY, prompt) == 0  # the default tenant is a tenant too
    other = list(range(200, 264))
    assert cached(tenant_stack, "sk-lab1", other) == 0
    assert cached(tenant_stack, "sk-lab2", other) > 0  # both opted into sharing
    assert cached(tenant_stack, "sk-a", other) == 0


def test_rate_limit_429_with_headers(tenant_stack):
    client = openai.OpenAI(base_url=tenant_stack.url + "/v1", api_key="sk-tight", max_retries=0, timeout=60)
    client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2)
    h = e.value.response.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert h["x-ratelimit-reset-requests"].endswith("s") and int(h["retry-after"]) >= 1
