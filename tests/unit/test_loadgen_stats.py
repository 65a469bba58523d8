"""Load generator arithmetic: percentiles, per-request TTFT/ITL/TPOT, throughput, CPU cost, workload."""

from __future__ import annotations

import math
import os
import time

import pytest

from inferno.loadgen.cli import build_parser, config_from_args, main
from inferno.loadgen.client import SseReader
from inferno.loadgen.stats import CpuCost, CpuMeter, Distribution, RequestRecord, percentile, summarize
from inferno.loadgen.workload import (MIN_TOKEN_ID, WORDS, BenchConfig, arrival_offsets, build_workload,
                                     parse_range)


def test_percentile_interpolates_between_ranks_like_numpy():
    xs = [float(x) for x in range(0, 110, 10)]  # 0, 10, ..., 100
    assert percentile(xs, 0) == 0.0
    assert percentile(xs, 50) == 50.0
    assert percentile(xs, 90) == 90.0
    assert percentile(xs, 100) == 100.0
    assert percentile(xs, 99) == pytest.approx(99.0, abs=1e-12)
    assert percentile(xs, 95) == pytest.approx(95.0, abs=1e-12)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7, abs=1e-12)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_is_in_milliseconds():
    d = Distribution.of_seconds([0.004, 0.001, 0.003, 0.002])
    assert d.count == 4
    assert d.mean == pytest.approx(2.5)
    assert d.p50 == pytest.approx(2.5)
    assert d.p90 == pytest.approx(3.7)
    assert d.p99 == pytest.approx(3.97)
    assert Distribution.of_seconds([]) == Distribution(0, None, None, None, None)


def _record(chunks, completion_tokens=None, start=0.0, end=None, **kw) -> RequestRecord:
    r = RequestRecord(0, 10, 4, start=start, **kw)
    r.chunk_times = list(chunks)
    r.completion_tokens = completion_tokens
    r.end = end if end is not None else (chunks[-1] if chunks else start)
    return r


def test_one_token_per_chunk_gives_the_plain_gaps():
    r = _record([0.100, 0.125, 0.150, 0.200], completion_tokens=4, start=0.0, end=0.250)
    assert r.ttft == pytest.approx(0.100)
    assert r.e2e == pytest.approx(0.250)
    assert r.itls() == pytest.approx([0.025, 0.025, 0.050])
    assert r.tpot == pytest.approx((0.250 - 0.100) / 3)  # (e2e - ttft) / (tokens - 1)


def test_multi_token_chunks_divide_each_gap_by_the_chunk_share():
    # First chunk holds one token, the 6 others come two per later chunk.
    r = _record([0.100, 0.120, 0.160, 0.220], completion_tokens=7, start=0.0, end=0.220)
    assert r.itls() == pytest.approx([0.010, 0.020, 0.030])
    assert r.tpot == pytest.approx(0.120 / 6)
    # Token-weighted mean of the ITLs equals TPOT when the stream ends with its last token.
    assert sum(2 * x for x in r.itls()) / 6 == pytest.approx(r.tpot)


def test_no_usage_counts_one_token_per_chunk():
    r = _record([1.0, 1.5, 2.0], completion_tokens=None, start=0.5, end=2.0)
    assert r.output_tokens == 3
    assert r.itls() == pytest.approx([0.5, 0.5])
    assert r.tpot == pytest.approx(0.5)


def test_single_token_and_empty_streams_have_no_itl_or_tpot():
    one = _record([0.2], completion_tokens=1, end=0.3)
    assert one.itls() == [] and one.tpot is None and one.ttft == pytest.approx(0.2)
    empty = _record([], completion_tokens=0, end=0.3)
    assert empty.ttft is None and empty.tpot is None and empty.itls() == []


