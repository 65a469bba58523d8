"""The GPU kinds the planner knows, and `--gpus 2xH200`: how many, of which kind, how much memory each."""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30

# nvidia-smi's "Total" of each kind, in MiB.
SMI_TOTAL_MIB = {
    "H100": 81_559,
    "H200": 143_771,
    "H20": 97_871,
    "A100-80G": 81_920,
    "A100-40G": 40_960,
    "L40S": 46_068,
    "B200": 183_359,
}

# What CUDA's total (cudaMemGetInfo: the worker's `total_gib`, what gpu_memory_utilization multiplies)
# lacks of nvidia-smi's: memory the driver keeps. H100: nvidia-smi 81,559 MiB against the worker's
# total_gib 79.18 (81,080 MiB; bench/results/s11_w5a_dropped_h100.json). H200: 143,771 against
# 150,109,880,320 bytes (143,156 MiB; nvidia-h200, 2026-11-29). Kinds not measured are given the larger.
DRIVER_RESERVED_MIB = {"H100": 479, "H200": 615}
DEFAULT_DRIVER_RESERVED_MIB = 615


@dataclass(frozen=True, slots=True)
class Gpus:
    count: int
    kind: str
    total_bytes: int  # each GPU's memory as CUDA reports it (the worker's total_gib)


def parse_gpus(text: str, memory_gib: float | None = None) -> Gpus:
    """'2xH200', '8×H100' or 'H200' (one); memory_gib (--gpu-memory-gib) overrides the kind's memory
    and admits kinds not in SMI_TOTAL_MIB. ValueError saying what is wrong."""
    m = re.fullmatch(r"(?:(\d+)\s*[x×*]\s*)?([A-Za-z0-9][\w.-]*)", text.strip())
    if not m:
        raise ValueError(f"--gpus {text!r}: expected COUNTxKIND, e.g. 2xH200")
    count = int(m.group(1) or 1)
    if count < 1:
        raise ValueError(f"--gpus {text!r}: at least one GPU")
    kind = next((k for k in SMI_TOTAL_MIB if k.lower() == m.group(2).lower()), m.group(2))
    if memory_gib is not None:
        if memory_gib <= 0:
            raise ValueError("--gpu-memory-gib must be positive")
        return Gpus(count, kind, int(memory_gib * GIB))
    if kind not in SMI_TOTAL_MIB:
        raise ValueError(f"unknown GPU kind {kind!r}: one of {', '.join(SMI_TOTAL_MIB)}, or give --gpu-memory-gib")
    reserved = DRIVER_RESERVED_MIB.get(kind, DEFAULT_DRIVER_RESERVED_MIB)
    return Gpus(count, kind, (SMI_TOTAL_MIB[kind] - reserved) * MIB)
