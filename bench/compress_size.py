"""Issue 39's size figure for a real model: SmolLM2-135M-Instruct's weights from its packaged GGUF
(Q4_1, dequantised to BF16 by the engine's loader: labelled as such), written as a safetensors
directory, compressed by `inferno compress --verify`, and zipnn on the same BF16 tensors beside it.

  python bench/compress_size.py [--gguf FILE] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferno.tools.compress import compress  # noqa: E402
from services.packaged_models import ensure_demo_model  # noqa: E402
from services.worker.engine.loader import load_model  # noqa: E402


def bf16_tensors(gguf: Path) -> dict[str, torch.Tensor]:
    """The model's matrices and vectors as the engine holds them, in BF16 (the loader dequantises)."""
    model = load_model(gguf, "cpu", torch.bfloat16)
    return {name: p.detach().contiguous() for name, p in model.named_parameters() if p.dtype == torch.bfloat16}


def zipnn_bytes(tensors: dict[str, torch.Tensor]) -> tuple[int, float]:
    """zipnn's compressed bytes over the same tensors (on copies: its compress rewrites its input)."""
    from zipnn import ZipNN

    z = ZipNN(input_format="torch", bytearray_dtype="bfloat16")
    t0 = time.perf_counter()
    total = sum(len(z.compress(t.clone())) for t in tensors.values())
    return total, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gguf = args.gguf or ensure_demo_model(False)
    tensors = bf16_tensors(gguf)
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "bf16", args.out or Path(tmp) / "coded"
        src.mkdir()
        save_file(tensors, str(src / "model.safetensors"))
        t0 = time.perf_counter()
        summary = compress(src, out, verify=True)
        seconds = time.perf_counter() - t0
    weights = sum(r["weights"] for r in summary.values())
    before = sum(r["bytes"] for r in summary.values())
    after = sum(r["compressed_bytes"] for r in summary.values())
    z_bytes, z_s = zipnn_bytes(tensors)
    result = {"model": f"{gguf.name}, dequantised to BF16", "weights": weights, "bf16_bytes": before,
              "compressed_bytes": after, "bits_per_weight": round(8 * after / weights, 3),
              "percent_of_bf16": round(100 * after / before, 1), "verified": True,
              "encode_s": round(seconds, 1), "zipnn_bytes": z_bytes,
              "zipnn_bits_per_weight": round(8 * z_bytes / weights, 3),
              "zipnn_percent": round(100 * z_bytes / before, 1), "zipnn_s": round(z_s, 1),
              "by_kind_bits": {k: round(r["bits_per_weight"], 2) for k, r in summary.items()}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
