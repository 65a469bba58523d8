"""Mixtures of experts through the whole stack, prefill and decode on two workers: DeepSeek-V3's
architecture (latent attention: its latent pages are handed over) and Llama 4's (chunked and NoPE
layers, experts that scale their input). The openai client's greedy answers equal the engine's own,
and the router's load reaches /metrics."""

from __future__ import annotations

import pytest

from inferno.tools.make_model import write_model
from tests.e2e.conftest import assert_greedy_as_one_engine, heartbeats, metrics, start_stack

pytest.importorskip("ucxx", reason="UCXX (ucxx-cu12) moves the KV pages")

PROMPTS = [[1000, 17, 230, 44, 9, 512], list(range(40, 120, 3))]
MAX_TOKENS = 20


# Each model's experts: DeepSeek-V3's tiny preset has 8, Llama 4's 4.
EXPERTS = {"DeepseekV3ForCausalLM": 8, "Llama4ForCausalLM": 4}


@pytest.fixture(scope="module", params=list(EXPERTS))
def moe_model(request, tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("moe") / request.param, arch=request.param, preset="tiny",
                       seed=3, dtype="float32")


@pytest.fixture(scope="module")
def pd_stack(moe_model, tmp_path_factory):
    # Every prompt is prefilled on the prefill worker and handed over (threshold 1).
    s = start_stack(tmp_path_factory.mktemp("moe-pd"), moe_model, workers=0, prefill_workers=1, decode_workers=1,
                    scheduler_args=("--disagg-min-prefill-tokens", "1", "--no-disagg-by-time", "--heartbeat-ttl", "10"),
                    gateway_args=("--heartbeat-ttl", "10"))
    yield s
    s.stop()


def test_handed_off_answers_equal_the_engines(moe_model, pd_stack):
    assert_greedy_as_one_engine(pd_stack, moe_model, PROMPTS, MAX_TOKENS)
    hbs = heartbeats(pd_stack)
    assert {hb.role for hb in hbs.values()} == {"prefill", "decode"}
    experts = EXPERTS[moe_model.name]
    assert all(len(hb.expert_tokens) == experts and sum(hb.expert_tokens) > 0 for hb in hbs.values())
    samples = metrics(pd_stack)
    routed = {k: v for k, v in samples.items() if k.startswith("inferno:moe_expert_tokens_total{")}
    assert len(routed) == 2 * experts and sum(routed.values()) > 0  # every expert on each of 2 workers
