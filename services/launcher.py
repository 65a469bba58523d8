"""`inferno up`: starts nats-server, the scheduler, the kvstore, the workers and the gateway as child
processes, each with its own GPUs (services/gpu_placement.py) and its log in the run dir
(services/children.py), restarts any that dies (services/supervisor.py), and stops them all cleanly
on Ctrl-C, or at once when one cannot start."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.bus import Bus, find_nats_server, is_nats, private  # noqa: F401 (find_nats_server: tests, bench)
from services.children import Child, LogEcho
from services.gpu_placement import NO_GPU, visible_gpus, worker_placement
from services.supervisor import Supervisor
from services.top import STACK_FILE, print_started
from shared.config import CONFIG_ERROR_EXIT



def free_port() -> int:
    """A port for a child to bind, picked below the kernel's ephemeral range: outgoing connections take
    their local ports from that range, and one took a port picked there before the kvstore could bind
    it (a full test run, 2026-11-29). A port nothing listens on now, else one the kernel gives."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PORTS.randrange(PICK_FROM, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PICK_FROM = 10000
_PORTS = random.SystemRandom()  # not the random module's state, which a caller may have seeded


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, PICK_FROM + 1000)


@dataclass
class StackConfig:
    model_dir: Path
    model_name: str = "inferno-demo"
    # Further models served beside the first by every mixed worker, on its GPU (services/worker/model_host.py)
    # and by the gateways: (directory, served name) each.
    more_models: tuple[tuple[Path, str], ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    nats_port: int = 4222
    # nats-servers in one cluster (routes on loopback, JetStream buckets replicated over up to 3):
    # one of them may die and the stack serves on. The first listens on nats_port.
    nats_cluster: int = 1
    nats_host: str = "127.0.0.1"  # the address the nats-servers listen on and the services connect to
    # A NATS user per service role, an admin and these API users, with random passwords
    # (shared/nats_auth.py): a client that reaches the bus may use the public API only.
    nats_auth: bool = True
    nats_api_users: tuple[str, ...] = ("api",)
    # TLS on the bus (shared/nats_tls.py): a CA and the servers' certificate made at each start into the
    # run directory; the services trust that CA only and dial tls:// URLs; the routes of a cluster too.
    nats_tls: bool = False
    api_server_count: int = 1  # gateway processes sharing the port (vLLM's --api-server-count)
    schedulers: int = 1  # replicas sharing the routing through a NATS queue group
    workers: int = 1  # mixed workers
    prefill_workers: int = 0
    decode_workers: int = 0
    kvstore_capacity_gb: float = 2.0  # 0: no cluster KV store
    device: str = "cpu"
    api_keys: tuple[str, ...] = ()
    run_dir: Path = Path(".inferno")
    emit_only: bool = False
    worker_args: tuple[str, ...] = ()
    # ... and to workers of one role only, after worker_args (so they win): e.g. a smaller step
    # budget for decode workers, whose own prefills would otherwise stretch their steps.
    prefill_worker_args: tuple[str, ...] = ()
    decode_worker_args: tuple[str, ...] = ()
    tensor_parallel_size: int = 1  # each worker is a group of tp × pp processes, one GPU each
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: the tensor-parallel GPUs hold whole experts
    gateway_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    log_format: str = "console"
    env: dict = field(default_factory=dict)


class Stack:
    """The processes of one stack; tests drive it through the same code as `inferno up`."""

    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        ports = [cfg.nats_port] + [free_port() for _ in range(cfg.nats_cluster - 1)]
        routes = [free_port() for _ in range(cfg.nats_cluster)] if cfg.nats_cluster > 1 else []
        self.bus = Bus(cfg.run_dir, cfg.nats_host, ports, routes, cfg.nats_auth, cfg.nats_api_users, cfg.nats_tls)
        self.nats_ports, self.nats_url, self.nats_tls = ports, self.bus.url, self.bus.tls
        self.credentials, self.admin_nats_url = self.bus.credentials, self.bus.admin_url
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.reported: set[str] = set()
        self.stopping = False  # set by stop(): a supervisor must not restart what is being stopped
        self._restart_lock = threading.Lock()  # a restart and stop() never interleave
        self._workers_started = 0
        self._gpus: list[str] | None = None  # the GPUs to hand out, read at the first GPU worker
        self.envs: dict[str, dict[str, str]] = {}  # each child's own environment (its GPUs), by name
        # The logs are the children's only output; in the console format they are echoed here too.
        self.echo = LogEcho(sys.stderr) if cfg.log_format == "console" else None

    def nats_url_of(self, user: str) -> str:
        return self.bus.url_of(user)

    def nats_tls_options(self) -> dict:
        return self.bus.tls_options()

    # -- process management ---------------------------------------------------------------------
    def _log(self, name: str) -> tuple[Path, int]:
        """The child's log and its size now: what follows is the run about to start."""
        path = self.cfg.run_dir / f"{name}.log"
        return path, path.stat().st_size if path.exists() else 0

    def _popen(self, name: str, argv: list[str]) -> subprocess.Popen:
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.cfg.env, **self.envs.get(name, NO_GPU),
               **self.bus.env_for(name)}
        with open(self.cfg.run_dir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _spawn(self, name: str, argv: list[str], critical: bool, env: dict[str, str] = NO_GPU) -> Child:
        """Start a child; `env`: what it sees on top of the launcher's environment (by default no GPU)."""
        self.envs[name] = env
        log, log_from = self._log(name)
        child = Child(name, self._popen(name, argv), critical, argv, log=log, log_from=log_from)
        self.children.append(child)
        if self.echo is not None:
            self.echo.follow(log, log_from)
        return child

    def start_process(self, name: str, argv: list[str], env: dict[str, str] = NO_GPU) -> Child:
        """A child of the stack's own (logged, stopped, restarted like the others) that the stack does
        not start itself: e.g. a worker on another host's network (tests/e2e/test_pd_two_hosts.py)."""
        return self._spawn(name, argv, critical=False, env=env)

    def restart(self, child: Child) -> None:
        """Start an exited child again with the same argv and GPUs: same name, worker id, port and device."""
        with self._restart_lock:
            if self.stopping:
                raise RuntimeError("the stack is stopping")
            if child.proc.poll() is None:
                raise RuntimeError(f"{child.name} is still running")
            child.log, child.log_from = self._log(child.name)
            child.proc = self._popen(child.name, child.argv)
            child.started = time.monotonic()
            self.reported.discard(child.name)
            self.write_pids()

    def _next_placement(self) -> tuple[str, dict[str, str]]:
        """The next worker's --device and environment: its own GPUs only (gpu_placement.py)."""
        if self._gpus is None and self.cfg.device.startswith("cuda"):
            self._gpus = visible_gpus()
        ranks = self.cfg.tensor_parallel_size * self.cfg.pipeline_parallel_size
        placed = worker_placement(self.cfg.device, self._workers_started, ranks, self._gpus or [])
        self._workers_started += 1
        return placed

    def _common(self) -> list[str]:
        return ["--nats-url", self.nats_url, "--log-format", self.cfg.log_format]

    def start_nats(self) -> list[Child]:
        return [self._spawn(name, argv, critical=critical) for name, argv, critical in self.bus.servers()]

    def start_scheduler(self, index: int = 0) -> Child:
        # With replicas none is critical: the others route while the supervisor restarts one.
        return self._spawn(f"scheduler-{index}", [sys.executable, "-m", "services.scheduler", *self._common(),
                                                  *self.cfg.scheduler_args], critical=self.cfg.schedulers == 1)

    def start_kvstore(self) -> Child:
        # It sees the GPUs (UCX moves the workers' GPU pages only where CUDA is) and makes no
        # context on them (kvstore/main.py).
        return self._spawn("kvstore", [sys.executable, "-m", "services.kvstore", *self._common(),
                                       "--capacity-gb", str(self.cfg.kvstore_capacity_gb),
                                       "--http-port", str(free_port())], critical=False, env={})

    def start_worker(self, index: int, role: str = "mixed") -> Child:
        name = f"worker-{index}" if role == "mixed" else f"{role}-{index}"
        device, env = self._next_placement()
        argv = [sys.executable, "-m", "services.worker", *self._common(), "--worker-id", name, "--role", role,
                *self._model_flags(all_models=role == "mixed"), "--device", device, *self.cfg.worker_args,
                *{"prefill": self.cfg.prefill_worker_args, "decode": self.cfg.decode_worker_args}.get(role, ())]
        if self.cfg.tensor_parallel_size * self.cfg.pipeline_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(self.cfg.tensor_parallel_size),
                     "--pipeline-parallel-size", str(self.cfg.pipeline_parallel_size)]
        if self.cfg.enable_expert_parallel:
            argv.append("--enable-expert-parallel")
        if self.cfg.emit_only:
            argv.append("--emit-only")
        return self._spawn(name, argv, critical=False, env=env)

    def _model_flags(self, all_models: bool = True) -> list[str]:
        models = [(self.cfg.model_dir, self.cfg.model_name), *(self.cfg.more_models if all_models else ())]
        return [flag for d, name in models for flag in ("--model-dir", str(d), "--model-name", name)]

    def start_gateways(self) -> list[Child]:
        """One gateway, or api_server_count of them on the one port (SO_REUSEPORT), each with its own
        NATS inbox; with several, none is critical: the others serve while the supervisor restarts one."""
        argv = [sys.executable, "-m", "services.gateway", *self._common(), "--host", self.cfg.host,
                "--port", str(self.cfg.port), *self._model_flags(), *self.cfg.gateway_args]
        for key in self.cfg.api_keys:
            argv += ["--api-key", key]
        count = self.cfg.api_server_count
        if count == 1:
            return [self._spawn("gateway", argv, critical=True)]
        return [self._spawn(f"gateway-{i}", [*argv, "--reuse-port"], critical=False) for i in range(count)]

    def start(self) -> "Stack":
        self.start_nats()
        tls = self.nats_tls_options().get("tls")
        for port in self.nats_ports:
            wait_for_port(port, timeout=15, host=self.cfg.nats_host, tls=tls)
        for i in range(self.cfg.schedulers):
            self.start_scheduler(i)
        if self.cfg.kvstore_capacity_gb > 0:
            self.start_kvstore()
        for i in range(self.cfg.workers):
            self.start_worker(i)
        for i in range(self.cfg.prefill_workers):
            self.start_worker(i, "prefill")
        for i in range(self.cfg.decode_workers):
            self.start_worker(i, "decode")
        self.start_gateways()
        self.write_pids()
        return self

    def write_pids(self) -> Path:
        path = self.cfg.run_dir / "pids.json"
        path.write_text(json.dumps({c.name: c.proc.pid for c in self.children if c.proc.poll() is None}))
        return path

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def wait_ready(self, timeout: float = 120.0, path: str = "/ready") -> None:
        """Until the gateway answers 200 on `path`: /ready needs a worker, /health only the gateway.
        RuntimeError, with the end of its log, as soon as a child exits that the stack cannot start
        without: a critical one, one with a configuration error (starting it again would fail
        again), or the last of the workers that /ready waits for."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.check_children()
            fatal = [c for c in dead if c.critical or c.proc.poll() == CONFIG_ERROR_EXIT]
            if dead and not fatal and path == "/ready" and self._workers_gone():
                fatal = dead
            if fatal:
                raise RuntimeError("\n".join(c.exit_report(" during start-up") for c in fatal))
            for c in dead:  # the stack can start without it (`inferno up` starts it again once up)
                print(f"inferno: {c.exit_report(' during start-up')}", file=sys.stderr, flush=True)
            try:
                headers = {"Authorization": f"Bearer {self.cfg.api_keys[0]}"} if self.cfg.api_keys else {}
                req = urllib.request.Request(self.url + path, headers=headers)
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the stack was not ready within {timeout:.0f} s (logs in {self.cfg.run_dir})")

    def _workers_gone(self) -> bool:
        """The stack has workers, and none of them is running."""
        workers = [c for c in self.children if is_worker(c.name)]
        return bool(workers) and all(c.proc.poll() is not None for c in workers)

    def check_children(self) -> list[Child]:
        """Children that exited since the last look, each once."""
        dead = [c for c in self.children if c.proc.poll() is not None and c.name not in self.reported]
        self.reported.update(c.name for c in dead)
        return dead

    def stop(self, timeout: float = 15.0) -> None:
        """Front to back: the gateway first, then workers (they drain), schedulers, NATS last."""
        with self._restart_lock:
            self.stopping = True
        for rank in range(4):
            members = [c for c in self.children if stop_rank(c.name) == rank]
            for c in members:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for c in members:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"inferno: {c.name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr)
                    c.proc.kill()
                    c.proc.wait()
                self.reported.add(c.name)
        if self.echo is not None:
            self.echo.stop()


def is_worker(name: str) -> bool:
    return name.startswith(("worker", "prefill", "decode"))


def stop_rank(name: str) -> int:
    if name == "gateway" or name.startswith("gateway-"):
        return 0
    if is_worker(name):
        return 1
    return 3 if is_nats(name) else 2


def wait_for_port(port: int, timeout: float, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
    """Until something listens on the port; with `tls`, until it also completes a TLS handshake (a
    nats-server that handshakes first logs a connection closed before one as an error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5) as sock:
                if tls is not None:
                    tls.wrap_socket(sock, server_hostname=host).close()
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def is_model_path(path: Path) -> bool:
    from shared.gguf_file import is_gguf

    return (path / "config.json").is_file() or is_gguf(path)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="inferno up", description="Run the whole Inferno stack.")
    ap.add_argument("--model", type=Path, action="append", default=None,
                    help="Hugging Face model directory or .gguf file (default: the SmolLM2-135M-Instruct demo); "
                         "repeated, every worker serves them all on its GPU, each in a share of its memory "
                         "(--memory-share), those that do not fit loaded at their first request")
    ap.add_argument("--random-demo", action="store_true",
                    help="serve the tiny random-weight demo model instead of SmolLM2 (no download)")
    ap.add_argument("--model-name", action="append", default=None,
                    help="the id clients use (default: the directory's name); repeated, each --model's in order")
    ap.add_argument("--memory-share", action="append", default=None,
                    help="several models: each one's fraction of the GPU, in the --model order (default: "
                         "an equal split)")
    ap.add_argument("--host-memory-gb", type=float, default=None,
                    help="pinned host memory that keeps evicted models' weights for a fast way back")
    ap.add_argument("--model-idle-timeout", type=float, default=None,
                    help="seconds idle after which a model leaves the GPU; its next request brings it back")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--nats-port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--nats-cluster", type=int, default=1,
                    help="run this many nats-servers as one cluster on loopback (the first on --nats-port): "
                         "every service is given all of them and moves to another when its server dies; "
                         "JetStream buckets are replicated over up to three")
    ap.add_argument("--nats-auth", action=argparse.BooleanOptionalAction, default=True,
                    help="a NATS user per service role, an admin and API users, random passwords in the run "
                         "directory (default): a client of the bus may use the public API only; "
                         "--no-nats-auth: no users (a bus on loopback only)")
    ap.add_argument("--nats-tls", action=argparse.BooleanOptionalAction, default=False,
                    help="TLS on the bus: a CA and the servers' certificate made at each start into the run "
                         "directory's nats-tls/ (the CA's key is not kept), tls:// URLs, the CA given to every "
                         "service; a cluster's routes too (default off: the stack's bus listens on loopback)")
    ap.add_argument("--nats-api-user", action="append", default=None, metavar="NAME",
                    help="a NATS API user (repeatable; default one, 'api'): publishes to {prefix}.api.> only and "
                         "reads only its inboxes, _INBOX.NAME.>; its URL with the password: the run "
                         "directory's nats-api-NAME.url")
    ap.add_argument("--schedulers", type=int, default=1,
                    help="scheduler replicas (a NATS queue group shares the routing; session affinity is "
                         "in JetStream): one may die while the others route")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="gateway processes on the one --port (SO_REUSEPORT; vLLM's flag): the API's CPU "
                         "spread over cores, and one may die while the others serve")
    ap.add_argument("--workers", type=int, default=None,
                    help="mixed workers, prefill and decode in one (default 1, or 0 with prefill/decode workers)")
    ap.add_argument("--prefill-workers", type=int, default=0,
                    help="prefill workers: they run prompts and hand the KV to a decode worker (UCXX)")
    ap.add_argument("--decode-workers", type=int, default=0,
                    help="decode workers (they also prefill prompts too short to be worth a hand-off)")
    ap.add_argument("--disagg-max-prefill-queue-tokens", type=int, default=None,
                    help="the scheduler's queue bound for a remote prefill (default: its own, 4096; 0: none)")
    ap.add_argument("--disagg-by-time", action=argparse.BooleanOptionalAction, default=None,
                    help="the scheduler weighs a remote prefill against the decode worker's own by time "
                         "(default: its own, off; on where hand-offs cross a slow link)")
    ap.add_argument("--kvstore-capacity-gb", type=float, default=None,
                    help="host memory of the cluster KV store (prefix reuse across workers); 0: none "
                         "(default: 2 with two or more workers, none with one)")
    ap.add_argument("--disagg-min-prefill-tokens", type=int, default=None,
                    help="the scheduler's threshold for a remote prefill (default: its own, 256)")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda: the workers spread over the visible GPUs, one each in turn (prefill "
                         "workers first, then decode); cuda:N puts them all on GPU N")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="split each worker's model over this many GPUs (tensor parallelism)")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                    help="split each worker's layers into this many stages (pipeline parallelism)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="mixture-of-experts models: spread whole experts over each worker's tensor-parallel "
                         "GPUs instead of splitting every expert over them")
    ap.add_argument("--api-key", action="append", default=[], help="require this bearer key (repeatable)")
    ap.add_argument("--api-keys-file", type=Path, default=None,
                    help="tenants, their limits and keys (JSON or YAML; see the README), for the gateway")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the gateway's streamed tokens per server-sent event (default 1; see inferno gateway)")
    ap.add_argument("--max-queue-seconds", type=float, default=None,
                    help="the scheduler's load shedding: 429 when the estimated wait for a first token "
                         "passes this (default: off)")
    ap.add_argument("--run-dir", type=Path, default=Path(".inferno"), help="logs, pids.json, JetStream store")
    ap.add_argument("--log-format", choices=["console", "json"], default="console")
    ap.add_argument("--emit-only", action="store_true", help="model-free token emitter (overhead benchmark only)")
    ap.add_argument("--worker-arg", action="append", default=[], help="extra flag passed to each worker")
    ap.add_argument("--prefill-worker-arg", action="append", default=[],
                    help="extra flag passed to prefill workers only (after --worker-arg)")
    ap.add_argument("--decode-worker-arg", action="append", default=[],
                    help="extra flag passed to decode workers only (after --worker-arg), e.g. "
                         "--decode-worker-arg='--max-num-batched-tokens 512'")
    args = ap.parse_args(_glue_worker_args(sys.argv[1:] if argv is None else list(argv)))
    for flag in ("nats_cluster", "api_server_count", "schedulers"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


WORKER_ARG_FLAGS = ("--worker-arg", "--prefill-worker-arg", "--decode-worker-arg")


def _glue_worker_args(argv: list[str]) -> list[str]:
    """`--worker-arg --flag=value` as `--worker-arg=--flag=value`: argparse takes a value that starts
    with a dash for another option and refuses the call, and a worker flag always starts with one."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in WORKER_ARG_FLAGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _split(extras: list[str]) -> tuple[str, ...]:
    """Repeated --worker-arg values, each split on spaces: one flag with its value may come as one."""
    return tuple(a for extra in extras for a in extra.split())


def mixed_workers(args) -> int:
    """--workers, or 1 unless prefill/decode workers were asked for."""
    return args.workers if args.workers is not None else int(not (args.prefill_workers or args.decode_workers))


def kvstore_capacity(args) -> float:
    """A kvstore pays only when a prefix can be reused on another worker."""
    if args.kvstore_capacity_gb is not None:
        return args.kvstore_capacity_gb
    return 2.0 if mixed_workers(args) + args.prefill_workers + args.decode_workers >= 2 else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from services.packaged_models import ensure_demo_model

    model_dirs = args.model or [ensure_demo_model(args.random_demo)]
    for model_dir in model_dirs:
        if not is_model_path(model_dir):
            print(f"inferno: {model_dir} is neither a model directory (no config.json) nor a GGUF file",
                  file=sys.stderr)
            return 2
    names = args.model_name or []
    if len(names) > len(model_dirs):
        print("inferno: more --model-name than --model", file=sys.stderr)
        return 2
    served = [(d.resolve(), names[i] if i < len(names) else
               ("inferno-demo" if args.model is None else d.name.removesuffix(".gguf"))) for i, d in enumerate(model_dirs)]
    if len({name for _, name in served}) < len(served):
        print("inferno: two models would be served under one name: give --model-name for each", file=sys.stderr)
        return 2
    worker_args = list(_split(args.worker_arg))
    for share in args.memory_share or []:
        worker_args += ["--memory-share", share]
    if args.host_memory_gb is not None:
        worker_args += ["--host-memory-gb", str(args.host_memory_gb)]
    if args.model_idle_timeout is not None:
        worker_args += ["--model-idle-timeout", str(args.model_idle_timeout)]
    api_keys = tuple(args.api_key) or tuple(k for k in os.environ.get("INFERNO_API_KEYS", "").split(",") if k)
    scheduler_args: list[str] = []
    if args.disagg_min_prefill_tokens is not None:
        scheduler_args += ["--disagg-min-prefill-tokens", str(args.disagg_min_prefill_tokens)]
    if args.disagg_max_prefill_queue_tokens is not None:
        scheduler_args += ["--disagg-max-prefill-queue-tokens", str(args.disagg_max_prefill_queue_tokens)]
    if args.disagg_by_time is not None:
        scheduler_args += ["--disagg-by-time" if args.disagg_by_time else "--no-disagg-by-time"]
    if args.max_queue_seconds is not None:
        scheduler_args += ["--max-queue-seconds", str(args.max_queue_seconds)]
    gateway_args = ["--api-keys-file", str(args.api_keys_file)] if args.api_keys_file else []
    if args.stream_interval != 1:
        gateway_args += ["--stream-interval", str(args.stream_interval)]
    cfg = StackConfig(
        model_dir=served[0][0], model_name=served[0][1], more_models=tuple(served[1:]),
        host=args.host, port=args.port, nats_port=args.nats_port or free_port(), nats_cluster=args.nats_cluster,
        nats_auth=args.nats_auth, nats_api_users=tuple(args.nats_api_user or ("api",)), nats_tls=args.nats_tls,
        api_server_count=args.api_server_count, schedulers=args.schedulers,
        workers=mixed_workers(args),
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        kvstore_capacity_gb=kvstore_capacity(args), scheduler_args=tuple(scheduler_args),
        gateway_args=tuple(gateway_args),
        device=args.device, api_keys=api_keys, run_dir=args.run_dir, emit_only=args.emit_only,
        worker_args=tuple(worker_args), prefill_worker_args=_split(args.prefill_worker_arg),
        decode_worker_args=_split(args.decode_worker_arg), log_format=args.log_format,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel)
    stack = Stack(cfg)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
        # With --workers 0 no worker of ours will make /ready answer: the control plane is up
        # once the gateway is, and waits for workers started elsewhere.
        own_workers = cfg.workers + cfg.prefill_workers + cfg.decode_workers
        stack.wait_ready(path="/ready" if own_workers else "/health")
        # The admin's URL (inferno top reads it): the file is this user's only.
        tls = {"nats_tls_ca": stack.nats_tls.ca_file} if stack.nats_tls else {}
        private(cfg.run_dir / STACK_FILE, json.dumps({"url": stack.url, "nats": stack.admin_nats_url,
                                                      "metrics": stack.url + "/metrics", **tls}))
        print_started(stack, own_workers)  # (services/top.py)
        print(f"\ninferno: serving {', '.join(repr(name) for _, name in served)} at {stack.url}/v1  (Ctrl-C stops)\n"
              f"  curl {stack.url}/v1/models\n  inferno top --run-dir {cfg.run_dir}   (a live view)\n", flush=True)
        # Any child that dies is started again (the gateway answers 503 meanwhile), but one that
        # exits with a configuration error; with --workers 0 the control plane waits for workers
        # started elsewhere.
        supervisor = Supervisor(stack)
        while not stopping:
            supervisor.poll()
            if any(stack.child(name).critical for name in supervisor.failed):
                raise RuntimeError("a child the stack needs cannot start again (see above)")
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"inferno: {e}", file=sys.stderr)
        return 1
    finally:
        print("inferno: stopping…", file=sys.stderr, flush=True)
        stack.stop()
