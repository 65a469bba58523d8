"""A Hugging Face tokenizer directory behind a small interface: encode, decode, stop ids, chat template.

`Tokenizer.from_dir(model_dir)` reads tokenizer.json (through the `tokenizers` library),
tokenizer_config.json (special tokens, chat template) and, when present, generation_config.json
and config.json (end-of-sequence ids). Behaviour follows transformers' tokenizers backend:

- `encode(text, add_special_tokens=True)` runs tokenizer.json's post-processor, which for
  Llama-3-style tokenizers prepends <|begin_of_text|>. A rendered chat template already starts
  with bos, so encode a prompt made by `apply_chat_template` with add_special_tokens=False (as
  transformers' `apply_chat_template(tokenize=True)` does; `encode_chat` does both). As in
  transformers 5, tokenizer.json's post-processor alone decides: add_bos_token / add_eos_token
  in tokenizer_config.json are not consulted.
- Special tokens written in the text (e.g. "<|eot_id|>") are matched as special tokens.
- `decode` never applies clean_up_tokenization_spaces (transformers skips it for BPE too).
- Ids the tokenizer does not know (the padding between its size and the model's vocab_size)
  decode to nothing; `id_to_token` gives None for them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from shared.byte_alphabet import byte_translation
from shared.chat_template import ChatTemplateError, render_chat_template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer file is unreadable or inconsistent."""


