"""Prometheus metrics of the kvstore (`inferno_kvstore:` names), on its own CollectorRegistry.

The index's gauges and counters are read at scrape time (nothing to update per request); the
service's own events (requests by verb and outcome, bad messages, transfers) are counted here.
Transfer time is measured where the store can see it: a put from its header's arrival to the last
payload byte; a get's send completes inside the UCXX stream after the handler returns, so its
rate is the client's to measure (KvStoreClient.last_get).

Latency histograms show a slow store in a dashboard (issue 42): each control verb from its
message's delivery to the reply's publish, a put's payload receive, and the event loop's lag (how
late a timer fires: what a message waits before the loop reads it).
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.kvstore.page_index import PageIndex

P = "inferno_kvstore:"
# 50 µs (an index operation) to 10 s (a store that has stopped keeping up).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5,
                   10.0)


class IndexCollector:
    def __init__(self, index: PageIndex):
        self.index = index

    def describe(self) -> list[Metric]:
        return []  # unchecked: built at scrape time

    def collect(self) -> Iterator[Metric]:
        ix, s = self.index, self.index.stats
        for name, doc, value in (
                ("pages", "Committed pages held.", ix.num_pages),
                ("reserved_pages", "Pages reserved by puts not yet committed.", ix.num_reserved_pages),
                ("bytes_used", "Host bytes held by pages and reservations.", ix.used_bytes),
                ("capacity_bytes", "Host bytes the store may hold.", ix.capacity),
                ("leases", "Read and write leases held.", ix.num_leases)):
            yield GaugeMetricFamily(P + name, doc, value)
        for name, doc, value in (
                ("hit_pages", "Lookups: leading pages found.", s.hit_pages),
                ("miss_pages", "Lookups: pages after the first miss.", s.miss_pages),
                ("hit_tokens", "Lookups: tokens of the leading pages found.", s.hit_tokens),
                ("miss_tokens", "Lookups: tokens of the pages after the first miss.", s.miss_tokens),
                ("leased_pages", "Gets: pages leased to readers.", s.leased_pages),
                ("stored_pages", "Pages committed.", s.stored_pages),
                ("evictions", "Pages evicted (LRU) to make room.", s.evictions),
                ("lease_expiries", "Leases swept at their deadline (a client died or forgot).", s.lease_expiries),
                ("no_space", "Puts refused because even eviction could not make room.", s.no_space)):
            yield CounterMetricFamily(P + name, doc, value)


class KvStoreMetrics:
    def __init__(self, index: PageIndex):
        self.registry = r = CollectorRegistry()
        r.register(IndexCollector(index))
        self.requests = Counter(P + "requests", "Control requests, by verb and outcome code.", ["verb", "code"],
                                registry=r)
        self.bad_messages = Counter(P + "bad_messages", "Control messages rejected undecoded, by verb and reason.",
                                    ["verb", "reason"], registry=r)
        self.transfer_bytes = Counter(P + "transfer_bytes", "Page bytes moved over UCXX, by op.", ["op"], registry=r)
        self.transfer_seconds = Counter(P + "transfer_seconds", "Time receiving put payloads.", ["op"], registry=r)
        self.transfer_gbps = Gauge(P + "transfer_gbps", "Rate of the last put payload received, GB/s.", ["op"],
                                   registry=r)
        self.transfer_errors = Counter(P + "transfer_errors", "UCXX calls refused or failed.", registry=r)
        self.request_seconds = Histogram(P + "request_seconds", "Control requests from delivery to reply, by verb.",
                                         ["verb"], buckets=LATENCY_BUCKETS, registry=r)
        self.put_receive_seconds = Histogram(P + "put_receive_seconds", "A put's payload from its header to its "
                                             "last byte.", buckets=LATENCY_BUCKETS, registry=r)
        self.loop_lag_seconds = Histogram(P + "loop_lag_seconds", "How late the event loop ran a timer (the wait "
                                          "of a message before it is read).", buckets=LATENCY_BUCKETS, registry=r)
        # Plain totals for the stats reply (prometheus_client keeps its values private).
        self.bad_total = 0
        self.bytes_in = 0
        self.bytes_out = 0

    def request(self, verb: str, code: str) -> None:
        self.requests.labels(verb=verb, code=code or "ok").inc()

    def answered(self, verb: str, seconds: float) -> None:
        self.request_seconds.labels(verb=verb).observe(seconds)

    def bad_message(self, verb: str, reason: str) -> None:
        self.bad_total += 1
        self.bad_messages.labels(verb=verb, reason=reason).inc()

    def put_received(self, nbytes: int, seconds: float) -> None:
        self.bytes_in += nbytes
        self.transfer_bytes.labels(op="put").inc(nbytes)
        self.transfer_seconds.labels(op="put").inc(seconds)
        self.put_receive_seconds.observe(seconds)
        if seconds > 0:
            self.transfer_gbps.labels(op="put").set(nbytes / seconds / 1e9)

    def get_sent(self, nbytes: int) -> None:
        self.bytes_out += nbytes
        self.transfer_bytes.labels(op="get").inc(nbytes)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
