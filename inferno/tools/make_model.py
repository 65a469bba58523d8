"""Write a random-weight model in Hugging Face format: config, safetensors shards, tokenizer.

Nothing in this project can download weights or tokenizers, so the tests, the demo and the
benchmarks run on models written here. Everything is deterministic: the same arguments give
byte-identical files (weights are drawn tensor by tensor from a generator seeded with the run's
seed and the tensor's name, and the tokenizer is trained on a corpus embedded in this module).

The output loads in `transformers.AutoModelForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` with no missing or unexpected keys. `write_eagle3` (the
`eagle3-*` presets) writes a random EAGLE-3 draft head for a target preset instead, in the
published heads' layout, which the engine's eagle3.py loads.

Memory stays at one tensor at a time: the safetensors files are written by hand (header first,
then each tensor's bytes as soon as it is generated), so the 16 GB Llama-3.1-8B preset streams
to disk on a machine with little memory. `device="cuda"` draws the numbers on the GPU, which is
much faster; CUDA and CPU generators differ, so files are byte-identical per device, not across.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from inferno.tools.model_shapes import (  # noqa: F401 (re-exported for callers and tests)
    ARCHITECTURES, INIT_STD, PRESETS, Preset, TensorSpec, model_config_dict, round_up, tensor_specs)
from shared.progress import Progress, progress as open_progress

DTYPES = {
    # name: (torch dtype attribute, safetensors dtype, bytes per element)
    "bfloat16": ("bfloat16", "BF16", 2),
    "float16": ("float16", "F16", 2),
    "float32": ("float32", "F32", 4),
}

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's "5GB"
NORM_NOISE_STD = 0.1  # norm weights are 1 + N(0, 0.1): not the identity
BIAS_STD = 0.02
_CHUNK_ELEMENTS = 1 << 24  # numbers drawn per call: bounds the float32 scratch to 64 MiB

from inferno.tools.synthetic_tokenizer import (  # noqa: F401 (re-exported for callers and tests)
    BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, GENERATION_EOS_TOKENS, SPECIAL_TOKENS, _tokenizer_config,
    build_tokenizer_json)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generate_tensor(spec: TensorSpec, seed: int, dtype: str = "bfloat16", device: str = "cpu"):
    """One tensor's values, on the CPU, drawn from a generator seeded by (seed, name).

    The numbers come in fixed-size chunks of float32, so the scratch memory is bounded and the
    result does not depend on anything but (seed, name, shape, dtype, device kind)."""
    import torch

    torch_dtype = getattr(torch, DTYPES[dtype][0])
    gen = torch.Generator(device=device)
    gen.manual_seed(_tensor_seed(seed, spec.name))
    out = torch.empty(spec.shape, dtype=torch_dtype, device=device)
    flat = out.view(-1)
    if spec.kind == "norm":
        mean, std = 1.0, NORM_NOISE_STD
    elif spec.kind == "bias":
        mean, std = 0.0, BIAS_STD
    else:
        mean, std = 0.0, INIT_STD
    n = flat.numel()
    for start in range(0, n, _CHUNK_ELEMENTS):
        size = min(_CHUNK_ELEMENTS, n - start)
        chunk = torch.randn(size, generator=gen, dtype=torch.float32, device=device)
        chunk.mul_(std).add_(mean)
        flat[start:start + size].copy_(chunk)
        del chunk
    return out.cpu() if out.device.type != "cpu" else out


def _tensor_bytes(t) -> memoryview:
    import torch

    t = t.contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


# --------------------------------------------------------------------------------------------
# Safetensors, written by hand one tensor at a time
# --------------------------------------------------------------------------------------------


def plan_shards(specs: list[TensorSpec], elem_bytes: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy in order, as huggingface_hub does: a new shard when the next tensor would overflow
    the current one; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * elem_bytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _stored_dtype(spec: TensorSpec, dtype: str) -> tuple[str, int]:
    """(safetensors dtype, bytes per element): the model's, or an EAGLE-3 vocabulary map's own."""
    return EAGLE3_MAPS.get(spec.kind) or DTYPES[dtype][1:]


def _safetensors_header(specs: list[TensorSpec], dtype: str) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        st_dtype, elem_bytes = _stored_dtype(spec, dtype)
        nbytes = spec.numel * elem_bytes
        header[spec.name] = {"dtype": st_dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


# Told the bytes of each tensor as it is written, and the file it went into.
Wrote = Callable[[int, str], None]


def _write_shard(path: Path, specs: list[TensorSpec], seed: int, dtype: str, device: str,
                 make=generate_tensor, wrote: Wrote | None = None) -> None:
    """make(spec, seed, dtype, device): a spec's tensor on the CPU (default: random, by its kind)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_safetensors_header(specs, dtype))
        for spec in specs:
            t = make(spec, seed, dtype, device)
            data = _tensor_bytes(t)
            f.write(data)
            if wrote is not None:
                wrote(data.nbytes, path.name)
            del t, data
    os.replace(tmp, path)


