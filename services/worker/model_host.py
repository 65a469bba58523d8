"""Several models in one worker process, on one GPU (Infire's multi-model scheduling; vLLM and SGLang
run one model a process).

Each model is a slot: a WorkerService and a ModelManager of its own, with a worker id of its own (the
process's id for the first, `<id>-<n>` after), so the scheduler routes by model exactly as it routes
between workers, and each model keeps its weights, graphs, KV pool and step thread. What the slots
share is the device, and this class decides who holds it:

- **Shares.** A model on the GPU holds a fixed fraction of it (`--memory-share`, default an equal
  split of --gpu-memory-utilization over the models given at start; its weights, activations, graphs
  and KV pool together: the engine sizes its pool within it). The models on the GPU never hold more
  than --gpu-memory-utilization between them.
- **Standby.** A model that does not fit waits in standby: registered, announced, its requests taken
  and held (WorkerService.parked) while it is brought back. Making room evicts the least recently used
  idle models (never one with a request running or waiting), to pinned host memory while
  --host-memory-gb holds them (least recently evicted dropped first), else to nothing (read from disk
  again). A model that cannot be loaded fails its own requests only.
- **Scale to zero.** --model-idle-timeout evicts a model idle that long; its next request brings it
  back the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from services.worker.model_build import HostCopy, ModelCheckError, ModelSpec, check_model
from services.worker.model_manager import ModelManager
from services.worker.service import WorkerService
from shared.admin_messages import WorkerAdminReply
from shared.config import WorkerServiceConfig

log = structlog.get_logger("worker.host")

ROOM_POLL = 0.05  # seconds between looks for an idle model to evict while every one is busy
EPS = 1e-9


@dataclasses.dataclass(slots=True)
class Slot:
    share: float  # of the device, when on the GPU (0: all of the budget)
    service: WorkerService
    manager: ModelManager
    copy: HostCopy | None = None  # its weights in host memory while in standby
    evicted_at: float = 0.0
    waking: asyncio.Future | None = None

    @property
    def resident(self) -> bool:
        return self.manager.built is not None

    @property
    def spec(self) -> ModelSpec:
        """The model it serves (or last served: a load over the admin subject may replace it)."""
        return self.manager.spec


class ModelHost:
    def __init__(self, cfg: WorkerServiceConfig, conn, prefix: str, cuda_graphs: bool, overlap: bool,
                 warm: asyncio.Future, gateways=None):
        self.cfg, self.conn, self.prefix = cfg, conn, prefix
        self.gateways = gateways  # a GatewayWatch the slots share: their requests of a dead gateway end
        self.cuda_graphs, self.overlap, self.warm = cuda_graphs, overlap, warm
        self.budget = cfg.gpu_memory_utilization
        self.host_budget = int(cfg.host_memory_gb * 1e9)
        self.slots: list[Slot] = []
        self._moving = 0  # bytes of the host copy being brought back (out of its slot, not yet freed)
        self.lock = asyncio.Lock()  # one residency change at a time: each sees what the last left
        self._sweeper: asyncio.Task | None = None

    # -- slots ---------------------------------------------------------------------------------------
    async def start(self) -> Slot:
        """The process's own slot (its worker id), with no model yet; the idle sweeper."""
        slot = await self._new_slot(ModelSpec(self.cfg.model_dir, self.cfg.model_name), self.cfg.memory_share)
        if self.cfg.model_idle_timeout > 0:
            self._sweeper = asyncio.ensure_future(self._sweep_idle())
        return slot

    async def _new_slot(self, spec: ModelSpec, share: float) -> Slot:
        n = len(self.slots)
        wid = self.cfg.worker_id if n == 0 else f"{self.cfg.worker_id}-{n}"
        cfg = dataclasses.replace(self.cfg, worker_id=wid, memory_share=share, model_dir=spec.model_dir,
                                  model_name=spec.model_name)
        service = WorkerService(cfg, self.conn, self.prefix)
        service.gateways = self.gateways
        service.host = self.cfg.worker_id
        manager = ModelManager(service, cfg, self.cuda_graphs, self.overlap, self.warm)
        manager.host, manager.spec = self, spec
        slot = Slot(share, service, manager)
        service.on_wake = lambda: self.wake(slot)
        self.slots.append(slot)
        await service.start()
        await manager.start()
        return slot

    async def register(self, spec: ModelSpec, share: float) -> Slot:
        """A further model of this process, in standby: announced, loaded at its first request."""
        slot = await self._new_slot(spec, share)
        slot.service.model_dir = spec.model_dir
        await slot.service.set_state("standby", spec.model_name)
        return slot

    def fits(self, slot: Slot) -> bool:
        """Whether `slot` would fit on the GPU beside the models there now."""
        return self._used(slot) + (slot.share or self.budget) <= self.budget + EPS

    def _used(self, but: Slot | None = None) -> float:
        return sum(s.share or self.budget for s in self.slots if s is not but and (s.resident or s.manager.busy))

    async def add(self, spec: ModelSpec, share: float) -> WorkerAdminReply:
        """`inferno load-model --mode add`: a slot for `spec`, loaded now (evicting idle models for its
        room); the reply is the new slot's."""
        if any(s.spec.model_name == spec.model_name for s in self.slots if s.service.state != "no_model"):
            return self.slots[0].manager._reply("bad_request", f"the model {spec.model_name!r} is served here already")
        try:
            await asyncio.to_thread(check_model, spec, self.cfg)
        except ModelCheckError as e:
            return self.slots[0].manager._reply("bad_request", str(e))
        share = share or self.budget / (sum(s.service.state != "no_model" for s in self.slots) + 1)
        slot = await self.register(spec, share)
        return await self._bring_back(slot, wait_for_room=True)

    # -- residency -------------------------------------------------------------------------------------
    def wake(self, slot: Slot) -> None:
        """A request came for a standby model (WorkerService.on_wake): bring it back, once."""
        if slot.waking is None or slot.waking.done():
            slot.waking = asyncio.ensure_future(self._wake(slot))

    async def _wake(self, slot: Slot) -> None:
        try:
            await self._bring_back(slot, wait_for_room=False)
        except Exception as e:  # a bug: its waiting requests hear of it, the worker stays up
            log.exception("bringing a model back failed", model=slot.spec.model_name)
            slot.service.fail_parked(f"the model {slot.spec.model_name!r} could not be loaded ({type(e).__name__}: {e})")

    async def load_at_start(self, slot: Slot) -> None:
        """A model named at start beside the first: loaded now if it fits, else left in standby."""
        async with self.lock:
            if not self.fits(slot):
                log.info("model in standby", model=slot.spec.model_name, reason="no room at start")
                return
        await self._bring_back(slot, wait_for_room=False)

    async def _bring_back(self, slot: Slot, wait_for_room: bool) -> WorkerAdminReply:
        async with self.lock:
            if slot.resident:
                slot.service.release_parked()
                return slot.manager._reply()
            try:  # before anything is evicted for it
                await slot.manager.check(slot.spec)
            except ModelCheckError as e:
                slot.service.fail_parked(f"the model {slot.spec.model_name!r} could not be loaded: {e}")
                return slot.manager._reply("bad_request", str(e))
            # Its host copy is taken first: the room made for it may drop host copies, never its own.
            copy, slot.copy = slot.copy, None
            self._moving = copy.nbytes if copy is not None else 0  # still in host memory meanwhile
            room = await self._make_room(slot, wait_for_room)
            self._moving = 0
            if not room:
                slot.copy = copy
                reason = (f"the model {slot.spec.model_name!r} does not fit: its share {slot.share or self.budget:g} "
                          f"of the GPU is more than the budget {self.budget:g}"
                          if (slot.share or self.budget) > self.budget + EPS else
                          "no room on the GPU: every model there is busy")
                slot.service.fail_parked(reason)
                return slot.manager._reply("busy", reason)
            t = time.perf_counter()
            reply = await slot.manager.wake(slot.spec, copy)
            log.info("model on the GPU", model=slot.spec.model_name, source="host memory" if copy else "disk",
                     seconds=round(time.perf_counter() - t, 3), ok=reply.ok)
            return reply

    async def _make_room(self, slot: Slot, wait_for_room: bool) -> bool:
        """Evict idle models, least recently used first, until `slot` fits; while every model on the
        GPU is busy, wait as long as requests wait for `slot` (or the caller waits)."""
        if (slot.share or self.budget) > self.budget + EPS:
            return False
        while not self.fits(slot):
            idle = [s for s in self.slots if s is not slot and s.resident and not s.manager.busy
                    and not s.service.busy()]
            if idle:
                await self._evict(min(idle, key=lambda s: s.service.last_used))
                continue
            if not (wait_for_room or slot.service.parked):
                return False
            await asyncio.sleep(ROOM_POLL)
        return True

    async def _evict(self, slot: Slot) -> None:
        """`slot` off the GPU (held lock): its weights to host memory when the budget there allows."""
        built = slot.manager.built
        nbytes = built.checked.weight_bytes if built is not None else 0
        keep = 0 < nbytes <= self.host_budget - self._moving
        if keep:
            self._free_host(nbytes)
        slot.copy = await slot.manager.evict(keep)
        slot.evicted_at = time.monotonic()

    def _free_host(self, nbytes: int) -> None:
        """Drop host copies, the longest evicted first, until `nbytes` more fit the host budget."""
        held = sorted((s for s in self.slots if s.copy is not None), key=lambda s: s.evicted_at)
        while held and sum(s.copy.nbytes for s in held) + self._moving + nbytes > self.host_budget:
            dropped = held.pop(0)
            log.info("host copy dropped", model=dropped.spec.model_name, gb=round(dropped.copy.nbytes / 1e9, 2))
            dropped.copy.release()
            dropped.copy = None

    def host_bytes(self) -> int:
        return sum(s.copy.nbytes for s in self.slots if s.copy is not None)

    async def _sweep_idle(self) -> None:
        timeout = self.cfg.model_idle_timeout
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for slot in self.slots:
                if (slot.resident and not slot.manager.busy and not slot.service.busy()
                        and now - slot.service.last_used >= timeout):
                    async with self.lock:
                        if slot.resident and not slot.service.busy():
                            log.info("model idle", model=slot.spec.model_name, seconds=round(now - slot.service.last_used))
                            await self._evict(slot)

    # -- shutdown --------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        for slot in self.slots:
            slot.service.fail_parked("the worker is shutting down")
        await asyncio.gather(*(slot.service.drain(timeout) for slot in self.slots))

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for slot in self.slots:
            slot.copy = None
            await slot.manager.close()
