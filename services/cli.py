"""The `inferno` command: one entry point that dispatches to each tool and service."""

from __future__ import annotations

import sys

USAGE = """usage: inferno COMMAND [ARGS]

commands:
  up            run the whole stack (nats-server, scheduler, workers, gateway) in one command
  top           a live view of a running stack: workers, their load and rates, the gateway
  gateway       run the HTTP gateway alone        (same as: python -m services.gateway)
  scheduler     run the scheduler alone           (same as: python -m services.scheduler)
  worker        run one worker alone              (same as: python -m services.worker)
  load-model    tell a running worker to load (or replace) its model; answers once it serves
  unload-model  tell a running worker to unload its model (it stays up with none)
  worker-status what a running worker serves (no model, loading, ready, unloading)
  kvstore       run the cluster KV page store     (same as: python -m services.kvstore)
  make-model    write a random-weight Hugging Face model directory
  compress      a model directory with its BF16 weights' exponents entropy-coded (lossless)
  fetch-demo    download the demo model (SmolLM2-135M-Instruct GGUF) into the cache; print its path
  bench         load-test any OpenAI-compatible endpoint
  bench-engine  offline engine throughput: prefill and decode tokens/s
  warm-kernels  compile every kernel a worker compiles at start into Triton's cache (takes the worker's flags)
  nats-credentials  random passwords for the bus's users (a compose .env, a Kubernetes Secret)
  nats-certs    a private CA and the NATS servers' certificate: TLS on the bus (compose, Kubernetes)
  plan          will a model fit on these GPUs, with how much KV cache: per GPU, per layout (no GPU, no weights)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "up":
        from services.launcher import main as run
    elif command == "gateway":
        from services.gateway.main import main as run
    elif command == "scheduler":
        from services.scheduler.main import main as run
    elif command == "worker":
        from services.worker.main import main as run
    elif command in ("load-model", "unload-model", "worker-status"):
        from services.worker.admin_client import main as admin
        return admin(command, rest)
    elif command == "kvstore":
        from services.kvstore.main import main as run
    elif command == "top":
        from services.top import main as run
    elif command == "make-model":
        from inferno.tools.make_model import main as run
    elif command == "compress":
        from inferno.tools.compress import main as run
    elif command == "fetch-demo":
        from services.packaged_models import main as run
    elif command == "bench":
        from inferno.loadgen.cli import main as run
    elif command == "bench-engine":
        from services.worker.engine.bench_engine import main as run
    elif command == "warm-kernels":
        from services.worker.warm_kernels import main as run
    elif command == "nats-credentials":
        from inferno.tools.nats_credentials import main as run
    elif command == "nats-certs":
        from inferno.tools.nats_certs import main as run
    elif command == "plan":
        from services.worker.plan.main import main as run
    else:
        print(f"inferno: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
