"""The model's shape, read from a Hugging Face config.json (or a GGUF's metadata) and checked before anything is built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.worker.engine import config_families as families
# The parts, importable from here as before.
from services.worker.engine.model_parts import (DEEPSEEK_ARCHITECTURES, Llama4Config, MLAConfig,  # noqa: F401
                                                 ModelConfigError, MoEConfig, RopeFreqFactors, RopeScaling,
                                                 YarnScaling)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Llama4ForCausalLM",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | RopeFreqFactors | YarnScaling | None = None
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    qk_norm_whole: bool = False  # OLMoE: the RMSNorm spans all of q (and all of k), not each head
    clip_qkv: float | None = None  # OLMoE's optional clamp of q, k and v
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    llama4: Llama4Config | None = None
    # DeepSeek-V3's multi-token-prediction layers after the last (num_nextn_predict_layers): not
    # loaded (speculation here has its own drafters); the loader says so.
    mtp_layers: int = 0
    sliding_window: int | None = None
    torch_dtype: str = "bfloat16"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """The rotated width of a head: all of it, or MLA's rotary part."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} not found: a model directory needs a config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """A model directory, or a .gguf file whose metadata stands in for config.json."""
        from shared.gguf_file import is_gguf

        if is_gguf(path):
            from services.worker.engine.gguf_config import config_from_gguf
            from shared.gguf_file import open_gguf

            return cls.from_dict(config_from_gguf(open_gguf(path)), source=str(path))
        return cls.from_dir(path)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelConfigError(f"{source}: 'architectures' is missing")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str, kind: type):
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"{source}: required field {key!r} is missing")
            value = raw[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise ModelConfigError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
            return value

        hidden = need("hidden_size", int)
        heads = need("num_attention_heads", int)
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or (hidden // heads if heads else 0)
        mla = families.mla_config(arch, raw, source)
        if mla is not None:  # a query/key head is the no-rope part and the rotary part (config's head_dim: the latter)
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        for key, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                           ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        if head_dim % 2:
            raise ModelConfigError(f"{source}: head_dim ({head_dim}) must be even for rotary embeddings")

        # transformers 5 writes rope settings under "rope_parameters"; older files at the top level.
        rope = raw.get("rope_parameters") or {}
        num_layers = need("num_hidden_layers", int)
        llama4 = families.llama4_config(arch, raw, num_layers, source)
        scaling = None
        rs = raw.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        if rs:
            kind = rs.get("rope_type") or rs.get("type")
            if kind == "llama3":
                try:
                    scaling = RopeScaling(
                        factor=float(rs["factor"]),
                        low_freq_factor=float(rs["low_freq_factor"]),
                        high_freq_factor=float(rs["high_freq_factor"]),
                        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    )
                except KeyError as e:
                    raise ModelConfigError(f"{source}: rope_scaling of type llama3 lacks {e.args[0]!r}") from e
            elif kind == "yarn":
                scaling = families.yarn(rs, raw, source)
            elif kind not in (None, "default"):
                raise ModelConfigError(f"{source}: unsupported rope_scaling type {kind!r} (supported: llama3, yarn)")
        if raw.get("rope_freq_factors"):
            factors = tuple(float(f) for f in raw["rope_freq_factors"])
            if len(factors) != head_dim // 2:
                raise ModelConfigError(
                    f"{source}: rope_freq_factors has {len(factors)} entries, head_dim {head_dim} needs {head_dim // 2}")
            scaling = RopeFreqFactors(factors)

        bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and raw.get("qkv_bias", True)
        if not bias and (raw.get("attention_bias") or raw.get("mlp_bias")) and mla is None:
            raise ModelConfigError(f"{source}: attention_bias / mlp_bias are not supported for {arch}")
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        cfg = cls(
            architecture=arch,
            vocab_size=need("vocab_size", int),
            hidden_size=hidden,
            # Llama 4's intermediate_size is each expert's; its dense layers' is intermediate_size_mlp.
            intermediate_size=need("intermediate_size_mlp" if llama4 else "intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5 if llama4 else 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or (500000.0 if llama4 else 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            attention_bias=bool(bias),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            qk_norm_whole=arch == "OlmoeForCausalLM",
            clip_qkv=float(raw["clip_qkv"]) if arch == "OlmoeForCausalLM" and raw.get("clip_qkv") else None,
            moe=families.moe_config(arch, raw, num_layers, source),
            mla=mla,
            llama4=llama4,
            mtp_layers=int(raw.get("num_nextn_predict_layers") or 0) if mla is not None else 0,
            sliding_window=sliding if isinstance(sliding, int) else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        )
        for key in ("vocab_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings"):
            if getattr(cfg, key) <= 0:
                raise ModelConfigError(f"{source}: {key} must be positive")
        return cfg

    @property
    def mlp_activation_width(self) -> int:
        """Activation elements per token of a layer's MLP at its widest: the dense MLP's [gate | up]
        and SiLU output, or the experts' (each of the top-k's SiLU output and down-projected row,
        the router's logits; its scaled input where the weight scales the input) and a shared expert's."""
        dense = 3 * self.intermediate_size
        if self.moe is None:
            return dense
        moe = self.moe
        sparse = moe.top_k * (moe.intermediate_size + self.hidden_size) + moe.num_experts + (
            3 * moe.shared_intermediate_size) + moe.scale_inputs * moe.top_k * self.hidden_size
        return sparse if len(moe.sparse_layers) == self.num_hidden_layers else max(dense, sparse)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (of the whole model) has experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def max_model_len(self) -> int:
        """Longest sequence we serve: a sliding window shorter than the context caps it,
        since the engine keeps full attention (exact within the window)."""
        if self.sliding_window and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings
