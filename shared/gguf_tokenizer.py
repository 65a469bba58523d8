"""The tokenizer a GGUF file describes in its metadata, rebuilt as a `tokenizers` Tokenizer.

A GGUF has no tokenizer.json: it stores the vocabulary, the merges (or sentencepiece scores), the
token types and the special ids under llama.cpp's keys. Two families cover the architectures we
serve: `gpt2` (byte-level BPE: Llama 3, Qwen2/3, SmolLM) and `llama` (sentencepiece BPE with
byte fallback: Llama 2, Mistral). The text split before BPE depends on how the merges were
learnt, which the file names in `tokenizer.ggml.pre`; the table below follows llama.cpp's.
"""

from __future__ import annotations

from shared.byte_alphabet import byte_alphabet
from shared.gguf_file import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre → the regexes applied in turn before byte-level BPE. An unknown name gets
# GPT-2's split, as in llama.cpp's "default".
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # digits one by one, as SmolLM's own tokenizer.json
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


def build_gguf_tokenizer(gf: GGUFFile):
    """(tokenizers.Tokenizer, tokenizer_config dict, generation_config dict) for this file."""
    kind = gf.get("tokenizer.ggml.model")
    tokens = gf.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{gf.path}: no tokenizer in the metadata (tokenizer.ggml.tokens is missing)")
    if kind == "gpt2":
        backend, add_bos = _byte_level_bpe(gf, tokens), bool(gf.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        # Older sentencepiece files say nothing; llama.cpp and transformers then add BOS.
        backend, add_bos = _sentencepiece_bpe(gf, tokens), bool(gf.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise GGUFError(f"{gf.path}: unsupported GGUF tokenizer {kind!r}; supported: gpt2, llama")
    _add_special_tokens(backend, gf, tokens, byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        i = gf.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    cfg = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
           "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
           "add_bos_token": add_bos, "chat_template": gf.get("tokenizer.chat_template")}
    _set_post_processor(backend, cfg["bos_token"] if add_bos else None, gf.get("tokenizer.ggml.bos_token_id"))
    # End of generation: eos, and the end-of-turn / end-of-message ids llama.cpp also stops on.
    stops = [gf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    gen = {"eos_token_id": [i for i in dict.fromkeys(stops) if isinstance(i, int)]}
    return backend, {k: v for k, v in cfg.items() if v is not None}, gen


def _byte_level_bpe(gf: GGUFFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_alphabet()
    spelt = set(alphabet.values())
    # Byte-level vocabularies are written in the byte alphabet; a token that is not (some control
    # tokens) is spelt from its UTF-8 bytes so the BPE model can hold it.
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t if set(t) <= spelt else "".join(alphabet[b] for b in t.encode()), i)
    merges = [tuple(m.split(" ", 1)) for m in gf.get("tokenizer.ggml.merges") or ()]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = gf.get("tokenizer.ggml.pre") or "default"
    splits = PRE_TOKENIZER_SPLITS.get(pre, PRE_TOKENIZER_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(gf: GGUFFile, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    merges = gf.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_scores(
        tokens, gf.get("tokenizer.ggml.scores") or [0.0] * len(tokens), vocab)
    unk = gf.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if isinstance(unk, int) else None,
                               fuse_unk=True, byte_fallback=True))
    prefix = "first" if gf.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prefix, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix == "first":
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Sentencepiece files keep scores, not merges: every split of a token into two known tokens is
    a merge, ranked by the merged token's score (best first), then by the parts' ids."""
    found = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((score, len(left), len(right), left, right) for left, right in pairs)
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in found]


def _add_special_tokens(tok, gf: GGUFFile, tokens: list[str], byte_level: bool) -> None:
    """Control tokens (<|im_start|>...) are matched whole and are special; user-defined ones
    (<think>...) are matched whole but kept in decoded text, as llama.cpp does."""
    from tokenizers import AddedToken

    types = gf.get("tokenizer.ggml.token_type") or ()
    spelt = set(byte_alphabet().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == CONTROL and (spelt is None or set(t) <= spelt)]
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _set_post_processor(tok, bos: str | None, bos_id: int | None) -> None:
    from tokenizers import processors

    if bos is None or not isinstance(bos_id, int):
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
