"""Does the driver's work on a side thread slow `import torch`? (GPU probe for cuda_early.py)

Each run is a fresh interpreter that starts a thread doing MODE while the main thread imports torch
and the engine, then creates the context the way warm_device does; prints one line per run.
MODE: none | context (cuInit + the primary context) | staging:N:MB (and N pinned buffers of MB).

    python3 bench/early_import_probe.py [ROUNDS]
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import sys, time
t0 = time.perf_counter()
mode = sys.argv[1]
early = None
if mode != "none":
    from services.worker.cuda_early import EarlyDevice
    n, mb = (int(x) for x in mode.split(":")[1:]) if mode.startswith("staging") else (0, 1)
    early = EarlyDevice(0, n, mb << 20).start()
import torch
from services.worker.engine import engine  # noqa: F401
t_imp = time.perf_counter()
if early is not None:
    early.buffers()
t_join = time.perf_counter()
torch.empty(1, device="cuda")
t_ctx = time.perf_counter()
print(f"{mode:16s} imports {t_imp - t0:.2f} join {t_join - t_imp:.2f} context {t_ctx - t_join:.2f} "
      f"early {early.seconds if early else 0:.2f} total {t_ctx - t0:.2f}", flush=True)
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for _ in range(rounds):
        for mode in ("none", "context", "staging:16:64", "staging:16:16", "staging:4:64"):
            subprocess.run([sys.executable, "-c", CHILD, mode], check=False)


if __name__ == "__main__":
    main()
