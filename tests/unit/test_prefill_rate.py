"""A worker's prompt rate, as its heartbeat reports it to the scheduler's P/D choice."""

from __future__ import annotations

from services.worker.prefill_rate import PrefillRate


def test_the_rate_is_a_running_mean_of_the_steps_that_computed_prompts():
    rate = PrefillRate()
    assert rate.rate == 0.0  # nothing learnt: the scheduler leaves the choice to its token bound
    rate.add(60, 0.001)  # decodes and a short tail say nothing of a prompt rate
    rate.add(512, 0.0)
    assert rate.rate == 0.0
    rate.add(512, 0.02)  # a 512-token chunk beside decodes in 20 ms
    assert rate.rate == 25_600.0
    rate.add(2048, 0.0512)  # 40,000 a second: a fifth of the way there
    assert abs(rate.rate - 28_480.0) < 1e-6
