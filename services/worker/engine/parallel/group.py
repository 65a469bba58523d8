"""A worker group's processes: the driver starts the other ranks, every rank joins the
torch.distributed groups, and a rank that dies takes the whole group down (nothing hangs)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from services.worker.engine.parallel.layout import ParallelLayout
from services.worker.engine.parallel.step_channel import OP_STOP, StepChannel, StepMessage
from services.worker.engine.parallel.tensor_parallel import TensorGroup

log = structlog.get_logger("worker.parallel")

# A collective waits at most one step (or a graph capture) for its peers.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Other ranks wait for the driver's next step for as long as the worker is idle.
IDLE_TIMEOUT = timedelta(days=365)
EXIT_CODE_RANK_LOST = 3


@dataclass
class RankGroup:
    layout: ParallelLayout
    device: torch.device
    channel: StepChannel
    tp: TensorGroup
    followers: list[subprocess.Popen] = field(default_factory=list)  # the driver's children
    closing: bool = False

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.channel.group)
        return int(t.item())

    def broadcast_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The driver's drawn ids to every tensor rank (an overlapped step feeds them back)."""
        dist.broadcast(ids, self.layout.driver_rank, group=self.tp.group)
        return ids

    def close(self) -> None:
        """Driver: tell the other ranks to stop, wait for them, leave the groups."""
        self.closing = True
        if self.layout.is_driver:
            try:
                self.channel.send(StepMessage(OP_STOP))
                self.channel.wait()
            except Exception:  # a rank already gone: nothing to tell it
                pass
            deadline = time.monotonic() + 10
            for proc in self.followers:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # NCCL communicators that CUDA graphs captured cannot be torn down while the graphs live
        # (destroy_process_group hung on two H200s); they go with the process. Gloo's (CPU, tests
        # that start several groups in one process) are destroyed.
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()


def rank_device(base: str, rank: int) -> torch.device:
    """Rank r of a group whose driver was given `base` (e.g. cuda:2) runs on the r-th device
    from there; on the CPU every rank is "cpu"."""
    device = torch.device(base)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def join_group(layout: ParallelLayout, init_method: str, device: torch.device,
               peer_all_reduce: bool = True, fuse_norm: bool = False) -> RankGroup:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        if layout.tp > 1:  # a tensor-parallel step's launches overlap (kernels/_common.py says what it gains)
            from services.worker.kernels._common import use_pdl
            use_pdl(True)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method,
                            world_size=layout.world_size, rank=layout.rank, timeout=COLLECTIVE_TIMEOUT)
    # Every rank creates every group, in the same order.
    messages = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    stage_groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp)]
    stage_hosts = [dist.new_group(layout.stage_ranks(s), backend="gloo") for s in range(layout.pp)]
    return RankGroup(layout, device, StepChannel(messages, layout.driver_rank),
                     TensorGroup(stage_groups[layout.stage], layout.tp, peer_all_reduce, stage_hosts[layout.stage],
                                 fuse_norm))


def start_group(config, layout: ParallelLayout) -> RankGroup:
    """Driver: start the other ranks (each one a `python -m ...parallel.follower` process with
    the same engine config), join the group with them, then watch them."""
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    blob = json.dumps(dataclasses.asdict(config))
    followers = []
    for rank in range(layout.world_size):
        if rank == layout.driver_rank:
            continue
        cmd = [sys.executable, "-m", "services.worker.engine.parallel.follower",
               "--rank", str(rank), "--init-method", init_method, "--config", blob]
        followers.append(subprocess.Popen(cmd))
    try:
        group = join_group(layout, init_method, rank_device(config.device, layout.rank), config.custom_all_reduce,
                           config.fused_all_reduce_norm)
    except Exception:
        for proc in followers:
            proc.kill()
        raise
    group.followers = followers
    threading.Thread(target=_watch_followers, args=(group,), name="rank-watch", daemon=True).start()
    log.info("parallel group up", tensor_parallel=layout.tp, pipeline_parallel=layout.pp,
             ranks=layout.world_size, pids=[p.pid for p in followers])
    return group


def _watch_followers(group: RankGroup) -> None:
    """A dead rank leaves the others waiting in a collective for ever (NCCL), so the driver ends
    the whole group and its process: clients get the worker-lost errors the gateway gives, the
    scheduler drops the worker at its heartbeat TTL, and a supervisor starts a fresh group."""
    while not group.closing:
        for proc in group.followers:
            code = proc.poll()
            if code is not None and not group.closing:
                end_group(group, "a rank of the group exited", pid=proc.pid, code=code)
        time.sleep(0.2)


def end_group(group: RankGroup, reason: str, **details) -> None:
    """Kill the other ranks and this process: the group can no longer take a step together
    (a rank is gone, or a step failed on the driver after the others had started it)."""
    log.error(f"{reason}; stopping the group", **details)
    for proc in group.followers:
        if proc.poll() is None:
            proc.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE_RANK_LOST)


def die_with_parent() -> None:
    """A follower never outlives its driver: a thread checks twice a second that its parent is
    still there. (Not PR_SET_PDEATHSIG: it fires when the parent *thread* ends, and the driver
    starts its ranks from whichever thread builds the engine.)"""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(EXIT_CODE_RANK_LOST)
            time.sleep(0.5)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
