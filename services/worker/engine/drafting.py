"""Speculation's drafting model, set up beside the engine's: loaded before the KV pool is sized (its
weights in use then, its KV per page counted), then its drafter over a pool of its own pages and, on a
GPU, its decode graphs (model_drafter.py, eagle3_drafter.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from services.worker.engine.eagle3_drafter import Eagle3Drafter, HeadGraphStep
from services.worker.engine.layers import Embedding
from services.worker.engine.model_drafter import DraftModel, GreedyStep


def load_drafting_model(spec, target, target_cfg, target_dir: str, group, device, dtype, ops):
    """The drafting model of `spec`, loaded before the KV pool is sized (its weights are in use then,
    and its KV per page is counted: draft_kv_bytes_per_block): a draft model (draft_model) or an
    EAGLE-3 head (eagle3), which makes the target keep the states it reads. In a tensor-parallel
    group it is the driver's alone, whole, and runs without collectives (`ops` are the plain ones)."""
    if spec.method == "eagle3":
        from services.worker.engine.eagle3 import load_eagle3
        source = target
        if group is not None:  # the driver holds a vocabulary shard of the embedding: the head reads it whole
            source = SimpleNamespace(cfg=target_cfg, embed_tokens=whole_embedding(target_dir, target_cfg, device, dtype))
        head = load_eagle3(spec.model, source, device, dtype, ops)
        target.keep_streams(head.config.aux_layer_ids(target_cfg.num_hidden_layers))
        return head
    from services.worker.engine.loader import load_model
    from services.worker.engine.model_config import ModelConfig

    cfg = ModelConfig.from_path(spec.model)
    vocab = target_cfg.vocab_size
    if not vocab - 1024 <= cfg.vocab_size <= vocab + 1024:
        raise ValueError(f"--speculative-config: the draft model's vocabulary ({cfg.vocab_size}) is not the "
                         f"target's ({vocab}): it needs the same tokenizer")
    return load_model(spec.model, device, dtype, ops)


def whole_embedding(model_dir: str, cfg, device, dtype) -> Embedding:
    """The target's token embedding read whole from its safetensors (a group's driver holds a shard)."""
    from services.worker.engine.safetensors_file import read_all_headers
    entry = read_all_headers(Path(model_dir)).get("model.embed_tokens.weight")
    if entry is None:
        raise ValueError(f"--speculative-config: eagle3 under tensor parallelism reads the target's "
                         f"model.embed_tokens.weight, which {model_dir} lacks")
    with safe_open(str(entry.path), framework="pt") as f:
        weight = f.get_tensor(entry.name)
    embed = Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    return embed


def _kv_config(model):
    """The ModelConfig of a drafting model's KV: its own, or an EAGLE-3 head's one layer."""
    return model.config.kv_config() if hasattr(model, "fuse") else model.cfg


def draft_kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    from services.worker.engine.kv_cache import kv_bytes_per_block
    return kv_bytes_per_block(_kv_config(model), block_size, dtype) if model is not None else 0


def build_drafter(spec, model, num_blocks: int, block_manager, config, device, dtype, target_vocab: int,
                  max_graph_len: int):
    """The drafter over a loaded drafting model: its pool of num_blocks pages of its own shape, and a
    draft model's decode graphs on a GPU."""
    from services.worker.engine.kv_cache import KVCache
    if model is None:
        return None
    kv = KVCache(_kv_config(model), num_blocks, config.block_size, dtype, device)
    if spec.method == "eagle3":
        drafter = Eagle3Drafter(model, kv, block_manager, device, config.max_num_batched_tokens, target_vocab)
        graph_model = HeadGraphStep(model, config.max_num_seqs)
    else:
        drafter = DraftModel(model, kv, block_manager, device, config.max_num_batched_tokens, target_vocab)
        graph_model = GreedyStep(model, target_vocab)
    drafter.graph_model = graph_model
    if config.is_cuda and config.cuda_graphs:
        capture_graphs(drafter, spec, config.max_num_seqs, max_graph_len)
    return drafter


def capture_graphs(drafter, spec, max_num_seqs: int, max_graph_len: int) -> float:
    """The drafter's decode graphs (a worker whose own graphs are captured in stages, after it is
    ready, calls this once its engine is built); returns the seconds taken."""
    from services.worker.engine.cuda_graphs import CudaGraphRunner
    # A proposal's steps queue on the device: a host stage for each, up to 9 before a wait.
    stages = min(spec.num_speculative_tokens, 8) + 1
    drafter.graphs = CudaGraphRunner(drafter.graph_model, drafter.kv_cache, max_num_seqs, max_graph_len,
                                     drafter.device, stages)
    return drafter.graphs.capture()
