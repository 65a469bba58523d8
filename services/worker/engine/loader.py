"""Loads a Hugging Face model directory (or a GGUF file) into a DecoderLM: meta-device build, fused
q/k/v and gate/up, bytes streamed from safetensors straight into place (pinned staging on the GPU)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import structlog
import torch

from services.worker.cuda_early import STAGING_BYTES
from services.worker.engine.compressed_weights import is_compressed, load_compressed_weights
from services.worker.engine.gguf_weights import load_gguf_weights
from services.worker.engine.model import DecoderLM
from services.worker.engine.llama4_weights import llama4_feed_forward
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.mla_weights import mla_tensors
from services.worker.engine.moe_weights import expert_tensors
from services.worker.engine.ops import TorchOps
from services.worker.engine.placement import Placement, ShardedTensor, Slice
from services.worker.engine.safetensors_file import TensorEntry, read_all_headers
from shared.gguf_file import GGUFError, is_gguf, open_gguf
from shared.progress import progress

log = structlog.get_logger("worker.loader")

PROGRESS_MIN_BYTES = 1 << 30  # loads from a gigabyte on show their progress


class WeightLoadError(ValueError):
    """A tensor is missing, mis-shaped or unreadable; the message names it."""


def expected_tensors(cfg: ModelConfig) -> dict[str, Placement]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    out = {
        "model.embed_tokens.weight": Placement("embed_tokens.weight", 0, (cfg.vocab_size, h)),
        "model.norm.weight": Placement("norm", 0, (h,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = Placement("lm_head", 0, (cfg.vocab_size, h))
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = dst + "self_attn."
        if cfg.mla is not None:
            out.update((name, shard.place) for name, shard in mla_tensors(cfg, cfg, src + "self_attn.", attn).items())
        else:
            out.update(_attention_tensors(cfg, src + "self_attn.", attn))
        if cfg.llama4 is not None:
            out.update((name, shard.place) for name, shard in llama4_feed_forward(cfg, cfg, i, i).items())
        elif cfg.is_sparse(i):
            out.update((name, shard.place) for name, shard in expert_tensors(cfg, cfg, i, i).items())
        else:
            out[src + "mlp.gate_proj.weight"] = Placement(dst + "mlp.gate_up_proj.weight", 0, (inter, h))
            out[src + "mlp.up_proj.weight"] = Placement(dst + "mlp.gate_up_proj.weight", inter, (inter, h))
            out[src + "mlp.down_proj.weight"] = Placement(dst + "mlp.down_proj.weight", 0, (h, inter))
        out[src + "input_layernorm.weight"] = Placement(dst + "input_layernorm", 0, (h,))
        out[src + "post_attention_layernorm.weight"] = Placement(dst + "post_attention_layernorm", 0, (h,))
    return out


def _attention_tensors(cfg: ModelConfig, src: str, attn: str) -> dict[str, Placement]:
    """Checkpoint name → place of one layer's attention (src "model.layers.{i}.self_attn.", attn its module)."""
    h, q, kv, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    out = {src + "q_proj.weight": Placement(attn + "qkv_proj.weight", 0, (q, h)),
           src + "k_proj.weight": Placement(attn + "qkv_proj.weight", q, (kv, h)),
           src + "v_proj.weight": Placement(attn + "qkv_proj.weight", q + kv, (kv, h)),
           src + "o_proj.weight": Placement(attn + "o_proj.weight", 0, (h, q))}
    if cfg.attention_bias:
        out[src + "q_proj.bias"] = Placement(attn + "qkv_proj.bias", 0, (q,))
        out[src + "k_proj.bias"] = Placement(attn + "qkv_proj.bias", q, (kv,))
        out[src + "v_proj.bias"] = Placement(attn + "qkv_proj.bias", q + kv, (kv,))
    if cfg.qk_norm:
        q_norm, k_norm = (q, kv) if cfg.qk_norm_whole else (hd, hd)
        out[src + "q_norm.weight"] = Placement(attn + "q_norm", 0, (q_norm,))
        out[src + "k_norm.weight"] = Placement(attn + "k_norm", 0, (k_norm,))
    return out


