"""The driver's one message per step to the other ranks: a fixed header and an int64 payload,
broadcast over a gloo group (host to host, so the driver never waits for its GPU to send)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

HEADER_LEN = 32
OP_STEP, OP_STOP = 1, 2
KIND_EAGER, KIND_GRAPH = 0, 1
# header: [op, kind, logits rows, share ids, payload length, kind's fields...]
FIELDS_AT = 5


@dataclass(slots=True)
class StepMessage:
    op: int
    kind: int = KIND_EAGER
    num_logits: int = 0  # rows whose logits the step computes (0: no draw)
    share_ids: bool = False  # the driver broadcasts the drawn ids after the step (overlap feeds)
    fields: tuple[int, ...] = ()
    payload: np.ndarray | None = None

    def header(self) -> torch.Tensor:
        h = np.zeros(HEADER_LEN, dtype=np.int64)
        n = 0 if self.payload is None else len(self.payload)
        h[:FIELDS_AT] = (self.op, self.kind, self.num_logits, int(self.share_ids), n)
        h[FIELDS_AT:FIELDS_AT + len(self.fields)] = self.fields
        return torch.from_numpy(h)


class StepChannel:
    """Driver side: send() returns at once (the broadcasts run on gloo's threads; the previous
    message is completed first, so at most one is in the air). Other ranks: recv() blocks."""

    def __init__(self, group, src: int):
        self.group = group
        self.src = src
        self._in_flight: list = []

    def send(self, message: StepMessage) -> None:
        self.wait()
        header = message.header()
        works = [dist.broadcast(header, self.src, group=self.group, async_op=True)]
        payload = None
        if message.payload is not None and len(message.payload):
            payload = torch.from_numpy(np.ascontiguousarray(message.payload, dtype=np.int64))
            works.append(dist.broadcast(payload, self.src, group=self.group, async_op=True))
        self._in_flight = [works, header, payload]  # the tensors live until their sends end

    def wait(self) -> None:
        if self._in_flight:
            for work in self._in_flight[0]:
                work.wait()
            self._in_flight = []

    def recv(self) -> StepMessage:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, self.src, group=self.group)
        h = header.numpy()
        op, kind, num_logits, share_ids, n = (int(x) for x in h[:FIELDS_AT])
        payload = None
        if n:
            buf = torch.empty(n, dtype=torch.int64)
            dist.broadcast(buf, self.src, group=self.group)
            payload = buf.numpy()
        return StepMessage(op, kind, num_logits, bool(share_ids), tuple(int(x) for x in h[FIELDS_AT:]), payload)
