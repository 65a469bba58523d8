"""The synthetic tokenizer of random-weight models: a byte-level BPE trained on an embedded
corpus, Llama-3.1's special tokens, a Llama-3-style chat template. Deterministic."""

from __future__ import annotations

import json
from dataclasses import dataclass


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