def test_summary_throughput_counts_completed_requests_over_wall_time():
    a = _record([0.5, 1.0, 1.5], completion_tokens=3, start=0.0, end=1.5)
    a.prompt_tokens = 100
    b = _record([1.0, 1.5, 2.0, 2.5, 3.0], completion_tokens=5, start=0.25, end=3.0)
    b.prompt_tokens = 200
    failed = RequestRecord(2, 50, 4, start=0.5, end=4.0, error="http-429")
    timeout = RequestRecord(3, 50, 4, start=1.0, end=2.0, error="timeout")
    late = RequestRecord(4, 50, 4, start=1.0, end=2.0, error="http-429")
    s = summarize([a, b, failed, timeout, late])
    assert (s.completed, s.failed) == (2, 3)
    assert s.errors == {"http-429": 2, "timeout": 1}
    assert list(s.errors) == ["http-429", "timeout"]  # most frequent first
    assert s.duration_s == 4.0  # first send (0.0) to the last end (4.0), failures included
    assert (s.total_input_tokens, s.total_output_tokens) == (300, 8)
    assert s.request_throughput == 0.5
    assert s.input_throughput == 75.0
    assert s.output_throughput == 2.0
    assert s.total_throughput == 77.0
    assert s.ttft.count == 2 and s.ttft.mean == pytest.approx(625.0)  # 500 ms and 750 ms
    assert s.itl.count == 6 and s.itl.p50 == pytest.approx(500.0)
    assert s.tpot.mean == pytest.approx(500.0)
    assert s.e2e.mean == pytest.approx((1500.0 + 2750.0) / 2)


def test_summary_of_nothing_completed():
    s = summarize([RequestRecord(0, 5, 5, error="run-deadline")])
    assert (s.completed, s.failed, s.duration_s, s.output_throughput) == (0, 1, 0.0, 0.0)
    assert s.ttft.count == 0 and s.ttft.p99 is None


def test_cpu_cost_per_output_token():
    cost = CpuCost.between({"gateway": 10.0, "worker": 20.0, "gone": 1.0},
                           {"gateway": 10.5, "worker": 21.5, "gone": None}, output_tokens=100_000)
    assert cost.cpu_s == {"gateway": 0.5, "worker": 1.5, "gone": None}
    assert cost.us_per_token == {"gateway": 5.0, "worker": 15.0, "gone": None}
    assert cost.total_cpu_s == 2.0
    assert cost.total_us_per_token == 20.0
    assert CpuCost.between({"a": 1.0}, {"a": 2.0}, output_tokens=0).total_us_per_token is None


def test_cpu_meter_reads_this_process():
    meter = CpuMeter({"self": os.getpid()})
    before = meter.sample()["self"]
    # /proc counts CPU time in clock ticks, coarser than process_time(): burn well past a tick.
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert meter.sample()["self"] - before >= 0.2
    with pytest.raises(ValueError, match="no process"):
        CpuMeter({"ghost": 2**22 + 12345})


