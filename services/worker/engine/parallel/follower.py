"""A non-driver rank of a worker group: builds its part of the engine exactly as the driver
does (same collectives in the same order), then runs each step the driver sends until told to
stop. Started by the driver: python -m services.worker.engine.parallel.follower ..."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from services.worker.engine.parallel.group import EXIT_CODE_RANK_LOST, die_with_parent
from services.worker.engine.parallel.step_channel import OP_STOP
from services.worker.engine.torch_profile import FOLLOWERS_ENV, start_profile, write_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--config", required=True, help="the driver's EngineConfig as JSON")
    args = parser.parse_args(argv)
    die_with_parent()

    from shared.logging import setup_logging
    setup_logging(f"worker-rank-{args.rank}")
    from services.worker.engine.engine import LLMEngine
    from services.worker.engine.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig(**json.loads(args.config)), rank=args.rank, init_method=args.init_method)
    channel = engine.group.channel
    profile_path = os.environ.get(FOLLOWERS_ENV, "")
    profiler = start_profile() if profile_path else None
    steps, t0 = 0, time.perf_counter()
    try:
        while True:
            message = channel.recv()
            if message.op == OP_STOP:
                break
            engine.runner.follow(message)
            steps += 1
    except Exception as e:  # the driver is gone or a step failed here: the group cannot go on
        print(f"rank {args.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE_RANK_LOST)
    if profiler is not None:
        write_profile(profiler, f"{profile_path}.rank{args.rank}", steps, time.perf_counter() - t0)
    engine.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: NCCL state captured in graphs goes with the process


if __name__ == "__main__":
    sys.exit(main())
