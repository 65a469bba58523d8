"""Write a random-weight model in Hugging Face format: config, safetensors shards, tokenizer.

Nothing in this project can download weights or tokenizers, so the tests, the demo and the
benchmarks run on models written here. Everything is deterministic: the same arguments give
byte-identical files (weights are drawn tensor by tensor from a generator seeded with the run's
seed and the tensor's name, and the tokenizer is trained on a corpus embedded in this module).

The output loads in `transformers.AutoModelForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` with no missing or unexpected keys.

Memory stays at one tensor at a time: the safetensors files are written by hand (header first,
then each tensor's bytes as soon as it is generated), so the 16 GB Llama-3.1-8B preset streams
to disk on a machine with little memory. `device="cuda"` draws the numbers on the GPU, which is
much faster; CUDA and CPU generators differ, so files are byte-identical per device, not across.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Model shapes. vocab_size None means: the tokenizer's size rounded up to a multiple of 64."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"  # used when write_model gets arch=None
    # Used instead of rope_scaling when the architecture is LlamaForCausalLM: lets the tiny Llama
    # exercise Llama-3.1's frequency scaling while the other tiny architectures keep plain RoPE.
    llama_rope_scaling: dict | None = None

    def rope_scaling_for(self, arch: str) -> dict | None:
        if arch == "LlamaForCausalLM" and self.llama_rope_scaling is not None:
            return dict(self.llama_rope_scaling)
        return dict(self.rope_scaling) if self.rope_scaling else None


PRESETS: dict[str, Preset] = {
    # Tests and the demo: fast on CPU. As a Llama it has llama3 rope scaling, scaled down so
    # that its 8 frequencies fall in all three bands (kept: wavelength < 64, blended: 64..256,
    # divided by the factor: > 256).
    "tiny": Preset(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=None, max_position_embeddings=2048,
        rope_theta=10000.0,
        llama_rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_type": "llama3",
        },
    ),
    # A mid-size CPU benchmark model (~0.1 B parameters).
    "small": Preset(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1536, vocab_size=32000, max_position_embeddings=8192,
        rope_theta=10000.0,
    ),
    # Exact Llama-3.1-8B shapes.
    "llama-3.1-8b": Preset(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-7B shapes (q/k/v bias).
    "qwen2.5-7b": Preset(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        head_dim=128, intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        architecture="Qwen2ForCausalLM",
    ),
    # Qwen3-8B shapes (q/k norms, explicit head_dim).
    "qwen3-8b": Preset(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        architecture="Qwen3ForCausalLM",
    ),
}

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {
    # name: (torch dtype attribute, safetensors dtype, bytes per element)
    "bfloat16": ("bfloat16", "BF16", 2),
    "float16": ("float16", "F16", 2),
    "float32": ("float32", "F32", 4),
}

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's "5GB"
INIT_STD = 0.02
NORM_NOISE_STD = 0.1  # norm weights are 1 + N(0, 0.1): not the identity
BIAS_STD = 0.02
_CHUNK_ELEMENTS = 1 << 24  # numbers drawn per call: bounds the float32 scratch to 64 MiB

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

# Llama-3.1's first special tokens, in its order; they take the ids after the BPE vocabulary.
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"  # an instruct model's end of turn, as in Llama-3.1-Instruct
GENERATION_EOS_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")

BPE_VOCAB_SIZE = 1000  # target, alphabet of 256 bytes included; the corpus may yield fewer merges

# Llama 3's pre-tokenizer split (tiktoken cl100k): contractions, words, 1-3 digit groups,
# punctuation runs, newlines, spaces.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- content | tojson -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got ' + part['type'] | string) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none and content is defined -%}
        {{- content | string -}}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = render_content(messages[0]['content']) | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
    {{- 'Environment: ipython\\n\\n' }}
    {{- 'You have access to the following functions. To call a function, respond with JSON of the form ' }}
    {{- '{"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
    {%- if system_message %}
        {{- system_message }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- elif system_message is not none %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception('Unknown message role: ' + message['role'] | string) }}
    {%- endif %}
    {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
    {{- render_content(message['content']) | trim }}
    {%- if message['role'] == 'assistant' and message['tool_calls'] %}
        {%- for tool_call in message['tool_calls'] %}
            {%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}
            {{- '{"name": "' + call['name'] + '", "parameters": ' }}
            {%- if call['arguments'] is string %}
                {{- call['arguments'] }}
            {%- else %}
                {{- call['arguments'] | tojson }}
            {%- endif %}
            {{- '}' }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# The training corpus: varied English prose, code, numbers and a little non-English text.
# Changing it changes every generated tokenizer (and so every model's vocabulary).
CORPUS = r'''
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness. Call me Ishmael. Some years ago, never mind how long precisely, having little or no money
in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world.

Hello! How are you today? I'm fine, thanks. What's the weather like where you are? It's sunny here,
but they said it'll rain tomorrow. We've been waiting for the train since ten o'clock; they're late again.
Please answer the question in one short sentence. The assistant should be helpful, honest and harmless.
You are a helpful assistant. Summarize the following text. Translate this sentence into French.
Write a short poem about the sea. Explain how a transformer language model works, step by step.

The model reads a prompt, splits it into tokens, and predicts the next token again and again. Each
token attends to every earlier token through the attention layers; the keys and values of earlier
tokens are kept in a cache so that they are computed only once. Serving many requests at the same time
means batching them together, scheduling the work fairly, and sharing memory between requests that
begin with the same prefix. Latency is the time to the first token and the time between tokens;
throughput is the number of tokens produced per second across all requests.

Science and history: Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees. The
speed of light is about 299,792,458 metres per second. The Earth orbits the Sun once every 365.25 days,
and the Moon orbits the Earth roughly every 27.3 days. In 1969, Apollo 11 landed on the Moon. The
French Revolution began in 1789; the Second World War ended in 1945. Mount Everest is 8,849 metres high.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 32 42 50 64 99 100 128 256 512 1000
1024 2048 4096 8192 65536 3.14159 2.71828 1.41421 -7 +3 1e-5 0.02 12:30 2024-07-26 50% $19.99 #1 (555) 010-4477

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import json
data = {"name": "Ada", "age": 36, "languages": ["python", "rust", "c++"], "active": True}
print(json.dumps(data, indent=2))

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message;
}

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 3; i++) {
        printf("%d\n", i);
    }
    return 0;
}

SELECT id, name, created_at FROM users WHERE age >= 18 ORDER BY created_at DESC LIMIT 10;
$ git commit -m "Fix the bug" && git push origin main
<html><body><h1>Title</h1><p>A paragraph with <a href="https://example.com">a link</a>.</p></body></html>
{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": true}

Questions and answers. Q: What is the capital of France? A: Paris. Q: Who wrote Hamlet? A: William
Shakespeare. Q: What is two plus two? A: Four. Q: Which planet is known as the red planet? A: Mars.
Once upon a time there was a little girl who lived in a village near the forest. Whenever she went
out, the little girl wore a red riding cloak, so everyone in the village called her Little Red Riding
Hood. One morning she asked her mother if she could go to visit her grandmother, as it had been a while.

Other languages: Bonjour, comment ça va ? Très bien, merci. Ich möchte einen Kaffee, bitte. ¿Dónde está
la estación? El niño comió una manzana. Naïve café résumé façade coöperate. Привет, как дела? Спасибо.
こんにちは、世界。日本語の文章です。你好，世界！我们今天去公园吧。안녕하세요. Γειά σου κόσμε. مرحبا بالعالم.
Symbols and emoji: → ← ↑ ↓ ✓ ✗ € £ ¥ © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ π Σ λ µ 😀 😂 👍 🎉 🚀 ❤️ 🤖 🌍
'''


@dataclass(frozen=True)
class _TokenizerFiles:
    tokenizer_json: str
    special_ids: dict[str, int]
    size: int  # with the added special tokens


_TOKENIZER_CACHE: dict[int | None, _TokenizerFiles] = {}


def build_tokenizer_json(vocab_size: int | None = None) -> _TokenizerFiles:
    """Train the byte-level BPE on CORPUS (deterministic; cached per process).

    With vocab_size, the vocabulary is filled up to it, as a real tokenizer covers its whole
    embedding table: every id past the trained BPE tokens gets a token of its own ("<1234>"),
    and the special tokens take the last ids. Random weights sample such ids all the time, and
    they must stream as visible text. The split pattern cuts "<", digits and ">" apart, so
    encoding never produces the fillers.
    """
    if vocab_size in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[vocab_size]
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))  # as Llama 3: whole words in the vocab skip merges
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any UTF-8 text encodes
    )
    tok.train_from_iterator([line for line in CORPUS.splitlines(keepends=True)], trainer=trainer)
    if vocab_size is not None:
        doc = json.loads(tok.to_str())
        vocab = doc["model"]["vocab"]
        for i in range(len(vocab), vocab_size - len(SPECIAL_TOKENS)):
            vocab[f"<{i}>"] = i
        tok = Tokenizer.from_str(json.dumps(doc))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    bos_id = special_ids[BOS_TOKEN]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0",
            pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, bos_id)],
        ),
    ])
    _TOKENIZER_CACHE[vocab_size] = _TokenizerFiles(
        tokenizer_json=tok.to_str(pretty=True),
        special_ids=special_ids,
        size=tok.get_vocab_size(with_added_tokens=True),
    )
    return _TOKENIZER_CACHE[vocab_size]


def _tokenizer_config(tf: _TokenizerFiles, model_max_length: int) -> dict:
    added = {
        str(tf.special_ids[t]): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def model_config_dict(arch: str, preset: Preset, vocab_size: int, dtype: str, tied: bool,
                      bos_token_id: int, eos_token_ids: list[int]) -> dict:
    """config.json as transformers writes it for `arch` (keys sorted, as save_pretrained does)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    model_type = ARCHITECTURES[arch]
    if model_type == "qwen2" and preset.hidden_size != preset.num_attention_heads * preset.head_dim:
        # Qwen2's config has no head_dim: it is always hidden_size / num_attention_heads.
        raise ValueError("Qwen2ForCausalLM needs hidden_size == num_attention_heads * head_dim")
    cfg: dict = {
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "model_type": model_type,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": preset.rope_scaling_for(arch),
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "transformers_version": "4.45.0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if model_type == "llama":
        cfg.update(attention_bias=False, head_dim=preset.head_dim, mlp_bias=False, pretraining_tp=1)
    elif model_type == "mistral":
        cfg.update(head_dim=preset.head_dim, sliding_window=None)
    elif model_type == "qwen2":
        cfg.update(max_window_layers=preset.num_hidden_layers, sliding_window=None,
                   use_sliding_window=False)
    elif model_type == "qwen3":
        cfg.update(attention_bias=False, head_dim=preset.head_dim,
                   max_window_layers=preset.num_hidden_layers, sliding_window=None,
                   use_sliding_window=False)
    return dict(sorted(cfg.items()))


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "weight" N(0, 0.02) | "norm" 1 + N(0, 0.1) | "bias" N(0, 0.02)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_specs(arch: str, preset: Preset, vocab_size: int, tied: bool) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in Hugging Face's state-dict order."""
    model_type = ARCHITECTURES[arch]
    h, hd = preset.hidden_size, preset.head_dim
    q, kv, inter = preset.num_attention_heads * hd, preset.num_key_value_heads * hd, preset.intermediate_size
    specs = [TensorSpec("model.embed_tokens.weight", (vocab_size, h), "weight")]
    for i in range(preset.num_hidden_layers):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "self_attn.q_proj.weight", (q, h), "weight"))
        if model_type == "qwen2":
            specs.append(TensorSpec(p + "self_attn.q_proj.bias", (q,), "bias"))
        specs.append(TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "weight"))
        if model_type == "qwen2":
            specs.append(TensorSpec(p + "self_attn.k_proj.bias", (kv,), "bias"))
        specs.append(TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "weight"))
        if model_type == "qwen2":
            specs.append(TensorSpec(p + "self_attn.v_proj.bias", (kv,), "bias"))
        specs.append(TensorSpec(p + "self_attn.o_proj.weight", (h, q), "weight"))
        if model_type == "qwen3":
            specs.append(TensorSpec(p + "self_attn.q_norm.weight", (hd,), "norm"))
            specs.append(TensorSpec(p + "self_attn.k_norm.weight", (hd,), "norm"))
        specs.append(TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "weight"))
        specs.append(TensorSpec(p + "mlp.up_proj.weight", (inter, h), "weight"))
        specs.append(TensorSpec(p + "mlp.down_proj.weight", (h, inter), "weight"))
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "norm"))
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"))
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not tied:
        specs.append(TensorSpec("lm_head.weight", (vocab_size, h), "weight"))
    return specs


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


