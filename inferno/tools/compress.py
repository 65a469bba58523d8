"""`inferno compress MODEL_DIR OUT_DIR`: a model directory with every BF16 tensor's exponents entropy-coded.

The output is safetensors files (any reader opens them) in which a BF16 tensor NAME is replaced by
four: NAME.__code_lengths, NAME.__chunk_starts, NAME.__exponent_bits and NAME.__sign_mantissa
(shared/exponent_codec.py; the layout: docs/compression.md). Other tensors, the config and the
tokenizer are copied as they are. --verify decodes every tensor and compares its bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from shared.exponent_codec import CHUNK, FORMAT, coded_parts, decode, encode
from shared.progress import progress


def _kind(name: str) -> str:
    """A tensor's kind for the summary: q_proj, gate_proj, embed_tokens, input_layernorm, ..."""
    parts = [p for p in name.split(".") if not p.isdigit() and p not in ("weight", "bias", "model", "layers")]
    return parts[-1] if parts else name


def compress(model_dir: Path, out_dir: Path, verify: bool = False) -> dict:
    """Write out_dir; return the summary: per kind, bytes before and after."""
    import torch
    from safetensors import safe_open
    from safetensors.numpy import save_file

    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():  # config, tokenizer, generation config: as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    total = sum(f.stat().st_size for f in shards)
    shown = progress("compressing", total / 1e9, "GB")
    summary: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # kind: [weights, bytes before, bytes after]
    weight_map = {}
    for shard in shards:
        out, shapes = {}, {}
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dtype == torch.bfloat16:
                    values = t.contiguous().view(torch.int16).numpy().view(np.uint16)
                    coded = encode(values)
                    if verify and not np.array_equal(decode(coded), values):
                        raise AssertionError(f"{shard.name}: {name} does not decode to its bytes")
                    out.update(coded_parts(name, coded))
                    shapes[name] = list(t.shape)
                    after = coded.nbytes
                else:
                    out[name] = t.numpy()
                    after = t.numel() * t.element_size()
                row = summary[_kind(name)]
                row[0] += t.numel()
                row[1] += t.numel() * t.element_size()
                row[2] += after
                shown.advance(t.numel() * t.element_size() / 1e9)
        save_file(out, str(out_dir / shard.name), metadata={
            "format": "pt", "inferno.compression": FORMAT, "inferno.chunk": str(CHUNK),
            "inferno.shapes": json.dumps(shapes, separators=(",", ":"))})
        weight_map.update({name: shard.name for name in out})
    shown.close()
    if (model_dir / "model.safetensors.index.json").is_file():
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {kind: {"weights": w, "bytes": b, "compressed_bytes": c, "bits_per_weight": 8 * c / max(w, 1)}
            for kind, (w, b, c) in sorted(summary.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="inferno compress", description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--verify", action="store_true", help="decode every tensor and compare its bytes with the source")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        summary = compress(args.model_dir, args.out_dir, verify=args.verify)
    except (FileNotFoundError, AssertionError) as e:
        print(f"inferno compress: {e}", file=sys.stderr)
        return 1
    weights = sum(r["weights"] for r in summary.values())
    before = sum(r["bytes"] for r in summary.values())
    after = sum(r["compressed_bytes"] for r in summary.values())
    for kind, r in summary.items():
        print(f"{kind:28} {r['weights']:>14,} weights  {r['bits_per_weight']:6.2f} bits/weight")
    print(f"{'all':28} {weights:>14,} weights  {8 * after / max(weights, 1):6.2f} bits/weight: "
          f"{after / 1e9:.3f} GB of {before / 1e9:.3f} ({100 * after / max(before, 1):.1f} %) in "
          f"{time.perf_counter() - t0:.1f} s{', verified' if args.verify else ''}")
    return 0
