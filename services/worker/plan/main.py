"""`inferno plan MODEL --gpus 2xH200 [worker flags]`: its flags, the model it reads, the report it prints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DESCRIPTION = """Will the model fit on these GPUs, and with how much KV cache: the worker's memory sizing, per
GPU, before any weight is read. Exits 0 when the layout fits (with --compare: when some layout does), 1 when
not, 2 on bad input."""
EPILOG = """Every other flag is the worker's, with the worker's defaults (inferno worker --help): those
that move the figures are --dtype, --quantization, --kv-cache-dtype, --enable-expert-parallel,
--gpu-memory-utilization, --max-num-batched-tokens, --max-num-seqs, --block-size, --max-model-len and
--role (a prefill or decode worker keeps a hand-off buffer). Without -tp and -pp the model is split
over all the GPUs by tensor parallelism."""


def build_parser() -> argparse.ArgumentParser:
    from inferno.tools.model_shapes import ARCHITECTURES, PRESETS

    ap = argparse.ArgumentParser(prog="inferno plan", description=DESCRIPTION, epilog=EPILOG,
                                 allow_abbrev=False)  # a prefix of a worker flag is the worker's
    ap.add_argument("model", help=f"a model directory, its config.json, a .gguf file or a make-model preset "
                                  f"({', '.join(PRESETS)})")
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), default=None,
                    help="with a preset: the architecture, as make-model takes it (default: the preset's)")
    ap.add_argument("--gpus", required=True, metavar="NxKIND",
                    help="the GPUs, e.g. 2xH200; kinds: H100, H200, H20, A100-80G, A100-40G, L40S, B200")
    ap.add_argument("--gpu-memory-gib", type=float, default=None, metavar="X",
                    help="each GPU's memory as CUDA reports it (the worker's total_gib), instead of the kind's")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                    help="default: the GPUs over the pipeline stages")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    ap.add_argument("--compare", action="store_true",
                    help="also every TP × PP (and expert-parallel) layout of the GPUs, most KV tokens first")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def model_config_of(model: str, arch: str | None):
    """A model directory, a config.json, a .gguf, or a preset of inferno/tools/model_shapes.py."""
    from inferno.tools.model_shapes import PRESETS
    from services.worker.engine.model_config import ModelConfig

    path = Path(model)
    if path.exists():
        if arch is not None:
            raise ValueError("--arch applies to a preset, not to a model on disk")
        if path.is_file() and path.suffix == ".json":
            return ModelConfig.from_dict(json.loads(path.read_text()), source=str(path))
        return ModelConfig.from_path(path)
    if model in PRESETS:
        return ModelConfig.from_dict(preset_config(model, arch), source=f"preset {model}")
    raise ValueError(f"{model}: neither a path nor a preset ({', '.join(PRESETS)})")


def preset_config(name: str, arch: str | None) -> dict:
    """config.json as `inferno make-model --preset NAME --arch ARCH` writes it (make_model.write_model)."""
    from inferno.tools.model_shapes import PRESETS, model_config_dict, round_up
    from inferno.tools.synthetic_tokenizer import build_tokenizer_json

    p = PRESETS[name]
    vocab = p.vocab_size if p.vocab_size is not None else round_up(build_tokenizer_json(None).size, 64)
    return model_config_dict(arch or p.architecture, p, vocab, "bfloat16", p.tie_word_embeddings, 0, [0])


def engine_config(cfg):
    """The EngineConfig a worker of these flags builds (model_build.build_model), as far as memory goes."""
    from services.worker.engine.engine_config import EngineConfig
    from services.worker.model_build import handoff_buffer_tokens

    return EngineConfig(
        model_dir="", device=cfg.device, dtype=None if cfg.dtype == "auto" else cfg.dtype,
        kv_cache_dtype=cfg.kv_cache_dtype, quantization=cfg.quantization, block_size=cfg.block_size,
        gpu_memory_utilization=min(cfg.gpu_memory_utilization, 0.99), max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
        enable_expert_parallel=cfg.enable_expert_parallel, handoff_buffer_tokens=handoff_buffer_tokens(cfg))


def main(argv: list[str] | None = None) -> int:
    args, worker_flags = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    from services.worker.engine.kv_cache import kv_cache_dtype
    from services.worker.main import parse_args, service_config
    from services.worker.plan.gpus import parse_gpus
    from services.worker.plan.layout_plan import compare_layouts, plan_layout
    from services.worker.plan.rank_memory import serving_dtype
    from services.worker.plan.report import json_report, text_report

    try:
        gpus = parse_gpus(args.gpus, args.gpu_memory_gib)
        model_config = model_config_of(args.model, args.arch)
        pp = args.pipeline_parallel_size
        tp = args.tensor_parallel_size or max(1, gpus.count // pp)
        cfg, _ = service_config(parse_args(["--device", "cuda", "-tp", str(tp), "-pp", str(pp), *worker_flags]))
        config = engine_config(cfg)
    except ValueError as e:  # ModelConfigError and the configs' own checks too
        print(f"inferno plan: {e}", file=sys.stderr)
        return 2
    plan = plan_layout(model_config, config, gpus)
    # Prefill and decode workers run on one GPU each (WorkerServiceConfig refuses a group for them).
    max_group = gpus.count if cfg.role == "mixed" else 1
    compared = compare_layouts(model_config, config, gpus, max_group) if args.compare else None
    dtype = serving_dtype(config, model_config)
    summary = {
        "model": args.model, "architecture": model_config.architecture,
        "gpus": {"count": gpus.count, "kind": gpus.kind, "total_bytes": gpus.total_bytes},
        "settings": {
            "dtype": str(dtype).removeprefix("torch."), "quantization": config.quantization,
            "kv_dtype": str(kv_cache_dtype(config.kv_cache_dtype, dtype)).removeprefix("torch."),
            "block_size": config.block_size, "gpu_memory_utilization": config.gpu_memory_utilization,
            "max_num_batched_tokens": config.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
            "max_model_len": min(config.max_model_len or model_config.max_model_len, model_config.max_model_len),
            "handoff_buffer_tokens": config.handoff_buffer_tokens},
    }
    if args.json:
        print(json.dumps(json_report(summary, plan, compared), indent=1))
    else:
        print(text_report(summary, plan, compared))
    return 0 if plan.fits or any(p.fits for p in compared or ()) else 1
