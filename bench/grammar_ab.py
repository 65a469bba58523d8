"""Issue 34's choice of grammar engine: xgrammar against llguidance on this project's tokenizers.

For each tokenizer (SmolLM2-135M's 49k, from its packaged GGUF; the synthetic 128k one the 8B
benchmark model uses) and each library:
  - compile time over a corpus of generated JSON schemas (cold; again with the compiler's cache);
  - the time to fill one next-token bitmask, at batch 1 and over a batch of 256 matchers (the
    libraries' batch fills, which use threads), walking each schema's matcher through allowed tokens;
  - which JSON Schema keywords each one accepts.
Prints one JSON object. Needs `pip install xgrammar llguidance` (not the project's dependencies yet).
Usage: python bench/grammar_ab.py [--schemas 200] [--steps 32] [--libs xgrammar,llguidance]
           [--tokenizers smollm2-49k,synthetic-128k] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from inferno.tools.schema_corpus import schema_corpus

KEYWORDS = {  # one small schema per keyword: does the library accept it?
    "enum": {"enum": ["a", "b", 3]}, "const": {"const": "fixed"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
    "$ref": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}}},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}[0-9]$"},
    "format:date-time": {"type": "string", "format": "date-time"},
    "format:email": {"type": "string", "format": "email"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": -3, "maximum": 90},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "additionalProperties:false": {"type": "object", "properties": {"a": {"type": "string"}},
                                   "additionalProperties": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "minProperties": {"type": "object", "minProperties": 1},
    "type:[list]": {"type": ["string", "null"]},
    "not": {"not": {"type": "string"}},
    "if/then": {"if": {"type": "integer"}, "then": {"minimum": 0}},
}


def tokenizers(names: list[str]) -> dict:
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    from inferno.tools.synthetic_tokenizer import build_tokenizer_json

    out = {}
    if "smollm2-49k" in names:
        from services.packaged_models import fetch
        from shared.tokenizer import Tokenizer

        smol = Tokenizer.from_path(fetch())._tok  # the `tokenizers` backend the GGUF metadata rebuilds
        out["smollm2-49k"] = (PreTrainedTokenizerFast(tokenizer_object=smol), None)
    if "synthetic-128k" in names:  # the 8B benchmark model's
        synth = HFTokenizer.from_str(build_tokenizer_json(128256).tokenizer_json)
        out["synthetic-128k"] = (PreTrainedTokenizerFast(tokenizer_object=synth), 128256)
    return out


class Xgr:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.vocab = self.info.vocab_size

    def compiler(self, cache: bool):
        return self.xgr.GrammarCompiler(self.info, cache_enabled=cache)

    def compile(self, compiler, schema: dict):
        return compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, m, mask, i: int = 0):
        m.fill_next_token_bitmask(mask, i)

    def fill_batch(self, ms, mask):
        if not hasattr(self, "_batch"):
            self._batch = self.xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class Llg:
    name = "llguidance"

    def __init__(self, hf, vocab):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.vocab = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compiler(self, cache: bool):
        return None  # llguidance builds its lexer per matcher, lazily; there is no compiler object

    def compile(self, compiler, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.llg.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def bitmask(self, n: int):
        return self.lt.allocate_token_bitmask(n, self.vocab)

    def fill(self, m, mask, i: int = 0):
        self.lt.fill_next_token_bitmask(m, mask, i)

    def fill_batch(self, ms, mask):
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


def allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ids = bits.reshape(-1)[:vocab].nonzero().flatten()
    return ids.tolist()


def measure(lib, schemas: list[dict], steps: int, rng: random.Random) -> dict:
    cold, warm, failed, compiled = [], [], 0, []
    for s in schemas:
        c = lib.compiler(False)
        t0 = time.perf_counter()
        try:
            g = lib.compile(c, s)
        except Exception:
            failed += 1
            continue
        cold.append(time.perf_counter() - t0)
        compiled.append(g)
    cached = lib.compiler(True)
    for s in schemas[:50]:
        try:
            lib.compile(cached, s)
        except Exception:
            continue
        t0 = time.perf_counter()
        lib.compile(cached, s)
        warm.append(time.perf_counter() - t0)
    # Batch 1: one matcher walked through allowed tokens (a random pick each step).
    one, mask = [], lib.bitmask(1)
    for g in compiled[:40]:
        m = lib.matcher(g)
        for _ in range(steps):
            t0 = time.perf_counter()
            lib.fill(m, mask)
            one.append(time.perf_counter() - t0)
            ids = allowed(mask[0], lib.vocab)
            if not ids or not lib.accept(m, rng.choice(ids)) or lib.done(m):
                break
    # Batch 256: the library's batch fill over 256 matchers of different schemas, a few steps each.
    batch, masks = [], lib.bitmask(256)
    ms = [lib.matcher(compiled[i % len(compiled)]) for i in range(256)]
    for _ in range(min(steps, 8)):
        t0 = time.perf_counter()
        lib.fill_batch(ms, masks)
        batch.append(time.perf_counter() - t0)
        for i, m in enumerate(ms):
            ids = allowed(masks[i], lib.vocab)
            if ids:
                lib.accept(m, rng.choice(ids))
            if lib.done(m):  # a finished matcher has no next mask: start it again
                m.reset()
    keywords = {}
    for k, s in KEYWORDS.items():
        try:
            lib.compile(lib.compiler(False), s)
            keywords[k] = True
        except Exception:
            keywords[k] = False
    q = statistics.quantiles
    return {"compile_cold_ms": {"p50": 1e3 * statistics.median(cold), "p99": 1e3 * q(cold, n=100)[98],
                                "failed": failed, "of": len(schemas)},
            "compile_cached_ms_p50": 1e3 * statistics.median(warm) if warm else None,
            "mask_b1_us": {"p50": 1e6 * statistics.median(one), "p99": 1e6 * q(one, n=100)[98], "fills": len(one)},
            "mask_b256_us_per_step": {"p50": 1e6 * statistics.median(batch), "max": 1e6 * max(batch)},
            "keywords_accepted": sum(keywords.values()), "keywords_refused": [k for k, v in keywords.items() if not v]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=200)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--libs", default="xgrammar,llguidance")
    ap.add_argument("--tokenizers", default="smollm2-49k,synthetic-128k")
    ap.add_argument("--out")
    args = ap.parse_args()
    schemas = schema_corpus(args.schemas)
    torch.set_num_threads(1)
    result = {"schemas": len(schemas), "keywords": len(KEYWORDS)}
    libs = [cls for cls in (Xgr, Llg) if cls.name in args.libs.split(",")]
    for tname, (hf, vocab) in tokenizers(args.tokenizers.split(",")).items():
        for cls in libs:
            lib = cls(hf, vocab)
            result[f"{cls.name}/{tname}"] = measure(lib, schemas, args.steps, random.Random(0))
            print(cls.name, tname, json.dumps(result[f"{cls.name}/{tname}"]), flush=True)
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
