"""Triton compiles in the worker, counted and timed. A compile while the worker serves is a step that
waited for the compiler (0.1 to several seconds) and the CPU it burnt: the warm-up missed that kernel
variant, so each one is a warning that names the kernel and its launch signature. Before that (the
load, the warm-up, the graphs captured after ready) compiles are expected and pass unremarked.

Triton calls the hooks on a miss of its in-memory cache only (a compile, or a load from its disk
cache), never on a launch, so the watch costs nothing per step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from services.worker import kernel_manifest

log = structlog.get_logger("worker.compile")


class CompileWatch:
    """Installed once per process (Triton's hooks are global); `serving` says when a compile is late."""

    def __init__(self, serving: Callable[[], bool]) -> None:
        self.serving = serving
        self.late = 0  # compiles (or disk-cache loads) while serving
        self.late_seconds = 0.0
        self._started: dict[int, float] = {}

    def install(self) -> bool:
        """Hook Triton's compiles; False where Triton is missing or has no hooks (nothing is watched)."""
        try:
            from triton import knobs
            runtime = knobs.runtime
            runtime.jit_cache_hook = self._before
            runtime.jit_post_compile_hook = self._after
        except (ImportError, AttributeError):
            return False
        return True

    def _before(self, *args, **kwargs) -> bool:
        self._started[threading.get_ident()] = time.perf_counter()
        kernel_manifest.note(kwargs.get("fn"), kwargs.get("compile"))  # what a later start compiles ahead
        return False  # False: compile (True would skip the kernel)

    def _after(self, *args, **kwargs) -> None:
        t0 = self._started.pop(threading.get_ident(), None)
        seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        if not self.serving():
            return
        self.late += 1
        self.late_seconds += seconds
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", "?")
        log.warning("kernel compiled while serving", kernel=name, seconds=round(seconds, 3),
                    thread=threading.current_thread().name, signature=str(kwargs.get("repr", ""))[:400],
                    late_total=self.late)
