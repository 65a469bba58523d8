"""A worker's admin messages: load, replace or unload its model, and what it serves (codec: shared/wire.py).

One request class per verb (`{p}.worker.{id}.admin.load|unload|status`, shared/subjects.py), one
reply class for all three. A load is answered when the model is ready to serve, or with the error
that stopped it; `state` and `model` always say what the worker serves after the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import MessageError
from shared.wire import Message, register

# What a worker holds, as its heartbeats and admin replies say: no model; one being loaded (it
# takes no request); one serving; one being unloaded (its in-flight requests drain, no new ones);
# one registered but not on the GPU (a worker holding several models evicted it, or it went idle):
# its requests wait in that worker's queue while it is loaded again (services/worker/model_host.py).
MODEL_STATES = ("no_model", "loading", "ready", "unloading", "standby")
# What a load or unload does to the requests of the model in place: let them finish (up to
# drain_timeout, then abort the rest), or abort them at once. Aborted requests end with an error.
FINISH_MODES = ("drain", "abort")
# A load's modes: replace the model in place (finishing its requests as above), or "add" the model
# beside those the worker holds (a model slot of its own: services/worker/model_host.py).
LOAD_MODES = FINISH_MODES + ("add",)
# Reply codes. "bad_request": the request or the model it names is unusable (the worker keeps what
# it had); "busy": another load or unload is under way; "load_failed": loading failed after the old
# model was freed (the worker has no model now); "internal": anything else.
ADMIN_ERROR_CODES = ("bad_request", "busy", "load_failed", "internal")
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 256


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise MessageError(message)


def _check_finish(mode: str, drain_timeout: float) -> None:
    _require(mode in FINISH_MODES, f"mode must be one of {FINISH_MODES}")
    _require(math.isfinite(drain_timeout) and drain_timeout >= 0.0, "drain_timeout must be a finite number >= 0")


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class LoadModelRequest(Message):
    """Load a model (replacing the one in place, if any); the reply comes once it serves."""

    TYPE = "load_model_request"
    VERSION = 1

    model_dir: str  # a Hugging Face directory or a .gguf file, on the worker's file system
    model_name: str = ""  # the served id; "" = the directory's name (a .gguf file's, less .gguf)
    dtype: str = ""  # "" = the worker's --dtype
    max_model_len: int = 0  # 0 = the worker's --max-model-len, else the model's own
    load_format: str = ""  # "" = the worker's --load-format
    mode: str = "drain"  # the requests of the model in place: "drain" or "abort"; or "add" it beside them
    drain_timeout: float = 30.0  # seconds, with mode "drain"
    memory_share: float = 0.0  # mode "add": the GPU's fraction this model may hold (0: the worker's default)

    def _check(self) -> None:
        _require(0 < len(self.model_dir) <= MAX_PATH_CHARS, f"model_dir must be 1-{MAX_PATH_CHARS} characters")
        _require(len(self.model_name) <= MAX_NAME_CHARS, f"model_name must be at most {MAX_NAME_CHARS} characters")
        _require(self.dtype in ("", "auto", "float32", "float16", "bfloat16"), "dtype must be auto, float32, "
                                                                                 "float16 or bfloat16")
        _require(self.load_format in ("", "auto", "dummy"), "load_format must be auto or dummy")
        _require(self.max_model_len >= 0, "max_model_len must not be negative")
        _require(math.isfinite(self.memory_share) and 0.0 <= self.memory_share < 1.0,
                 "memory_share must be in [0, 1)")
        _require(self.mode in LOAD_MODES, f"mode must be one of {LOAD_MODES}")
        _check_finish("drain" if self.mode == "add" else self.mode, self.drain_timeout)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class UnloadModelRequest(Message):
    """Stop serving the model and free its memory; the worker stays up with no model."""

    TYPE = "unload_model_request"
    VERSION = 1

    mode: str = "drain"
    drain_timeout: float = 30.0

    def _check(self) -> None:
        _check_finish(self.mode, self.drain_timeout)


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class WorkerStatusRequest(Message):
    """What the worker serves now (answered at once, also while it loads)."""

    TYPE = "worker_status_request"
    VERSION = 1


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class LoadBreakdown(Message):
    """Where a load's time went, in seconds from its start: the load request's arrival, or the
    process's start for the model of --model-dir (then `imports_s` is the interpreter and imports)."""

    TYPE = "load_breakdown"
    VERSION = 1

    imports_s: float = 0.0  # process start → torch and the engine imported (start-up loads only)
    device_s: float = 0.0  # CUDA context, cuBLAS, pinned staging (start-up loads only)
    unload_s: float = 0.0  # the model in place: its requests finished, its memory freed
    weights_s: float = 0.0  # weights read and copied to the device
    weights_gb: float = 0.0
    kv_s: float = 0.0  # KV pool: sized from memory and allocated, or reused
    kv_reused: bool = False
    graphs_s: float = 0.0  # CUDA graphs captured before ready
    graphs_deferred: int = 0  # graphs left to capture after ready, on the step thread
    ready_s: float = 0.0  # from the start to serving


@register
@dataclass(slots=True, frozen=True, kw_only=True)
class WorkerAdminReply(Message):
    """The answer to every admin request: what the worker serves after it, and any error."""

    TYPE = "worker_admin_reply"
    VERSION = 1

    ok: bool
    worker_id: str
    state: str  # one of MODEL_STATES
    model: str = ""  # the served id ("" with no model)
    model_dir: str = ""
    warm: bool = False  # torch, the device and the kernels are initialised: a load pays none of it
    code: str = ""  # "" when ok, else one of ADMIN_ERROR_CODES
    error: str = ""
    load: LoadBreakdown | None = None  # a load's reply: where its time went

    def _check(self) -> None:
        _require(self.state in MODEL_STATES, f"state must be one of {MODEL_STATES}")
        if self.ok:
            _require(not self.code and not self.error, "an ok reply carries no error")
        else:
            _require(self.code in ADMIN_ERROR_CODES, f"code must be one of {ADMIN_ERROR_CODES}")
