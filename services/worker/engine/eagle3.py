"""EAGLE-3 draft heads in the published checkpoint layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, as vLLM's
llama_eagle3 and SGLang read it): the config, the one-layer head, and its loader.

A head drafts from three residual streams of the target (the inputs of three of its layers), fused by
`fc` into one hidden state; each draft step reads that state (or the previous step's prenorm output)
beside the embedding of the token just drafted, through one decoder layer whose q/k/v read both
side by side. Its vocabulary is a subset of the target's: `d2t` maps a draft id to a target id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.layers import MLP, Embedding, Linear
from services.worker.engine.model import Attention, DecoderLM
from services.worker.engine.model_config import ModelConfig, ModelConfigError
from services.worker.engine.ops import TorchOps
from services.worker.engine.safetensors_file import find_weight_files
from services.worker.kernels.rope import rope_cos_sin_cache

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layer: ModelConfig  # the shape of the head's one decoder layer; vocab_size is the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int  # the width of each of the target's three hidden states
    aux_layers: tuple[int, ...] | None = None  # eagle_config's layer ids; None: the default ones

    def __post_init__(self):
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ModelConfigError(
                f"EAGLE-3 head: draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size {self.vocab_size}]")
        if self.target_hidden_size <= 0:
            raise ModelConfigError(f"EAGLE-3 head: target_hidden_size must be positive, got {self.target_hidden_size}")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ModelConfigError(
                f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids must name 3 layers, got {list(self.aux_layers)}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    def kv_config(self) -> ModelConfig:
        """The shape the head's KV pool is made for: KVCache(cfg.kv_config(), ...), one layer."""
        return self.layer

    @classmethod
    def from_dir(cls, path: str | Path) -> Eagle3Config:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"{file} not found: an EAGLE-3 head directory needs a config.json")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{file} is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        if not archs or archs[0] not in EAGLE3_ARCHITECTURES:
            raise ModelConfigError(
                f"{file}: architectures {archs} is not an EAGLE-3 head (expected one of {EAGLE3_ARCHITECTURES})")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelConfigError(f"{file}: an EAGLE-3 head has one layer, not {raw['num_hidden_layers']}")
        if raw.get("norm_before_residual"):
            # A variant (speculators' heads) whose residual is the normed hidden state: not this layout.
            raise ModelConfigError(f"{file}: norm_before_residual heads are not supported")
        # The layer is a Llama decoder layer in shape: its parsing and checks (rope scaling included).
        layer = ModelConfig.from_dict(
            {**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "tie_word_embeddings": False},
            source=str(file))
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            aux_layers=None if aux is None else tuple(int(i) for i in aux),
        )

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, int, int]:
        """The target layers whose inputs the head reads, low to high (fc's columns are low | mid | high):
        the config's, else (2, L // 2, L - 3) as vLLM and SGLang take them. A target of fewer than 7
        layers (a test model) has no three distinct such layers: the default is then clamped into range
        and sorted, and names a layer twice, whose state the target hands over twice."""
        n = num_target_layers
        if self.aux_layers is not None:
            ids = self.aux_layers
        else:
            ids = tuple(sorted(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3)))
        if not all(0 <= i < n for i in ids) or list(ids) != sorted(ids):
            raise ValueError(f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids {list(ids)} are not ascending "
                             f"layers of a {n}-layer target")
        return ids


