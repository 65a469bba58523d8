"""Which gateways still read their inboxes, from their heartbeats (GatewayHeartbeat).

A gateway that dies leaves its requests running on the workers: their tokens go to an inbox no one
reads until max_tokens, the GPU's time and the KV blocks wasted (a 32-stream gateway killed under
load kept its worker busy for the whole of their answers, 2026-11-29). A worker that stops hearing a
gateway it heard before ends that gateway's requests. Only gateways heard before count: a client
of the workers' subjects without beats (a test, the emitter's bench) is never ended by this.

The bound is generous (--gateway-ttl, 15 s): a gateway's event loop may stall for seconds under a burst of
thousands of connections, and ending a live gateway's requests costs far more than a few seconds of
a dead one's. This process's own NATS outage is no gateway's silence: the watch says nothing while
the connection is down and for one bound after it is back.
"""

from __future__ import annotations

import time
from typing import Callable

from shared import subjects
from shared.messages import GatewayHeartbeat

FORGET_S = 3600.0  # a silent gateway's entry is dropped after this (its requests were ended long ago)


class GatewayWatch:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        """ttl: seconds without a beat after which a gateway's requests are ended."""
        self.ttl = ttl
        self.clock = clock
        self.last_beat: dict[str, float] = {}  # gateway inbox → when its last beat came
        self.connected = True
        self._quiet_until = clock() + ttl  # a start (or a reconnect) hears every live gateway within it

    async def attach(self, conn, prefix: str) -> None:
        await conn.subscribe(subjects.gateway_heartbeat(prefix), GatewayHeartbeat, self.on_beat)

    def on_beat(self, beat: GatewayHeartbeat) -> None:
        self.last_beat[beat.inbox] = self.clock()

    def on_bus_state(self, connected: bool) -> None:
        """This process's NATS connection: beats missed while it was down are not the gateways' fault."""
        self.connected = connected
        if connected:
            self._quiet_until = self.clock() + self.ttl

    def silent(self) -> set[str]:
        """Inboxes of gateways heard before and not within the bound (none while this process's own
        connection is down or just back)."""
        now = self.clock()
        if not self.connected or now < self._quiet_until:
            return set()
        gone = {inbox for inbox, at in self.last_beat.items() if now - at > self.ttl}
        for inbox in [i for i in gone if now - self.last_beat[i] > FORGET_S]:
            del self.last_beat[inbox]
        return gone