class TokenizerFileNotFound(TokenizerError, FileNotFoundError):
    """A required tokenizer file is missing; the message names it."""


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise TokenizerFileNotFound(f"{path} not found: a model directory needs {path.name} for its tokenizer")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_content(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    def __init__(self, backend, tokenizer_config: dict, generation_config: dict | None = None,
                 model_config: dict | None = None, chat_templates: dict[str, str] | None = None,
                 source: str = "tokenizer"):
        self._tok = backend
        self._source = source
        self._tok.no_truncation()
        self._tok.no_padding()
        cfg = tokenizer_config
        self.tokenizer_config = cfg
        self.special_tokens_map: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(cfg.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.pad_token = self.special_tokens_map.get("pad_token")

        gen = generation_config or {}
        mcfg = model_config or {}
        self.bos_token_id: int | None = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.bos_token_id is None:
            ids = _id_list(gen.get("bos_token_id")) or _id_list(mcfg.get("bos_token_id"))
            self.bos_token_id = ids[0] if ids else None
        self.eos_token_id: int | None = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        eos: list[int] = _id_list(gen.get("eos_token_id")) or _id_list(mcfg.get("eos_token_id"))
        if self.eos_token_id is not None and self.eos_token_id not in eos:
            eos.append(self.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        if self.eos_token_id is None and self.eos_token_ids:
            self.eos_token_id = self.eos_token_ids[0]
        self.pad_token_id: int | None = self._tok.token_to_id(self.pad_token) if self.pad_token else None

        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.model_max_length: int | None = cfg.get("model_max_length") if isinstance(
            cfg.get("model_max_length"), int) else None

        decoder = json.loads(self._tok.decoder.__getstate__()) if self._tok.decoder is not None else {}
        self._byte_level = _is_byte_level(decoder)
        self._bytes_cache: dict[int, bytes] = {}
        self._text_cache: dict[int, str | None] = {}

        if chat_templates is None:
            chat_templates = _templates_from_config(cfg)
        self.chat_templates: dict[str, str] = chat_templates

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_path(cls, path: str | Path) -> "Tokenizer":
        """A model directory, or a .gguf file whose metadata holds the tokenizer and chat template."""
        from shared.gguf_file import GGUFError, is_gguf, open_gguf
        from shared.gguf_tokenizer import build_gguf_tokenizer

        if not is_gguf(path):
            return cls.from_dir(path)
        try:
            backend, cfg, gen = build_gguf_tokenizer(open_gguf(path))
        except GGUFError as e:
            raise TokenizerError(str(e)) from e
        return cls(backend, cfg, gen, None, source=str(path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        if not d.is_dir():
            raise TokenizerFileNotFound(f"{d} is not a directory")
        tok_path = d / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerFileNotFound(
                f"{tok_path} not found: a model directory needs tokenizer.json (the fast-tokenizer format)")
        try:
            backend = HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{tok_path} cannot be loaded: {e}") from e
        cfg = _read_json(d / "tokenizer_config.json", required=True)
        gen = _read_json(d / "generation_config.json", required=False)
        mcfg = _read_json(d / "config.json", required=False)
        templates = _templates_from_files(d)
        return cls(backend, cfg, gen, mcfg, chat_templates=templates or None, source=str(d))

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    # ---------------------------------------------------------------- tokens, for logprobs

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry (e.g. "Ġhello"); None for an id the tokenizer does not know."""
        if not isinstance(token_id, int) or token_id < 0:
            return None
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (b"" for an unknown id): the OpenAI logprobs `bytes`.

        Byte-level BPE maps each character back to a byte; SentencePiece-style vocabularies turn
        "▁" into a space and <0xNN> into that byte. Special tokens give their text."""
        tok = self.id_to_token(token_id)
        if tok is None:
            return b""
        if token_id in self.all_special_ids:
            return tok.encode("utf-8")
        if self._byte_level:
            try:
                return tok.translate(byte_translation()).encode("latin-1")
            except UnicodeEncodeError:
                return tok.encode("utf-8")  # an added token outside the byte alphabet
        m = _BYTE_FALLBACK.match(tok)
        if m:
            return bytes([int(m.group(1), 16)])
        return tok.replace("\u2581", " ").encode("utf-8")

    @property
    def is_byte_level(self) -> bool:
        return self._byte_level

    def warm_token_tables(self) -> None:
        """Fill the streaming detokenizer's caches for every id of the vocabulary at once (the
        gateway does this at start), so no token is a miss while serving, whatever a model draws
        (random weights draw from the whole vocabulary: W2 spent 10 % of the gateway's CPU on
        misses). About 0.1 s for SmolLM2's 49k ids on the 2-core VM."""
        for token_id in range(self.vocab_size):
            self.cached_token_text(token_id)  # fills the bytes cache too

    def cached_token_bytes(self, token_id: int) -> bytes:
        """token_bytes through a per-tokenizer cache: the streaming detokenizer's hot path."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            b = self._bytes_cache[token_id] = self.token_bytes(token_id)
        return b

    def cached_token_text(self, token_id: int) -> str | None:
        """The token's bytes as text when they are complete UTF-8 on their own, else None (cached)."""
        try:
            return self._text_cache[token_id]
        except KeyError:
            try:
                text = self.cached_token_bytes(token_id).decode("utf-8")
            except UnicodeDecodeError:
                text = None
            self._text_cache[token_id] = text
            return text

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens kept); may hold U+FFFD for a partial
        UTF-8 sequence, which is why logprobs also carry token_bytes."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    # ---------------------------------------------------------------- chat

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ChatTemplateError(
                f"{self._source} has several chat templates and none named 'default': "
                f"{', '.join(sorted(self.chat_templates))}")
        raise ChatTemplateError(
            f"{self._source} has no chat template (no chat_template in tokenizer_config.json "
            "and no chat_template.jinja)")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None,
                            chat_template: str | None = None, **kwargs) -> str:
        """The prompt text, identical to transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=..., tools=...)`.

        Encode the result with add_special_tokens=False: the template writes bos itself."""
        template = self.get_chat_template(chat_template, tools)
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, special_tokens=self.special_tokens_map, **kwargs)

    def encode_chat(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> list[int]:
        """apply_chat_template, then encode without adding special tokens (as transformers)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs),
                           add_special_tokens=False)


def _is_byte_level(decoder: dict) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return False


def _templates_from_config(cfg: dict) -> dict[str, str]:
    raw = cfg.get("chat_template")
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
        out = {}
        for item in raw:
            if isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str):
                out[item["name"]] = item["template"]
        return out
    if isinstance(raw, Mapping):
        return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def _templates_from_files(d: Path) -> dict[str, str]:
    """chat_template.jinja and additional_chat_templates/*.jinja, which override the config's."""
    out: dict[str, str] = {}
    f = d / "chat_template.jinja"
    if f.is_file():
        out["default"] = f.read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for p in sorted(extra.glob("*.jinja")):
            out[p.stem] = p.read_text(encoding="utf-8")
    return out
