"""Run as a script: a worker's own Triton JIT path for a kernel (compile only, as its first launch
would) for sm_90 on a machine without a GPU, through a stand-in CUDA driver that answers Triton's
device questions. Prints one JSON line: the cache's files before and after, and the variants the
compile hook recorded (kernel_manifest.note). TRITON_CACHE_DIR says which cache."""

from __future__ import annotations

import glob
import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime import driver  # noqa: E402


class NoGpuCuda(CudaDriver):
    """Triton's CUDA driver without libcuda: device 0, stream 0, an sm_90 target."""

    def __init__(self) -> None:  # the real one opens libcuda
        pass

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> None:
    driver.set_active(NoGpuCuda())
    from services.worker import kernel_manifest
    from services.worker.kernels.silu_mul import _silu_mul_kernel

    kernel_manifest.install_recorder()
    cache = os.environ["TRITON_CACHE_DIR"]
    before = len(glob.glob(f"{cache}/**/*", recursive=True))
    x, out = torch.empty(4, 256, dtype=torch.bfloat16), torch.empty(4, 128, dtype=torch.bfloat16)
    for block in (128, 256):  # two variants, as silu_mul launches them
        _silu_mul_kernel.warmup(x, out, 128, x.stride(0), out.stride(0), BLOCK=block, num_warps=4, grid=(4,))
    after = len(glob.glob(f"{cache}/**/*", recursive=True))
    print(json.dumps({"before": before, "after": after, "recorded": kernel_manifest.recorded()}))


if __name__ == "__main__":
    main()