def plan_load(model_dir: Path, cfg: ModelConfig, shards: dict[str, ShardedTensor] | None = None):
    """Match checkpoint tensors to parameters; every problem is reported before any allocation.
    Returns (entry, placement, column slice) triples; a row slice is already cut into the entry."""
    entries = read_all_headers(model_dir)
    if shards is None:
        shards = {name: ShardedTensor(place.stored_shape, place) for name, place in expected_tensors(cfg).items()}
    plan = []
    for name, shard in shards.items():
        entry = entries.get(name)
        if entry is None:
            raise WeightLoadError(
                f"{model_dir}: missing tensor {name!r} (required by {cfg.architecture} per config.json)")
        if entry.shape != shard.full_shape:
            raise WeightLoadError(
                f"{model_dir}: tensor {name!r} has shape {list(entry.shape)}, "
                f"but config.json implies {list(shard.full_shape)}")
        if not entry.dtype.is_floating_point:
            raise WeightLoadError(f"{model_dir}: tensor {name!r} has non-float dtype {entry.dtype}")
        part = shard.slice
        if part is not None and part.dim == 0:
            row_bytes = entry.nbytes // entry.shape[0]
            start = entry.start + part.start * row_bytes
            entry = dataclasses.replace(entry, shape=(part.length, *entry.shape[1:]), start=start,
                                        end=start + part.length * row_bytes)
            part = None
        plan.append((entry, shard.place, part))
    return plan


class StagingPool:
    """Pinned staging buffers for GPU loads, kept from one load to the next (a running worker loads
    again on a model switch). Page-locking takes time (~0.5 s a GiB on the H100 VM), so the worker
    owns one and fills it before any load: some buffers made through the driver while torch was
    still importing (cuda_early.py), adopted here, the rest with torch. A load given no pool makes
    its own buffers (torch's pinned-memory cache keeps them)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def adopt(self, buffers) -> None:
        """Writable pinned host buffers of STAGING_BYTES each (memoryviews or uint8 tensors)."""
        tensors = [b if isinstance(b, torch.Tensor) else torch.frombuffer(b, dtype=torch.uint8) for b in buffers]
        with self._lock:
            self._free += tensors

    def fill(self, count: int) -> None:
        """Pinned buffers made with torch until the pool holds count."""
        with self._lock:
            missing = count - len(self._free)
        self.give(_pinned(missing))

    def take(self, count: int) -> list[torch.Tensor]:
        """count buffers: the pool's, and new ones where it has too few."""
        with self._lock:
            taken, self._free = self._free[:count], self._free[count:]
        return taken + _pinned(count - len(taken))

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._free += buffers

    def __len__(self) -> int:
        return len(self._free)


def _pinned(count: int) -> list[torch.Tensor]:
    return [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(count)]