def test_parse_range():
    assert parse_range("100:340") == (100, 340)
    assert parse_range("128") == (128, 128)
    for bad in ("340:100", "0:5", "a:b", "", "5:"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_lengths_and_token_ids_stay_in_range():
    cfg = BenchConfig(num_requests=2000, input_len=(100, 340), output_len=(100, 300), vocab_size=1000)
    items = build_workload(cfg)
    ins = [it.input_len for it in items]
    outs = [it.output_len for it in items]
    assert (min(ins), max(ins)) == (100, 340)
    assert (min(outs), max(outs)) == (100, 300)
    assert all(len(it.prompt) == it.input_len for it in items)
    ids = {t for it in items for t in it.prompt}
    assert min(ids) == MIN_TOKEN_ID and max(ids) == 999
    assert build_workload(cfg) == items  # same seed, same requests
    assert build_workload(BenchConfig(num_requests=2000, seed=1)) != items


def test_text_prompts_have_one_word_per_planned_token():
    items = build_workload(BenchConfig(num_requests=50, input_len=(3, 9), prompt_mode="text"))
    for it in items:
        words = it.prompt.split(" ")
        assert len(words) == it.input_len and set(words) <= set(WORDS)


def test_poisson_schedule_is_reproducible_and_has_the_asked_rate():
    a = arrival_offsets(10_000, 20.0, seed=7)
    assert a == arrival_offsets(10_000, 20.0, seed=7)
    assert a != arrival_offsets(10_000, 20.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.03)
    # Exponential gaps: about 1/e of them exceed the mean.
    assert sum(g > 1 / 20.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)
    assert arrival_offsets(5, math.inf, seed=7) == [0.0] * 5


def test_config_rejects_what_cannot_run():
    for bad in (dict(endpoint="chat"),  # chat takes text, and prompt_mode defaults to tokens
                dict(num_requests=0), dict(input_len=(5, 4)), dict(concurrency=0),
                dict(request_rate=0.0), dict(vocab_size=10), dict(timeout=math.inf),
                dict(base_url="127.0.0.1:8000"), dict(pids={"gateway": -1})):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
    BenchConfig(endpoint="chat", prompt_mode="text")


def test_sse_reader_takes_reads_split_anywhere():
    r = RequestRecord(0, 3, 2, start=0.0)
    sse = SseReader(r)
    first = b'data: {"choices":[{"text":" a"}],"usage":null}\n\n'
    assert sse.feed(b": keep-alive\n\n" + first[:20], now=0.1)
    assert r.chunk_times == []  # the event is not whole yet
    assert sse.feed(first[20:] + b'data: {"choices":[{"text":" b"}]}\n\ndata: {"choices":[{"text":""', now=0.2)
    assert r.chunk_times == [0.2, 0.2]  # both arrived in the second read
    assert sse.feed(b',"finish_reason":"length"}]}\n\n'
                    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n', now=0.3)
    assert r.chunk_times == [0.2, 0.2]  # the empty finish chunk is not content
    assert (r.prompt_tokens, r.completion_tokens, r.end) == (3, 2, None)
    assert sse.feed(b"data: [DONE]\n\ndata: {not json}\n\n", now=0.4)
    assert r.end == 0.4 and r.ok


def test_sse_reader_chat_deltas_and_failures():
    r = RequestRecord(0, 3, 2, start=0.0)
    assert SseReader(r).feed(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n'
                             b'data: {"choices":[{"delta":{"content":"hi"}}]}\n', now=1.0)
    assert r.chunk_times == [1.0]

    broken = RequestRecord(1, 3, 2, start=0.0)
    assert not SseReader(broken).feed(b'data: {"error":{"message":"engine failed"}}\n\n', now=1.0)
    assert broken.error == "stream-error" and "engine failed" in broken.error_detail

    garbled = RequestRecord(2, 3, 2, start=0.0)
    assert not SseReader(garbled).feed(b"data: {oops\n\n", now=1.0)
    assert garbled.error == "bad-sse"


def test_cli_flags_map_onto_the_config(tmp_path):
    pids = tmp_path / "pids.json"
    pids.write_text('{"gateway": 101, "worker0": "202"}')
    args = build_parser().parse_args(["--endpoint", "chat", "--input-len", "128", "--output-len", "1:5",
                                      "--pids-file", str(pids), "--pid", "nats=303", "--concurrency", "8"])
    cfg = config_from_args(args)
    assert cfg.prompt_mode == "text"  # chat defaults to text prompts
    assert (cfg.input_len, cfg.output_len, cfg.concurrency) == ((128, 128), (1, 5), 8)
    assert cfg.pids == {"gateway": 101, "worker0": 202, "nats": 303}
    assert math.isinf(cfg.request_rate) and cfg.ignore_eos
    defaults = config_from_args(build_parser().parse_args([]))
    assert defaults == BenchConfig()  # the flags' defaults are workload W2


def test_cli_bad_flags_exit_2(capsys):
    assert main(["--input-len", "9:3"]) == 2
    assert main(["--pid", "gateway"]) == 2
    assert main(["--num-requests", "0"]) == 2
    assert main(["--request-rate", "5", "--sweep-rates", "1,2"]) == 2
    assert main(["--help"]) == 0
    assert "--sweep-rates" in capsys.readouterr().out
