"""A worker's view of the gateways' heartbeats: only a gateway heard before and then silent past the
bound counts as gone, and never while the worker's own NATS connection is down or just back."""

from __future__ import annotations

from services.worker.gateway_watch import FORGET_S, GatewayWatch
from shared.messages import GatewayHeartbeat


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(inbox: str) -> GatewayHeartbeat:
    return GatewayHeartbeat(gateway_id=inbox.split(".")[2], inbox=inbox, in_flight=3)


def test_a_gateway_heard_and_then_silent_past_the_bound_is_gone():
    clock = Clock()
    watch = GatewayWatch(ttl=5.0, clock=clock)
    a, b = "inferno.gateway.gw-a.tokens", "inferno.gateway.gw-b.tokens"
    watch.on_beat(beat(a))
    watch.on_beat(beat(b))
    clock.now += 4.0
    assert watch.silent() == set()  # the start's quiet bound: every live gateway is heard within it
    watch.on_beat(beat(b))
    clock.now += 2.0
    assert watch.silent() == {a}  # 6 s since a's beat, 2 since b's; an inbox never heard is never gone
    clock.now += FORGET_S
    assert watch.silent() == {a, b} and watch.last_beat == {}  # both forgotten once long gone


def test_the_workers_own_outage_is_no_gateways_silence():
    clock = Clock()
    watch = GatewayWatch(ttl=5.0, clock=clock)
    a = "inferno.gateway.gw-a.tokens"
    clock.now += 6.0
    watch.on_beat(beat(a))
    watch.on_bus_state(False)
    clock.now += 30.0
    assert watch.silent() == set()  # down: the beats are not reaching this process
    watch.on_bus_state(True)
    clock.now += 4.0
    assert watch.silent() == set()  # just back: a live gateway beats within the bound
    clock.now += 2.0
    assert watch.silent() == {a}
    watch.on_beat(beat(a))
    assert watch.silent() == set()