def _safetensors_header(specs: list[TensorSpec], st_dtype: str, elem_bytes: int) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        nbytes = spec.numel * elem_bytes
        header[spec.name] = {"dtype": st_dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _write_shard(path: Path, specs: list[TensorSpec], seed: int, dtype: str, device: str) -> None:
    _, st_dtype, elem_bytes = DTYPES[dtype]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_safetensors_header(specs, st_dtype, elem_bytes))
        for spec in specs:
            t = generate_tensor(spec, seed, dtype, device)
            f.write(_tensor_bytes(t))
            del t
    os.replace(tmp, path)


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
) -> Path:
    """Write a random-weight model directory; return its path.

    arch: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM; None takes
    the preset's own (LlamaForCausalLM for tiny, small and llama-3.1-8b).
    tie_word_embeddings: None takes the preset's default (untied for all built-in presets).
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
    vocab_size = p.vocab_size if p.vocab_size is not None else _round_up(tf.size, 64)
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

    specs = tensor_specs(arch, p, vocab_size, tied)
    elem_bytes = DTYPES[dtype][2]
    shards = plan_shards(specs, elem_bytes, max_shard_bytes)
    if len(shards) == 1:
        _write_shard(out / "model.safetensors", shards[0], seed, dtype, device)
        if progress:
            print(f"wrote {out / 'model.safetensors'}", file=sys.stderr)
    else:
        n = len(shards)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            _write_shard(out / name, shard, seed, dtype, device)
            weight_map.update({spec.name: name for spec in shard})
            if progress:
                print(f"wrote {out / name}", file=sys.stderr)
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
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None, help="tie lm_head to the embeddings")
    tie.add_argument("--untied", dest="tied", action="store_false", help="separate lm_head (the default)")
    ap.add_argument("--max-shard-bytes", type=_parse_size, default=None,
                    help="largest safetensors shard (default 5GB); accepts 500MB, 2GiB, ...")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the random numbers are drawn")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = write_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype,
                          tie_word_embeddings=args.tied, max_shard_bytes=args.max_shard_bytes,
                          device=args.device, progress=not args.quiet)
    except (ValueError, RuntimeError) as e:
        print(f"make-model: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