class Eagle3Head(nn.Module):
    """fc, then one decoder layer over [rmsnorm(embeds) ; rmsnorm(hidden)], the final norm and a draft-vocabulary
    LM head (vLLM's llama_eagle3). Parameters are uninitialised: load_eagle3 fills them."""

    def __init__(self, cfg: Eagle3Config, ops: TorchOps):
        super().__init__()
        layer = cfg.layer
        h = layer.hidden_size
        self.config = cfg
        self.ops = ops
        self.eps = layer.rms_norm_eps
        self.fc = Linear(3 * cfg.target_hidden_size, h, ops)
        self.embed_tokens = Embedding(layer.vocab_size, h)  # the target's, shared, unless the checkpoint has one
        self.input_layernorm = nn.Parameter(torch.empty(h))
        self.hidden_norm = nn.Parameter(torch.empty(h))
        self.self_attn = Attention(layer, ops)
        # q, k and v read the embeddings and the hidden state side by side: twice a Llama layer's input.
        self.self_attn.qkv_proj = Linear(2 * h, layer.q_size + 2 * layer.kv_size, ops)
        self.post_attention_layernorm = nn.Parameter(torch.empty(h))
        self.mlp = MLP(layer, ops)
        self.norm = nn.Parameter(torch.empty(h))
        self.lm_head = nn.Parameter(torch.empty(cfg.draft_vocab_size, h))
        self.register_buffer("d2t", torch.empty(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def init_rope(self, max_positions: int, device) -> None:
        layer = self.config.layer
        table = rope_cos_sin_cache(layer.head_dim, max_positions, layer.rope_theta, layer.rope_scaling)
        self.cos_sin = table.to(device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3T] target hidden states (low | mid | high) -> [n, H]: the first draft step's hidden input."""
        return self.fc(aux)

    def forward(self, input_ids, hidden, positions, kv_cache, meta: AttentionMetadata):
        """(normed, prenorm), both [n, H]: normed feeds compute_logits, prenorm the next step's `hidden`."""
        ops, eps = self.ops, self.eps
        embeds = ops.rmsnorm(self.embed_tokens(input_ids), self.input_layernorm, eps)
        normed_hidden = ops.rmsnorm(hidden, self.hidden_norm, eps)
        qkv = self.self_attn.qkv_proj(torch.cat([embeds, normed_hidden], dim=-1))
        attn = self.self_attn(qkv, positions, self.cos_sin, kv_cache, meta, ops)
        # The residual is the hidden state as it came in, not its normed copy.
        gate_up, residual = ops.add_rmsnorm_linear(attn, hidden, self.post_attention_layernorm, eps,
                                                   self.mlp.gate_up_proj)
        return ops.add_rmsnorm(self.mlp.down_proj(gate_up), residual, self.norm, eps)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[n, draft_vocab] in the model's dtype; to_target maps their argmax to the target's ids."""
        return self.ops.linear(normed, self.lm_head)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def checkpoint_layout(cfg: Eagle3Config, with_embed: bool) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each tensor of the head and the checkpoint tensors stacked row-wise to make it (q/k/v and
    gate/up fused), with their shapes."""
    layer = cfg.layer
    h, q, kv, inter = layer.hidden_size, layer.q_size, layer.kv_size, layer.intermediate_size
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    out = {
        "fc.weight": [("fc.weight", (h, 3 * cfg.target_hidden_size))],
        "input_layernorm": [("midlayer.input_layernorm.weight", (h,))],
        "hidden_norm": [("midlayer.hidden_norm.weight", (h,))],
        "self_attn.qkv_proj.weight": [(attn + "q_proj.weight", (q, 2 * h)), (attn + "k_proj.weight", (kv, 2 * h)),
                                      (attn + "v_proj.weight", (kv, 2 * h))],
        "self_attn.o_proj.weight": [(attn + "o_proj.weight", (h, q))],
        "post_attention_layernorm": [("midlayer.post_attention_layernorm.weight", (h,))],
        "mlp.gate_up_proj.weight": [(mlp + "gate_proj.weight", (inter, h)), (mlp + "up_proj.weight", (inter, h))],
        "mlp.down_proj.weight": [(mlp + "down_proj.weight", (h, inter))],
        "norm": [("norm.weight", (h,))],
        "lm_head": [("lm_head.weight", (cfg.draft_vocab_size, h))],
        "d2t": [("d2t", (cfg.draft_vocab_size,))],
    }
    if with_embed:
        out["embed_tokens.weight"] = [("embed_tokens.weight", (cfg.vocab_size, h))]
    return out


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's weights, on the CPU (a head is small: ~1 GB for Llama 3.1 8B's).
    A pytorch_model.bin is read with weights_only: tensors, never arbitrary pickled objects."""
    bin_file = path / "pytorch_model.bin"
    if bin_file.is_file() and not any(path.glob("*.safetensors")):
        state = torch.load(bin_file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(f"{bin_file}: not a state dict of tensors")
        return state
    from safetensors.torch import load_file

    state = {}
    for file in find_weight_files(path):
        state.update(load_file(file))
    return state


def load_eagle3(path: str | Path, target: DecoderLM, device, dtype: torch.dtype, ops: TorchOps) -> Eagle3Head:
    """The head in `path` for `target` (whose embedding it shares when the checkpoint has none), in dtype on device;
    ValueError naming what does not fit before anything is allocated there."""
    path = Path(path)
    cfg = Eagle3Config.from_dir(path)
    tcfg = target.cfg
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{path}: the head's vocab_size {cfg.vocab_size} is not the target's {tcfg.vocab_size}")
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"{path}: the head reads hidden states of width {cfg.target_hidden_size}, "
                         f"the target's are {tcfg.hidden_size}")
    tensors = read_checkpoint(path)
    shared = "embed_tokens.weight" not in tensors
    if shared and cfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"{path}: no embed_tokens.weight, and the target's embeddings ({tcfg.hidden_size} wide) "
                         f"do not fit the head's hidden_size {cfg.hidden_size}")
    layout = checkpoint_layout(cfg, with_embed=not shared)
    for param, parts in layout.items():
        for name, shape in parts:
            if name not in tensors:
                raise ValueError(f"{path}: missing tensor {name!r} (an EAGLE-3 head needs it)")
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{path}: tensor {name!r} has shape {list(t.shape)}, "
                                 f"config.json implies {list(shape)}")
            if t.dtype.is_floating_point == (param == "d2t"):
                kind = "integer" if param == "d2t" else "floating-point"
                raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected {kind}")
    # A map out of the vocabulary would surface later as an index error on the device, far from its cause.
    mapped = torch.arange(cfg.draft_vocab_size) + tensors["d2t"]
    if mapped.min() < 0 or mapped.max() >= cfg.vocab_size:
        raise ValueError(f"{path}: d2t maps draft ids outside the target's vocabulary of {cfg.vocab_size}")

    device = torch.device(device)
    state = {}
    for param, parts in layout.items():
        whole = torch.cat([tensors[name] for name, _ in parts]) if len(parts) > 1 else tensors[parts[0][0]]
        state[param] = whole.to(device=device, dtype=torch.int64 if param == "d2t" else dtype)
    with torch.device("meta"):
        head = Eagle3Head(cfg, ops)
    if shared:
        head.embed_tokens = None  # no table of its own to fill; the target's is set below
    head.load_state_dict(state, strict=True, assign=True)
    if shared:
        head.embed_tokens = target.embed_tokens
    # The head drafts at the target's positions, whatever max_position_embeddings it was trained with.
    head.init_rope(tcfg.max_model_len, device)
    return head.eval().requires_grad_(False)