class _Copier:
    """One loading thread: reads byte ranges into its own staging buffer and copies them out."""

    def __init__(self, device: torch.device, staging: StagingPool):
        self.device = device
        self.staging = staging
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        # Two pinned buffers: the disk read into one overlaps the DMA out of the other. Made on
        # first use, so a CPU load of matching dtype (read straight into place) needs none.
        self.cuda = cuda
        self.buffers: list[torch.Tensor] = []
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def copy(self, entry: TensorEntry, dst: torch.Tensor) -> None:
        """dst: a contiguous flat view of the destination elements."""
        if not self.cuda and entry.dtype == dst.dtype:
            with open(entry.path, "rb", buffering=0) as f:
                f.seek(entry.start)
                if f.readinto(memoryview(dst.view(torch.uint8).numpy())) != entry.nbytes:
                    raise WeightLoadError(f"{entry.path}: tensor {entry.name!r} is truncated")
            return
        if not self.buffers:
            self.buffers = self.staging.take(2) if self.cuda else [torch.empty(STAGING_BYTES, dtype=torch.uint8)
                                                                    for _ in range(2)]
        elem = entry.dtype.itemsize
        step = (STAGING_BYTES // elem) * elem
        done = 0
        with open(entry.path, "rb", buffering=0) as f:
            f.seek(entry.start)
            while done < entry.nbytes:
                n = min(step, entry.nbytes - done)
                buf, event = self.buffers[self.turn], self.events[self.turn]
                if event is not None:
                    event.synchronize()  # the DMA that last read this buffer is over
                view = buf[:n]
                if f.readinto(memoryview(view.numpy())) != n:
                    raise WeightLoadError(f"{entry.path}: tensor {entry.name!r} is truncated")
                src = view.view(entry.dtype)
                out = dst[done // elem:(done + n) // elem]
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        out.copy_(src, non_blocking=True)
                        event.record(self.stream)
                else:
                    out.copy_(src)
                self.turn ^= 1
                done += n

    def copy_columns(self, entry: TensorEntry, dst: torch.Tensor, part: Slice) -> None:
        """A row-parallel rank's columns: a strided view of the mapped file (only its pages are
        read), made contiguous on the host, then copied into place."""
        rows, cols = entry.shape
        elem = entry.dtype.itemsize
        mapped = np.memmap(entry.path, dtype=np.uint8, mode="r", offset=entry.start, shape=(rows, cols * elem))
        block = np.ascontiguousarray(mapped[:, part.start * elem:(part.start + part.length) * elem])
        dst.copy_(torch.from_numpy(block).view(entry.dtype).view(-1))
        del mapped

    def finish(self) -> None:
        """Waits for the copies, and gives the pinned buffers back to the pool."""
        if self.stream is not None:
            self.stream.synchronize()
        if self.cuda:
            self.staging.give(self.buffers)
        self.buffers = []


LOAD_FORMATS = ("auto", "dummy")


def load_model(model_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               ops: TorchOps | None = None, num_threads: int = 4, load_format: str = "auto",
               seed: int = 0, build_cfg: ModelConfig | None = None,
               shards: dict[str, ShardedTensor] | None = None, staging: StagingPool | None = None,
               max_positions: int | None = None) -> DecoderLM:
    """A Hugging Face directory (safetensors) or a .gguf file: one build path, two weight readers.
    load_format "dummy" reads no weights: random ones are drawn on the device (benchmarks of shapes
    too large to write, e.g. 70B; the directory needs only config.json and the tokenizer).
    A rank of a parallel group passes the shape it builds (`build_cfg`) and what it loads of each
    checkpoint tensor (`shards`). `staging`: the pinned buffers a GPU load copies through (a worker's
    pool, kept between loads); None, buffers made for this load. `max_positions`: the longest sequence
    served (--max-model-len), which sizes the rotary table (Llama 4 Scout's 10.5 M positions would
    take 5.4 GB); None: the model's own."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_path = Path(model_path)
    cfg = ModelConfig.from_path(model_path)
    device = torch.device(device)
    dtype = dtype or getattr(torch, cfg.torch_dtype, torch.bfloat16)
    expected = expected_tensors(cfg)
    dummy = load_format == "dummy"
    gguf = open_gguf(model_path) if is_gguf(model_path) and not dummy else None
    if gguf is not None and shards is not None:
        raise WeightLoadError(f"{model_path}: a GGUF file loads on one rank only; "
                              "tensor/pipeline parallelism needs safetensors (or --load-format dummy)")
    # A directory `inferno compress` wrote: its BF16 tensors are decoded into place.
    compressed = gguf is None and not dummy and is_compressed(model_path)
    if compressed and shards is not None:
        raise WeightLoadError(f"{model_path}: a compressed directory loads on one rank only for now; "
                              "tensor/pipeline parallelism needs the uncompressed one")
    plan = None if gguf or dummy or compressed else plan_load(model_path, cfg, shards)
    if cfg.mtp_layers:
        log.info("multi-token-prediction layers not loaded", layers=cfg.mtp_layers,
                 first=f"model.layers.{cfg.num_hidden_layers}")
    with torch.device("meta"):
        model = DecoderLM(build_cfg or cfg, ops or TorchOps())
    # Cast while still on meta (free), then allocate once in the final dtype (but what stays fp32).
    model = _materialize(model.to(dtype).keep_fp32(), device)
    params = dict(model.named_parameters())

    def flat_target(place: Placement) -> torch.Tensor:
        param = params[place.param].data
        row_elems = param.shape[-1] if param.dim() > 1 else 1  # a row of a stacked [E, N, K] is one of N
        count = math.prod(place.shape)
        return param.view(-1)[place.row * row_elems: place.row * row_elems + count]

    if dummy:
        _fill_dummy(model, seed)
    elif compressed:
        try:
            load_compressed_weights(model_path, list(expected), lambda name: flat_target(expected[name]))
        except ValueError as e:
            raise WeightLoadError(str(e)) from e
    elif gguf is not None:
        try:
            load_gguf_weights(gguf, cfg, expected, lambda name: flat_target(expected[name]), device, dtype, num_threads)
        except GGUFError as e:
            raise WeightLoadError(str(e)) from e
    else:
        _load_safetensors(plan, flat_target, device, num_threads,
                          staging if staging is not None else StagingPool())
        if shards is not None:
            _zero_unloaded_rows(params, shards)
    if not dummy:
        _turn_transposed(expected.values() if shards is None else [s.place for s in shards.values()], flat_target)
    model.finish_load()
    # (64 positions past the longest sequence: a speculative check's drafted rows may pass its end)
    model.init_rope(min(cfg.max_model_len, (max_positions or cfg.max_model_len) + 64), device)
    return model.eval().requires_grad_(False)


def _materialize(model: DecoderLM, device: torch.device) -> DecoderLM:
    """Module.to_empty() without its empty_like() of meta tensors, whose first call imports sympy
    (through torch.fx.experimental.symbolic_shapes): 0.4 s of a process's first load on the CPU VM,
    more on the GPU VM's slower imports."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                              requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model


def _turn_transposed(places, flat_target) -> None:
    """The placements whose checkpoint tensor holds each matrix transposed (Llama 4's stacked experts)
    were filled byte for byte as stored: each matrix is turned now, one at a time through a copy
    (so the safetensors and the compressed readers need no transposing path of their own)."""
    with torch.no_grad():
        for place in places:
            if place.transpose:
                *_, rows, cols = place.shape
                flat = flat_target(place)
                stored, wanted = flat.view(-1, cols, rows), flat.view(-1, rows, cols)
                for m in range(stored.shape[0]):
                    wanted[m].copy_(stored[m].t().contiguous())


def _zero_unloaded_rows(params: dict, shards: dict[str, ShardedTensor]) -> None:
    """The last rank's vocabulary slice may be padded: its spare rows hold zeros, not garbage."""
    for shard in shards.values():
        if shard.place.param in ("embed_tokens.weight", "lm_head"):
            params[shard.place.param].data[shard.place.shape[0]:].zero_()


def _fill_dummy(model: DecoderLM, seed: int, std: float = 0.02) -> None:
    """Random weights drawn where they live (no host memory, no disk): N(0, std) matrices, norms
    near 1, zero biases; the same seed draws the same model on the same device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(1.0, 0.1, generator=gen)


def _load_safetensors(plan, flat_target, device: torch.device, num_threads: int, staging: StagingPool) -> None:
    # Spread the tensors over threads by size so each thread moves about the same bytes.
    jobs = sorted(plan, key=lambda item: -item[0].nbytes)
    lanes: list[list] = [[] for _ in range(max(1, num_threads))]
    loads = [0] * len(lanes)
    for job in jobs:
        i = loads.index(min(loads))
        lanes[i].append(job)
        loads[i] += job[0].nbytes

    local = threading.local()
    total = sum(loads)
    # A large model's load takes seconds to minutes: its progress in GB (plain lines into a log).
    shown = progress("loading weights", total / 1e9, "GB") if total >= PROGRESS_MIN_BYTES else None

    def run_lane(lane):
        local.copier = _Copier(device, staging)
        try:
            for entry, place, part in sorted(lane, key=lambda item: (str(item[0].path), item[0].start)):
                if part is None:
                    local.copier.copy(entry, flat_target(place))
                else:
                    local.copier.copy_columns(entry, flat_target(place), part)
                if shown is not None:
                    shown.advance(entry.nbytes / 1e9)
        finally:
            local.copier.finish()

    with ThreadPoolExecutor(len(lanes)) as pool:
        for future in [pool.submit(run_lane, lane) for lane in lanes if lane]:
            future.result()
    if shown is not None:
        seconds = time.monotonic() - shown.started
        shown.update(shown.done, note=f"{shown.done / max(seconds, 1e-9):.1f} GB/s")
        shown.close()
