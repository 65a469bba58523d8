"""Issue 39's size figures: a model's BF16 tensors compressed by `inferno compress --verify`, and zipnn
on the same tensors beside it. By default SmolLM2-135M-Instruct's weights from its packaged GGUF
(Q4_1, dequantised to BF16 by the engine's loader: labelled as such); --model-dir: a safetensors
directory as it is (e.g. the random-init 8B of `inferno make-model --preset llama-3.1-8b`).

  python bench/compress_size.py [--gguf FILE | --model-dir DIR] [--out DIR]
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


def zipnn_bytes(model_dir: Path) -> tuple[int, float]:
    """zipnn's compressed bytes over the directory's BF16 tensors, one at a time (on copies: its
    compress rewrites its input)."""
    from safetensors import safe_open
    from zipnn import ZipNN

    z = ZipNN(input_format="torch", bytearray_dtype="bfloat16")
    total, seconds = 0, 0.0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dtype == torch.bfloat16:
                    t0 = time.perf_counter()
                    total += len(z.compress(t.clone()))
                    seconds += time.perf_counter() - t0
    return total, seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model-dir", type=Path, default=None)
    args = ap.parse_args()
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "coded"
        if args.model_dir is not None:
            src, label = args.model_dir, f"{args.model_dir.name} (safetensors as written)"
        else:
            gguf = args.gguf or ensure_demo_model(False)
            src, label = Path(tmp) / "bf16", f"{gguf.name}, dequantised to BF16"
            src.mkdir()
            save_file(bf16_tensors(gguf), str(src / "model.safetensors"))
        t0 = time.perf_counter()
        summary = compress(src, out, verify=True)
        seconds = time.perf_counter() - t0
        z_bytes, z_s = zipnn_bytes(src)
    weights = sum(r["weights"] for r in summary.values())
    before = sum(r["bytes"] for r in summary.values())
    after = sum(r["compressed_bytes"] for r in summary.values())
    result = {"model": label, "weights": weights, "bf16_bytes": before,
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
