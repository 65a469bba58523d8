"""A mixture-of-experts model with latent attention (DeepSeek-V3's architecture) through the whole stack,
prefill and decode on two workers: the latent pages are handed over, the openai client's greedy answers
equal the engine's own, and the router's load reaches /metrics."""

from __future__ import annotations

import pytest

from inferno.tools.make_model import write_model
from tests.e2e.conftest import assert_greedy_as_one_engine, heartbeats, metrics, start_stack

pytest.importorskip("ucxx", reason="UCXX (ucxx-cu12) moves the KV pages")

PROMPTS = [[1000, 17, 230, 44, 9, 512], list(range(40, 120, 3))]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("moe") / "deepseek", arch="DeepseekV3ForCausalLM", preset="tiny",
                       seed=3, dtype="float32")


@pytest.fixture(scope="module")
def pd_stack(moe_model, tmp_path_factory):
    # Every prompt is prefilled on the prefill worker and handed over (threshold 1).
    s = start_stack(tmp_path_factory.mktemp("moe-pd"), moe_model, workers=0, prefill_workers=1, decode_workers=1,
                    scheduler_args=("--disagg-min-prefill-tokens", "1", "--heartbeat-ttl", "10"),
                    gateway_args=("--heartbeat-ttl", "10"))
    yield s
    s.stop()


def test_handed_off_answers_equal_the_engines(moe_model, pd_stack):
    assert_greedy_as_one_engine(pd_stack, moe_model, PROMPTS, MAX_TOKENS)
    hbs = heartbeats(pd_stack)
    assert {hb.role for hb in hbs.values()} == {"prefill", "decode"}
    assert all(len(hb.expert_tokens) == 8 and sum(hb.expert_tokens) > 0 for hb in hbs.values())
    samples = metrics(pd_stack)
    routed = {k: v for k, v in samples.items() if k.startswith("inferno:moe_expert_tokens_total{")}
    assert len(routed) == 16 and sum(routed.values()) > 0  # 8 experts on each of 2 workers
