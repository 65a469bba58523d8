"""Models the gateway learns from worker heartbeats: a name it does not serve yet, announced with a
directory it can read, is loaded off the event loop and added to the catalogue."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Callable, Coroutine

from services.gateway.catalogue import Catalogue, ServedModel
from shared.logging import get_logger
from shared.messages import WorkerHeartbeat

log = get_logger("gateway.models")


class ModelDiscovery:
    """Feeds the catalogue from heartbeats. Each unknown name is tried once: a directory this host
    cannot read (the worker's file system is not ours) is logged once, not every second."""

    def __init__(self, catalogue: Catalogue, executor: Executor, spawn: Callable[[Coroutine], asyncio.Task], *,
                 max_n: int, tool_call_parser: str):
        self.catalogue = catalogue
        self.executor = executor
        self.spawn = spawn
        self.max_n = max_n
        self.tool_call_parser = tool_call_parser
        self.tried: set[str] = set()  # names loaded, being loaded, or that failed

    def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        """Cheap for a known name (two set lookups): it runs on every heartbeat of every worker."""
        name = hb.model
        if not name or name in self.tried or name in self.catalogue or not hb.model_dir:
            return
        if hb.state == "unloading":  # on its way out: nothing to serve it with
            return
        self.tried.add(name)
        self.spawn(self._add(name, hb.model_dir))

    async def _add(self, name: str, model_dir: str) -> None:
        load = functools.partial(ServedModel.load, name, model_dir, max_n=self.max_n,
                                 tool_call_parser=self.tool_call_parser)
        try:
            model = await asyncio.get_running_loop().run_in_executor(self.executor, load)
        except Exception as e:  # any failure of one model's files must leave the gateway serving the others
            log.warning("model_dir_unusable", model=name, model_dir=model_dir, error=str(e))
            return
        self.catalogue.add(model)  # new: after start only this adds, once per name
        log.info("model_added", model=name, model_dir=model_dir, max_model_len=model.limits.max_model_len)
