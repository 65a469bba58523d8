"""The worker's model over its life: loaded at start (--model-dir) or when told over the admin
subjects, replaced, unloaded; one admin call at a time; the state the heartbeats report; and where
each load's time went (one log line at its first token).

A replace frees the old model before the new one is read (both rarely fit on one GPU): its requests
drain (up to the call's drain_timeout) or are aborted at once, ending with an error the gateway
turns into an OpenAI error. The new model is checked before that (config, tokenizer, weight
headers), so a bad directory costs nothing; a failure past that point leaves the worker with no
model, and the reply says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from services.worker.model_build import (BuiltModel, CheckedModel, HostCopy, Leftovers, ModelCheckError, ModelSpec,
                                         between_steps, build_model, check_model, evict_model, free_memory,
                                         release_model)
from services.worker.service import WorkerService
from shared import subjects
from shared.admin_messages import (LoadBreakdown, LoadModelRequest, UnloadModelRequest, WorkerAdminReply,
                                   WorkerStatusRequest)
from shared.config import WorkerServiceConfig
from shared.gc_tuning import tune_gc

log = structlog.get_logger("worker.model")


class ModelManager:
    def __init__(self, service: WorkerService, cfg: WorkerServiceConfig, cuda_graphs: bool, overlap: bool,
                 warm: asyncio.Future):
        self.service = service
        self.cfg = cfg
        self.cuda_graphs = cuda_graphs
        self.overlap = overlap
        self.warm = warm  # warm_device() in a thread: its WarmDevice once done
        self.built: BuiltModel | None = None
        self.leftovers: Leftovers | None = None
        self.busy = ""  # the admin call under way, in words
        self.checked: dict[ModelSpec, CheckedModel] = {}  # the last model checked: a wake checks it once
        self.host = None  # the ModelHost of this process's models: a load in mode "add" goes there
        self.spec: ModelSpec | None = None  # the model served (or in standby)

    async def start(self) -> None:
        """Answer the admin subjects (status at once, also during a load)."""
        conn, prefix, wid = self.service.conn, self.service.prefix, self.cfg.worker_id
        await conn.subscribe(subjects.worker_admin(prefix, wid, "load"), LoadModelRequest, self.on_load, concurrency=8)
        await conn.subscribe(subjects.worker_admin(prefix, wid, "unload"), UnloadModelRequest, self.on_unload,
                             concurrency=8)
        await conn.subscribe(subjects.worker_admin(prefix, wid, "status"), WorkerStatusRequest, self.on_status)

    async def close(self) -> None:
        """At shutdown, after the service drained: free the model (a parallel group's ranks stop)."""
        if self.built is not None:
            built, self.built = self.built, None
            await asyncio.to_thread(release_model, built, self.cfg)

    # -- admin handlers ---------------------------------------------------------------------------
    async def on_load(self, req: LoadModelRequest) -> WorkerAdminReply:
        spec = ModelSpec.of(self.cfg, req.model_dir, req.model_name, req.dtype, req.max_model_len, req.load_format)
        try:
            if req.mode == "add":
                if self.host is None:
                    return self._reply("bad_request", "this worker holds one model only")
                return await self.host.add(spec, req.memory_share)
            return await self.load(spec, time.time(), req.mode, req.drain_timeout)
        except Exception as e:  # a bug: the caller hears of it, the worker stays up
            log.exception("admin load failed", model_dir=req.model_dir)
            return self._reply("internal", f"{type(e).__name__}: {e}")

    async def on_unload(self, req: UnloadModelRequest) -> WorkerAdminReply:
        if self.busy:
            return self._reply("busy", f"the worker is {self.busy}; retry once it is done")
        if self.built is None:
            return self._reply()
        self.busy = "unloading its model"
        try:
            await self._unload(req.mode, req.drain_timeout, None, "the worker is unloading its model")
            await self.service.set_state("no_model", "")
            return self._reply()
        except Exception as e:
            log.exception("admin unload failed")
            return self._reply("internal", f"{type(e).__name__}: {e}")
        finally:
            self.busy = ""

    def on_status(self, _req: WorkerStatusRequest) -> WorkerAdminReply:
        return self._reply()

    # -- several models on one GPU (model_host.py decides; these move one model) --------------------
    async def evict(self, keep: bool) -> HostCopy | None:
        """Take the model off the GPU (the host found it idle): it stays registered, in standby, so its
        next request waits here while it comes back; its weights kept in host memory when `keep`."""
        if self.built is None or self.busy:
            return None
        self.busy = "evicting its model"
        try:
            await self.service.set_state("standby", self.service.model_name)
            await self.service.detach()
            built, self.built = self.built, None
            if keep:
                # A built model came after the device's warm-up: it is done, and succeeded.
                copy = await asyncio.to_thread(evict_model, built, self.cfg, self.warm.result().arena)
            else:
                copy = None
                await asyncio.to_thread(release_model, built, self.cfg)
            log.info("model evicted", model=built.checked.spec.model_name, kept_gb=round(copy.nbytes / 1e9, 2)
                     if copy is not None else 0.0)
            return copy
        finally:
            self.busy = ""

    async def check(self, spec: ModelSpec, cached: bool = True) -> CheckedModel:
        """check_model's verdict (ModelCheckError), off the event loop; a standby model's is kept, so
        its comings and goings read its directory's headers once."""
        checked = self.checked.get(spec) if cached else None
        if checked is None:
            checked = await asyncio.to_thread(check_model, spec, self.cfg)
            self.checked = {spec: checked}
        return checked

    async def wake(self, spec: ModelSpec, copy: HostCopy | None) -> WorkerAdminReply:
        """Bring a standby model back (from `copy`, else from disk); its waiting requests then join the
        queue, or end with the error if it cannot be loaded."""
        reply = await self.load(spec, time.time(), host=copy, waking=True)
        if reply.ok:
            self.service.release_parked()
        else:
            await self.service.set_state("standby", spec.model_name)
            self.service.fail_parked(f"the model {spec.model_name!r} could not be loaded: {reply.error}")
        return reply

    # -- load, replace, unload ----------------------------------------------------------------------
    async def load(self, spec: ModelSpec, started: float, mode: str = "drain", drain_timeout: float = 30.0,
                   at_start: bool = False, prefetch=None, host: HostCopy | None = None,
                   waking: bool = False) -> WorkerAdminReply:
        """Serve `spec`, replacing the model in place if any; `started` (wall clock) is where the
        breakdown counts from: the request's arrival, or (`at_start`) the process's start. `host`: the
        model's weights kept in host memory; `waking`: a standby model comes back (its state stays
        standby until it serves, so requests keep waiting here rather than being refused)."""
        if self.busy:
            return self._reply("busy", f"the worker is {self.busy}; retry once it is done")
        self.busy = f"loading {spec.model_name}"
        try:
            try:
                checked = await self.check(spec, cached=waking)
            except ModelCheckError as e:
                log.warning("model refused", model_dir=spec.model_dir, error=str(e))
                return self._reply("bad_request", str(e))
            try:
                warm = await self.warm
            except Exception as e:
                return self._reply("internal", f"the device could not be initialised ({type(e).__name__}: {e})")
            unload_s = 0.0
            if self.built is not None:
                t = time.perf_counter()
                await self._unload(mode, drain_timeout, checked, "the worker is replacing its model")
                unload_s = time.perf_counter() - t
            await self.service.set_state("standby" if waking else "loading", spec.model_name)
            self.service.model_dir = spec.model_dir
            leftovers, self.leftovers = self.leftovers, None
            built, error = None, ""
            try:
                built = await asyncio.to_thread(build_model, checked, self.cfg, self.cuda_graphs, self.overlap,
                                                leftovers, warm.staging, host)
            except Exception as e:
                log.exception("model load failed", model_dir=spec.model_dir)
                error = f"loading {spec.model_dir} failed ({type(e).__name__}: {e}); the worker has no model now"
            if built is None:  # out of the except block: its traceback no longer holds the partial engine
                del leftovers
                await asyncio.to_thread(free_memory, _device(self.cfg))
                await self.service.set_state("no_model", "")
                return self._reply("load_failed", error)
            self.spec = spec
            breakdown = self._breakdown(built, started, warm.marks, unload_s)
            self._attach(built, breakdown, started, at_start, prefetch, warm.marks)
            await self.service.store_warm()
            await self.service.set_state("ready", spec.model_name)
            log.info("model ready", model=spec.model_name, model_dir=spec.model_dir, ready_s=round(breakdown.ready_s, 3))
            return self._reply(load=breakdown)
        finally:
            self.busy = ""

    async def _unload(self, mode: str, drain_timeout: float, next_model: CheckedModel | None, reason: str) -> None:
        """Stop serving (the scheduler learns it at once), finish or abort the requests, free the
        memory but what `next_model` reuses."""
        await self.service.set_state("unloading", self.service.model_name)
        await self.service.finish_requests(drain_timeout if mode == "drain" else 0.0, reason)
        await self.service.detach()
        built, self.built = self.built, None
        self.leftovers = await asyncio.to_thread(release_model, built, self.cfg, next_model)
        log.info("model unloaded", model=built.checked.spec.model_name,
                 kv_kept=self.leftovers.kv_cache is not None)

    def _attach(self, built: BuiltModel, breakdown: LoadBreakdown, started: float, at_start: bool,
                prefetch, marks: dict) -> None:
        self.built = built
        tune_gc()  # the new model's objects out of every later collection, as at start
        spec = built.checked.spec
        self.service.attach(built.engine, built.checked.eos_token_ids, built.max_model_len, spec.model_name,
                            between_steps(built), tokenizer_source=spec.model_dir)
        fields = {k: round(v, 3) if isinstance(v, float) else v for k, v in _fields(breakdown).items()}
        if prefetch is not None:
            fields.update(prefetch.report())
        if at_start and "cublas_at" in marks:  # the device's share: context, cuBLAS, pinned staging
            fields.update(context_s=round(marks["context_at"] - marks["imported_at"], 3),
                          cublas_s=round(marks["cublas_at"] - marks["context_at"], 3),
                          staging_s=round(marks["device_at"] - marks["cublas_at"], 3))
            fields.update({k: v for k, v in marks.items() if k.startswith("early_")})  # cuda_early.py's share

        def first_token() -> None:
            log.info("model load breakdown", model=spec.model_name, since="process start" if at_start
                     else "load request", first_token_s=round(time.time() - started, 3), **fields)
        self.service.on_first_token = first_token

    def _breakdown(self, built: BuiltModel, started: float, marks: dict, unload_s: float) -> LoadBreakdown:
        t = built.timings
        imports_s = max(0.0, marks["imported_at"] - started)
        device_s = max(0.0, marks["device_at"] - max(started, marks["imported_at"]))
        return LoadBreakdown(imports_s=imports_s, device_s=device_s, unload_s=unload_s,
                             weights_s=t.get("weights_s", 0.0), weights_gb=t.get("weights_gb", 0.0),
                             kv_s=max(0.0, t.get("kv_s", 0.0)), kv_reused=bool(t.get("kv_reused")),
                             graphs_s=t.get("graphs_s", 0.0), graphs_deferred=t.get("graphs_deferred", 0),
                             ready_s=time.time() - started)

    def _reply(self, code: str = "", error: str = "", load: LoadBreakdown | None = None) -> WorkerAdminReply:
        s = self.service
        return WorkerAdminReply(ok=not code, worker_id=self.cfg.worker_id, state=s.state, model=s.model_name,
                                model_dir=self.built.checked.spec.model_dir if self.built is not None else "",
                                warm=self.warm.done(), code=code, error=error, load=load)


def _fields(msg: LoadBreakdown) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def _device(cfg: WorkerServiceConfig):
    if not cfg.device.startswith("cuda"):
        return None
    import torch
    return torch.device(cfg.device)
