"""Configuration of each service as frozen dataclasses, validated on construction.

Flags and environment variables are read only in a service's entry point; `env_default` and the
parse_* helpers are for those entry points, never for code deeper down.
"""

from __future__ import annotations

import argparse
import math
import os
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Callable, TypeVar

from shared.sampling_params import MAX_N
from shared.subjects import DEFAULT_PREFIX, check_id, check_prefix

T = TypeVar("T")

# A service's exit status when its flags (or the model they name) cannot work, as argparse's for bad
# flags: starting it again would fail again, so the launcher stops instead of restarting it.
CONFIG_ERROR_EXIT = 2

WORKER_ROLES = ("mixed", "prefill", "decode")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def _fail(cls: object, name: str, message: str) -> None:
    raise ValueError(f"{type(cls).__name__}.{name}: {message}")


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            _fail(cfg, name, f"must be a positive number, got {v!r}")


def _non_negative(cfg: object, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            _fail(cfg, name, f"must be a non-negative number, got {v!r}")


def _ints(cfg: object, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            _fail(cfg, name, f"must be an int, got {v!r}")


def _id(cfg: object, name: str) -> None:
    try:
        check_id(name, getattr(cfg, name))
    except ValueError as e:
        _fail(cfg, name, str(e))


def _new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsConfig:
    url: str = "nats://127.0.0.1:4222"  # several servers: comma-separated
    subject_prefix: str = DEFAULT_PREFIX
    connect_timeout: float = 2.0  # one TCP + handshake attempt
    request_timeout: float = 5.0  # default deadline of a request/reply
    reconnect_time_wait: float = 0.5  # pause between reconnect attempts, plus jitter
    reconnect_jitter: float = 0.5  # up to this many seconds added at random to each pause
    ping_interval: float = 10.0  # detects a silently dead server in about 2 intervals
    drain_timeout: float = 5.0
    # The service's NATS user (shared/nats_auth.py), from its environment: a password in argv is
    # what `ps` shows every user of the host. Empty: a server without authorization.
    user: str = field(default_factory=lambda: os.environ.get("INFERNO_NATS_USER", ""))
    password: str = field(default_factory=lambda: os.environ.get("INFERNO_NATS_PASSWORD", ""), repr=False)
    # TLS on the bus (shared/nats_tls.py): the CA that signed the servers' certificate (with none, a
    # tls:// URL trusts the system's CAs); this client's certificate and key, for servers that verify
    # their clients (mutual TLS). A CA, a certificate or a tls:// URL turns TLS on.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # The TLS handshake before the server's first line (its handshake_first), so that no one on the
    # path can strip TLS off that plaintext line; off for a server without handshake_first.
    tls_first: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            _fail(self, "url", "must not be empty")
        for part in self.url.split(","):
            if "://" not in part.strip():
                _fail(self, "url", f"{part.strip()!r} needs a scheme, e.g. nats://host:4222")
        if bool(self.tls_cert) != bool(self.tls_key):
            _fail(self, "tls_cert", "a client certificate needs its key (tls_key), and a key its certificate")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):  # a service started without it would retry forever
                _fail(self, name, f"{path!r} is not a file")
        try:
            check_prefix(self.subject_prefix)
        except ValueError as e:
            _fail(self, "subject_prefix", str(e))
        _positive(self, "connect_timeout", "request_timeout", "ping_interval", "drain_timeout")
        _non_negative(self, "reconnect_time_wait", "reconnect_jitter")

    @property
    def servers(self) -> list[str]:
        return [part.strip() for part in self.url.split(",")]

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert) or any(s.startswith("tls://") for s in self.servers)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    model_name: str  # the id clients send as "model" and /v1/models lists (the default model)
    model_dir: str  # tokenizer.json, tokenizer_config.json (chat template), config.json
    # (name, dir) of the models served besides model_name's, in the order given (`models` has them all).
    more_models: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False  # share the port with other gateway processes (SO_REUSEPORT)
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # /metrics's own bearer token (a Prometheus scrape then needs no tenant key); empty: /metrics
    # is behind the API keys as the API is.
    metrics_token: str = field(default="", repr=False)
    max_body_bytes: int = 4 << 20
    max_n: int = MAX_N
    max_tokens_default: int | None = None  # None: the rest of the context window
    request_timeout: float = 600.0  # whole request, first byte to last token
    first_token_timeout: float = 120.0  # routing + queueing + prefill
    share_prefix_cache: bool = False  # with a keys file: tenants share prefix-cache blocks
    log_requests: bool = False  # one info line per finished request (off by default, as vLLM's)
    heartbeat_ttl: float = 3.0  # a worker unheard for this long is gone: its requests move or fail
    heartbeat_interval: float = 1.0  # this gateway's beats to the workers (they end a silent one's requests)
    stream_interval: int = 1  # streamed tokens per SSE event (SGLang's --stream-interval): fewer writes
    tool_call_parser: str = "auto"  # the served model's tool-call syntax (services/gateway/tool_calls.py)
    gateway_id: str = field(default_factory=lambda: _new_id("gw"))

    def __post_init__(self) -> None:
        if not self.model_name:
            _fail(self, "model_name", "must not be empty")
        if not self.model_dir:
            _fail(self, "model_dir", "must not be empty")
        self._check_more_models()
        if not self.host:
            _fail(self, "host", "must not be empty")
        _ints(self, "port", "max_body_bytes", "max_n", "max_tokens_default", "stream_interval")
        if not 0 <= self.port <= 65535:
            _fail(self, "port", f"must be in [0, 65535], got {self.port}")
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k for k in self.api_keys):
            _fail(self, "api_keys", "must be a tuple of non-empty strings")
        _positive(self, "max_body_bytes", "max_n", "request_timeout", "first_token_timeout", "heartbeat_ttl",
                  "heartbeat_interval", "stream_interval")
        if self.max_n > MAX_N:
            _fail(self, "max_n", f"must be at most {MAX_N}")
        if self.max_tokens_default is not None:
            _positive(self, "max_tokens_default")
        _id(self, "gateway_id")

    @property
    def models(self) -> tuple[tuple[str, str], ...]:
        """(name, dir) of every served model, the default (model_name's) first."""
        return ((self.model_name, self.model_dir), *self.more_models)

    def _check_more_models(self) -> None:
        if not isinstance(self.more_models, tuple):
            _fail(self, "more_models", "must be a tuple of (name, dir) pairs")
        seen = {self.model_name}
        for pair in self.more_models:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) and x for x in pair)):
                _fail(self, "more_models", f"each must be a (name, dir) pair of non-empty strings, got {pair!r}")
            if pair[0] in seen:  # a request could not say which of the two it means
                _fail(self, "more_models", f"the model name {pair[0]!r} is served twice: give each model "
                                           "a --model-name of its own")
            seen.add(pair[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """The scheduler's routing and admission settings."""

    heartbeat_ttl: float = 3.0  # a worker is gone after 3 missed 1 s heartbeats
    max_waiting: int = 4096  # per worker; beyond it, new requests get 429
    overload_kv_usage: float = 0.95  # a worker above this KV usage takes no new request
    retry_after: float = 1.0  # seconds, sent with 429/503
    forward_timeout: float = 2.0  # a worker must acknowledge a forwarded request within this
    affinity_bucket: str = "inferno_affinity"  # JetStream KV bucket: session key → worker id
    affinity_ttl: float = 3600.0
    # Prefill/decode disaggregation is conditional: a prompt with fewer uncached tokens than this
    # is prefilled by its decode worker itself (a remote prefill would cost more than it saves).
    disagg_min_prefill_tokens: int = 256
    # ... and one is prefilled by its decode worker too when the least loaded prefill worker has
    # more tokens than this still queued (0: no bound), as Dynamo's max prefill queue does. With the
    # decode role's 512-token prefill chunks, 4,096 put 1P+1D at 0.95 x the TTFT p99 and 0.35 x the ITL
    # p99 of 2 mixed workers (10 long prompts a second, H100s, 2026-11-27); no bound 1.79 x / 0.22 x.
    disagg_max_prefill_queue_tokens: int = 4096
    # ... and, with this, when its own prefill promises the first token twice as soon, from both sides'
    # queues, reported prompt rates and the recent hand-off time (services/scheduler/disagg.py). Off by
    # default: over CUDA IPC it raised the TTFT p99 (252 against 187 ms, two H200s); over TCP it
    # turned 13 timed-out requests of 100 into none.
    disagg_by_time: bool = False
    # Load shedding: a request whose estimated wait in every worker's queue passes this many seconds
    # gets 429 at once (0: no bound). The estimate divides queued prompt tokens by each worker's drain
    # rate, learnt from its heartbeats and starting at admission_tokens_per_second.
    max_queue_seconds: float = 0.0
    admission_tokens_per_second: float = 4096.0
    scheduler_id: str = field(default_factory=lambda: _new_id("sched"))

    def __post_init__(self) -> None:
        _positive(self, "heartbeat_ttl", "max_waiting", "affinity_ttl", "forward_timeout",
                  "admission_tokens_per_second")
        _non_negative(self, "max_queue_seconds")
        _ints(self, "max_waiting", "disagg_min_prefill_tokens", "disagg_max_prefill_queue_tokens")
        _non_negative(self, "disagg_min_prefill_tokens", "disagg_max_prefill_queue_tokens")
        _non_negative(self, "retry_after")
        if not 0.0 < self.overload_kv_usage <= 1.0:
            _fail(self, "overload_kv_usage", f"must be in (0, 1], got {self.overload_kv_usage}")
        _id(self, "affinity_bucket")
        _id(self, "scheduler_id")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerServiceConfig:
    worker_id: str = field(default_factory=lambda: _new_id("worker"))
    role: str = "mixed"  # "mixed" | "prefill" | "decode"
    model_dir: str = ""  # the model loaded at start; "" = none until told over the admin subject
    model_name: str = ""  # defaults to the directory's name in the entry point
    device: str = "cuda"  # "cuda", "cuda:1", "cpu"
    dtype: str = "auto"
    quantization: str | None = None  # "fp8": e4m3 projections, activations quantized per token
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": half the bytes per token
    num_blocks: int | None = None  # KV blocks; None: from gpu_memory_utilization (GPU) or a default (CPU)
    gpu_memory_utilization: float = 0.98
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Most prompt tokens a step (SGLang's --chunked-prefill-size); None: 512 for the decode role (its
    # local prefills must not stretch its decode steps), else the step budget; 0: the step budget.
    chunked_prefill_size: int | None = None
    max_model_len: int | None = None  # None: the model's own limit
    heartbeat_interval: float = 1.0
    drain_timeout: float = 30.0
    gateway_ttl: float = 15.0  # a gateway silent this long: its requests here end (services/worker/gateway_watch.py)
    emit_only: bool = False  # model-free token emitter, only to measure serving overhead
    emit_step_seconds: float = 0.0  # the emitter's step time (0: as fast as it can)
    # Where a decode worker's UCXX listener takes KV pages: an address prefill workers can reach.
    transfer_host: str = "127.0.0.1"
    handoff_timeout: float = 10.0  # an offer's pages must arrive (and a push finish) within this
    grammar_compile_timeout: float = 10.0  # a structured output's grammar compiles within this, or the request fails
    jump_forward: int = 0  # forced grammar tokens checked per forward (engine_config.EngineConfig.jump_forward)
    speculative_config: str = ""  # --speculative-config's JSON (services/worker/engine/speculative.py); "": off
    # Decode role on a GPU: prefill workers of this host write the pages into its receive slots over
    # CUDA IPC (else it copies them out of theirs).
    handoff_push: bool = True
    # Hand-offs between GPU workers of one host over CUDA IPC (push or pull); False: the pages go as
    # bytes over UCXX as between hosts (UCX_TLS then picks the transport: how a cross-host link is bounded).
    handoff_ipc: bool = True
    # Hand-off pages through pinned host memory where UCX would move GPU memory over TCP
    # (services/worker/host_staging.py): "auto", "host" (always), "off".
    handoff_staging: str = "auto"
    # The Triton kernel variants this worker compiles, recorded (services/worker/kernel_manifest.py):
    # replayed in parallel processes at start when the file exists, written once the worker settles.
    kernel_manifest: str = ""
    kvstore: str = "auto"  # "auto": use the cluster store when it pays (GPU: fetch only); "on": write back all; "off"
    load_format: str = "auto"  # "dummy": random weights drawn on the device (shape benchmarks)
    tensor_parallel_size: int = 1  # processes (GPUs) each layer is split over; one worker to the cluster
    pipeline_parallel_size: int = 1  # stages the layers are split into
    enable_expert_parallel: bool = False  # MoE models: whole experts spread over the tensor-parallel GPUs
    custom_all_reduce: bool = True  # small tensor-parallel all-reduces over peer memory (GPUs)
    fused_all_reduce_norm: bool = True  # ... with the residual add and RMSNorm in the same kernel
    # Several models on one GPU (services/worker/model_host.py): this model's fraction of the device
    # (0: all of gpu_memory_utilization); pinned host memory kept for evicted models' weights (GB; 0:
    # an evicted model is read from disk again); seconds idle after which a model leaves the GPU (0: never).
    memory_share: float = 0.0
    host_memory_gb: float = 0.0
    model_idle_timeout: float = 0.0

    def __post_init__(self) -> None:
        _id(self, "worker_id")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        _ints(self, "tensor_parallel_size", "pipeline_parallel_size")
        _positive(self, "tensor_parallel_size", "pipeline_parallel_size")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1 and self.role != "mixed":
            _fail(self, "role", "prefill and decode workers move whole KV pages, which a worker split over "
                                "several processes does not hold yet: use role mixed with tensor/pipeline parallelism")
        _positive(self, "handoff_timeout", "grammar_compile_timeout")
        if not isinstance(self.jump_forward, int) or not 0 <= self.jump_forward <= 64:
            _fail(self, "jump_forward", f"must be an int in [0, 64], got {self.jump_forward!r}")
        if self.load_format not in ("auto", "dummy"):
            _fail(self, "load_format", f"must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kvstore not in ("auto", "on", "off"):
            _fail(self, "kvstore", f"must be 'auto', 'on' or 'off', got {self.kvstore!r}")
        if self.handoff_staging not in ("auto", "host", "off"):
            _fail(self, "handoff_staging", f"must be auto, host or off, got {self.handoff_staging!r}")
        if self.role not in WORKER_ROLES:
            _fail(self, "role", f"must be one of {WORKER_ROLES}, got {self.role!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            _fail(self, "device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            _fail(self, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 <= self.memory_share < 1.0:
            _fail(self, "memory_share", f"must be in [0, 1), got {self.memory_share}")
        if self.host_memory_gb < 0 or self.model_idle_timeout < 0:
            _fail(self, "host_memory_gb", "host_memory_gb and model_idle_timeout must not be negative")
        _ints(self, "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        _positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "heartbeat_interval",
                  "drain_timeout", "gateway_ttl")
        _non_negative(self, "emit_step_seconds")
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.chunked_prefill_size is not None:
            _ints(self, "chunked_prefill_size")
            _non_negative(self, "chunked_prefill_size")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            _fail(self, "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")


# ---------------------------------------------------------------------------------------------
# For entry points only.

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def parse_csv(text: str) -> tuple[str, ...]:
    """"a, b,,c" → ("a", "b", "c")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def env_default(name: str, default: T, cast: Callable[[str], Any] | None = None) -> T:
    """The environment variable `name` converted with `cast`, or `default` when unset.

    `cast` defaults to the default's type (bool → parse_bool, tuple → parse_csv). A value that does
    not convert raises ValueError naming the variable.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    if cast is None:
        if isinstance(default, bool):
            cast = parse_bool
        elif isinstance(default, tuple):
            cast = parse_csv
        elif default is None:
            cast = str
        else:
            cast = type(default)
    try:
        return cast(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"environment variable {name}={raw!r}: {e}") from None


def config_fields(cls: type) -> list[str]:
    """Field names of a config class (for entry points that map flags onto it)."""
    return [f.name for f in fields(cls)]


def add_nats_tls_flags(ap: argparse.ArgumentParser) -> None:
    """The bus's TLS flags (NatsConfig's tls_*), each defaulting to its INFERNO_NATS_TLS_* variable."""
    ap.add_argument("--nats-tls-ca", default=env_default("INFERNO_NATS_TLS_CA", ""), metavar="FILE",
                    help="the CA that signed the NATS servers' certificate: TLS on the bus (env INFERNO_NATS_TLS_CA)")
    ap.add_argument("--nats-tls-cert", default=env_default("INFERNO_NATS_TLS_CERT", ""), metavar="FILE",
                    help="this client's certificate, for servers that verify clients (env INFERNO_NATS_TLS_CERT)")
    ap.add_argument("--nats-tls-key", default=env_default("INFERNO_NATS_TLS_KEY", ""), metavar="FILE",
                    help="its private key (env INFERNO_NATS_TLS_KEY)")
    ap.add_argument("--nats-tls-first", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_NATS_TLS_FIRST", True),
                    help="start TLS before the server's first line (its handshake_first; default); "
                         "--no-nats-tls-first for a server without it (env INFERNO_NATS_TLS_FIRST)")


def nats_tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    """NatsConfig's TLS fields from the flags add_nats_tls_flags made."""
    return dict(tls_ca=args.nats_tls_ca, tls_cert=args.nats_tls_cert, tls_key=args.nats_tls_key,
                tls_first=args.nats_tls_first)
