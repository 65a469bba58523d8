"""How many tokens the router sent to each expert: the MoE load statistics of /metrics."""

from __future__ import annotations

import torch


class ExpertLoad:
    """Sums the MoE layers' per-expert counters (MoE.routed, kept on the device) for the heartbeat.

    Reading them must not stall the step loop: each snapshot() starts a copy to pinned host memory
    behind the steps already queued and returns the copy that the previous call started (one
    refresh old: a fraction of a second). On the CPU it reads them at once."""

    def __init__(self, model) -> None:
        self.counters = [m.routed for m in model.modules() if hasattr(m, "routed")]
        for counter in self.counters:  # (a loaded model's buffers are allocated, not initialised)
            counter.zero_()
        self.experts = self.counters[0].numel() if self.counters else 0
        device = self.counters[0].device if self.counters else torch.device("cpu")
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(self.experts, dtype=torch.int64, pin_memory=self.cuda)
        self.copied = torch.cuda.Event() if self.cuda else None
        self.started = False
        self.last: list[int] = [0] * self.experts

    def snapshot(self) -> list[int]:
        """Tokens routed to each expert since the start, summed over this process's MoE layers."""
        if not self.counters:
            return []
        if not self.cuda:
            return torch.stack(self.counters).sum(0).tolist()
        if self.started and self.copied.query():
            result = self.host.tolist()
        elif self.started:
            return self.last
        else:
            result = [0] * self.experts
        self.host.copy_(torch.stack(self.counters).sum(0), non_blocking=True)
        self.copied.record()
        self.started = True
        self.last = result
        return result