def _weights_progress(total_bytes: int) -> tuple[Progress, Wrote]:
    """The weights written, in GB (MB for a small model) with the rate and the file being written: a
    bar on a terminal, else a line every few seconds. Returns the progress and what advances it."""
    unit, scale = ("GB", 1e9) if total_bytes >= 1e9 else ("MB", 1e6)
    shown = open_progress("writing weights", total_bytes / scale, unit)

    def wrote(nbytes: int, name: str) -> None:
        done = shown.done + nbytes / scale
        rate = done / max(time.monotonic() - shown.started, 1e-9)
        shown.advance(nbytes / scale, note=f"{name}, {rate:,.2f} {unit}/s")

    return shown, wrote


# --------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------


def _dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _resolve_device(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} asked for, but CUDA is not available")
    elif device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return device


def write_model(
    out_dir: str | Path,
    arch: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    tie_word_embeddings: bool | None = None,
    max_shard_bytes: int | None = None,
    device: str = "cpu",
    progress: bool = False,
    weights: bool = True,
) -> Path:
    """Write a random-weight model directory; return its path. weights=False writes the config and
    tokenizer only: such a directory is served with load_format "dummy" (weights drawn on the device).

    arch: one of ARCHITECTURES (the dense Llama family and the MoE families); None takes the preset's own
    (LlamaForCausalLM for tiny, small and llama-3.1-8b). An MoE architecture on a dense preset takes its
    expert fields (tiny has 4 experts, 2 per token).
    tie_word_embeddings: None takes the preset's default (untied for all built-in presets).
    progress: show the weights written on stderr (a bar on a terminal, else a line every few seconds).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    arch = arch or p.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    max_shard_bytes = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else int(max_shard_bytes)
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    device = _resolve_device(device)
    tied = p.tie_word_embeddings if tie_word_embeddings is None else bool(tie_word_embeddings)

    tf = build_tokenizer_json(p.vocab_size)
    vocab_size = p.vocab_size if p.vocab_size is not None else round_up(tf.size, 64)
    if vocab_size < tf.size:
        raise ValueError(f"preset {preset!r} has vocab_size {vocab_size} < tokenizer size {tf.size}")
    bos_id = tf.special_ids[BOS_TOKEN]
    eos_ids = [tf.special_ids[t] for t in GENERATION_EOS_TOKENS]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Clear weights of an earlier run, so no stale shard is left beside the new ones.
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()

    config = model_config_dict(arch, p, vocab_size, dtype, tied, bos_id, eos_ids)
    _dump_json(out / "config.json", config)
    _dump_json(out / "generation_config.json", {
        "bos_token_id": bos_id,
        "do_sample": True,
        "eos_token_id": eos_ids,
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": "4.45.0",
    })
    (out / "tokenizer.json").write_text(tf.tokenizer_json, encoding="utf-8")
    _dump_json(out / "tokenizer_config.json", _tokenizer_config(tf, p.max_position_embeddings))
    _dump_json(out / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})

    if not weights:
        return out
    specs = tensor_specs(arch, p, vocab_size, tied)
    elem_bytes = DTYPES[dtype][2]
    shards = plan_shards(specs, elem_bytes, max_shard_bytes)
    shown, wrote = _weights_progress(sum(s.numel for s in specs) * elem_bytes) if progress else (None, None)
    with shown or contextlib.nullcontext():
        if len(shards) == 1:
            _write_shard(out / "model.safetensors", shards[0], seed, dtype, device, wrote=wrote)
        else:
            n = len(shards)
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{n:05d}.safetensors"
                _write_shard(out / name, shard, seed, dtype, device, wrote=wrote)
                weight_map.update({spec.name: name for spec in shard})
            index = {
                "metadata": {"total_size": sum(s.numel for s in specs) * elem_bytes},
                "weight_map": weight_map,
            }
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def iter_model_files(model_dir: str | Path) -> Iterator[Path]:
    """Every file of a model directory, sorted (for hashing and copying)."""
    return iter(sorted(p for p in Path(model_dir).iterdir() if p.is_file()))


# --------------------------------------------------------------------------------------------
# EAGLE-3 draft heads, in the published layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)
# --------------------------------------------------------------------------------------------

# make-model presets that write a head for a target preset, and the heads' draft vocabularies:
# the published head's 32000, and a small one for the tiny target's tests.
EAGLE3_PRESETS = {"eagle3-llama-3.1-8b": "llama-3.1-8b", "eagle3-tiny": "tiny"}
EAGLE3_DRAFT_VOCAB = {"llama-3.1-8b": 32000, "tiny": 64}
# The vocabulary maps keep their own dtypes (safetensors dtype, bytes per element) whatever the head's.
EAGLE3_MAPS = {"d2t": ("I64", 8), "t2d": ("BOOL", 1)}


def eagle3_config_dict(p: Preset, vocab_size: int, draft_vocab_size: int, dtype: str) -> dict:
    """A head's config.json: one Llama layer of the target's shapes (keys sorted, as save_pretrained does)."""
    return dict(sorted({
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": draft_vocab_size,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": p.num_key_value_heads,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_scaling": p.rope_scaling_for("LlamaForCausalLM"),
        "rope_theta": p.rope_theta,
        "target_hidden_size": p.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "vocab_size": vocab_size,
    }.items()))


def eagle3_tensor_specs(p: Preset, vocab_size: int, draft_vocab_size: int) -> list[TensorSpec]:
    """Every tensor of a head but embeddings (it shares the target's); q/k/v read [embeds ; hidden], 2H wide.
    The int64 map first and the bool mask last keep every float tensor 8-byte aligned in the file."""
    h, hd = p.hidden_size, p.head_dim
    q, kv, inter = p.num_attention_heads * hd, p.num_key_value_heads * hd, p.intermediate_size
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return [
        TensorSpec("d2t", (draft_vocab_size,), "d2t"),
        TensorSpec("fc.weight", (h, 3 * h), "weight"),
        TensorSpec("midlayer.input_layernorm.weight", (h,), "norm"),
        TensorSpec("midlayer.hidden_norm.weight", (h,), "norm"),
        TensorSpec(a + "q_proj.weight", (q, 2 * h), "weight"),
        TensorSpec(a + "k_proj.weight", (kv, 2 * h), "weight"),
        TensorSpec(a + "v_proj.weight", (kv, 2 * h), "weight"),
        TensorSpec(a + "o_proj.weight", (h, q), "weight"),
        TensorSpec("midlayer.post_attention_layernorm.weight", (h,), "norm"),
        TensorSpec(m + "gate_proj.weight", (inter, h), "weight"),
        TensorSpec(m + "up_proj.weight", (inter, h), "weight"),
        TensorSpec(m + "down_proj.weight", (h, inter), "weight"),
        TensorSpec("norm.weight", (h,), "norm"),
        TensorSpec("lm_head.weight", (draft_vocab_size, h), "weight"),
        TensorSpec("t2d", (vocab_size,), "t2d"),
    ]


def draft_vocabulary(seed: int, vocab_size: int, draft_vocab_size: int):
    """The target ids a head drafts, ascending: a random subset (a trained head's are the most frequent),
    drawn on the CPU from (seed, "d2t"), so the same on every device."""
    import torch

    gen = torch.Generator().manual_seed(_tensor_seed(seed, "d2t"))
    return torch.randperm(vocab_size, generator=gen)[:draft_vocab_size].sort().values


def write_eagle3(out_dir: str | Path, target_preset: str = "llama-3.1-8b", seed: int = 0, dtype: str = "bfloat16",
                 device: str = "cpu", draft_vocab_size: int | None = None,
                 target_vocab_size: int | None = None, progress: bool = False) -> Path:
    """Write a random-weight EAGLE-3 head for a target of `target_preset` (config.json, model.safetensors);
    return its path. target_vocab_size None: the vocabulary write_model gives that preset; progress: as
    write_model's."""
    import torch

    if target_preset not in PRESETS:
        raise ValueError(f"unknown preset {target_preset!r}; choose from {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    device = _resolve_device(device)
    p = PRESETS[target_preset]
    vocab = target_vocab_size or p.vocab_size or round_up(build_tokenizer_json(None).size, 64)
    draft = draft_vocab_size or EAGLE3_DRAFT_VOCAB.get(target_preset, min(vocab, 32000))
    if not 0 < draft <= vocab:
        raise ValueError(f"draft_vocab_size {draft} must be in [1, vocab_size {vocab}]")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _dump_json(out / "config.json", eagle3_config_dict(p, vocab, draft, dtype))
    target_ids = draft_vocabulary(seed, vocab, draft)

    def make(spec: TensorSpec, seed: int, dtype: str, device: str):
        if spec.kind == "d2t":  # target id = draft id + d2t[draft id]
            return target_ids - torch.arange(draft)
        if spec.kind == "t2d":  # which target ids the head can draft
            return torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True)
        return generate_tensor(spec, seed, dtype, device)

    specs = eagle3_tensor_specs(p, vocab, draft)
    total = sum(spec.numel * _stored_dtype(spec, dtype)[1] for spec in specs)
    shown, wrote = _weights_progress(total) if progress else (None, None)
    with shown or contextlib.nullcontext():
        _write_shard(out / "model.safetensors", specs, seed, dtype, device, make, wrote)
    return out


# --------------------------------------------------------------------------------------------
# CLI: inferno make-model OUT_DIR ...
# --------------------------------------------------------------------------------------------


def _parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 2000000, 500MB, 5GB, 1GiB)")
    try:
        value = int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 2000000, 500MB, 5GB, 1GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


def build_parser(prog: str = "inferno make-model") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Write a random-weight model in Hugging Face format.")
    ap.add_argument("out_dir", help="directory to write (created if missing)")
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), default=None,
                    help="architecture (default: the preset's, LlamaForCausalLM for tiny/small/llama-3.1-8b)")
    ap.add_argument("--preset", choices=sorted(PRESETS) + sorted(EAGLE3_PRESETS), default="tiny",
                    help="model shapes; eagle3-*: a random EAGLE-3 draft head for that target preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None, help="tie lm_head to the embeddings")
    tie.add_argument("--untied", dest="tied", action="store_false", help="separate lm_head (the default)")
    ap.add_argument("--max-shard-bytes", type=_parse_size, default=None,
                    help="largest safetensors shard (default 5GB); accepts 500MB, 2GiB, ...")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the random numbers are drawn")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--config-only", action="store_true",
                    help="write config and tokenizer, no weights (serve with --load-format dummy)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.preset in EAGLE3_PRESETS:
            if args.arch or args.tied is not None or args.max_shard_bytes or args.config_only:
                raise ValueError("--arch, --tied/--untied, --max-shard-bytes and --config-only "
                                 "do not apply to an EAGLE-3 head")
            out = write_eagle3(args.out_dir, EAGLE3_PRESETS[args.preset], seed=args.seed, dtype=args.dtype,
                               device=args.device, progress=not args.quiet)
        else:
            out = write_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype,
                              tie_word_embeddings=args.tied, max_shard_bytes=args.max_shard_bytes,
                              device=args.device, progress=not args.quiet, weights=not args.config_only)
    except (ValueError, RuntimeError) as e:
        print(f"make-model: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
