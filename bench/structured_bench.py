"""Issue 34's structured-output benchmark helpers (bench/structured_gpu.sh runs them):

    python bench/structured_bench.py schemas DIR   # DIR/one.json (a schema), DIR/sixteen.json (16)
    python bench/structured_bench.py valid URL [--requests 128] [--out FILE]
    python bench/structured_bench.py jump MODEL [--device cuda] [--out FILE]

`schemas`: W2's schemas. Each is an object whose "rows" array needs 500 items, so a W2 answer never
ends before its max_tokens: constrained and unconstrained runs make the same tokens, and their tok/s
compare. They differ in what the rows hold (enums, bounded integers, numbers, booleans, short
strings, a nested object), hence in how many tokens each step's mask allows.

`jump`: jump-forward at batch 1, in-process: one request at a time under each of four schemas of
fixed keys (a person, an order, an event, a sensor reading), greedy, asked through the model's chat
template; forwards per output token and decode tok/s with --jump-forward 16 against plain constrained
decoding (with overlapped steps on a GPU, as a worker runs it), and whether the answers are the same.

`valid`: answers that end under bounded schemas (inferno.tools.schema_corpus, bounded=True) through
/v1/chat/completions, greedy and sampled; every one that stops must validate (jsonschema).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

FIELD_KINDS = ("enum", "integer", "number", "boolean", "string", "object")


def _field(kind: str, rng: random.Random) -> dict:
    if kind == "enum":
        return {"enum": [f"v{rng.randrange(1000)}" for _ in range(rng.randint(3, 6))]}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice((9, 99, 9999))}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice((8, 16, 24))}
    return {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y", "z"]}},
            "required": ["a", "b"], "additionalProperties": False}


def w2_schemas(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kinds = [FIELD_KINDS[(i + j) % len(FIELD_KINDS)] for j in range(rng.randint(2, 5))]
        props = {f"f{j}_{k}": _field(k, rng) for j, k in enumerate(kinds)}
        row = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
        out.append({"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                                     "rows": {"type": "array", "items": row, "minItems": 500}},
                    "required": ["title", "rows"], "additionalProperties": False})
    return out


async def _valid(url: str, requests: int) -> dict:
    import aiohttp
    import jsonschema

    from inferno.tools.schema_corpus import schema_corpus

    schemas = schema_corpus(16, seed=5, bounded=True)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(i: int) -> tuple[str, bool]:
            schema = schemas[i % len(schemas)]
            body = {"model": model, "max_tokens": 768, "temperature": 0.0 if i % 2 == 0 else 0.8, "seed": i,
                    "messages": [{"role": "user", "content": f"Fill in record {i}."}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                answer = await r.json()
            choice = answer["choices"][0]
            if choice["finish_reason"] != "stop":
                return choice["finish_reason"], False
            try:
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                return "stop", True
            except (ValueError, jsonschema.ValidationError):
                return "stop", False

        results = await asyncio.gather(*(one(i) for i in range(requests)))
    stopped = [ok for reason, ok in results if reason == "stop"]
    return {"requests": requests, "stopped": len(stopped), "valid": sum(stopped),
            "cut_by_length": sum(reason == "length" for reason, _ in results)}


JUMP_SCHEMAS = [
    {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 16},
                                      "last_name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "employed": {"type": "boolean"}},
     "required": ["first_name", "last_name", "age", "employed"], "additionalProperties": False},
    {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                      "status": {"enum": ["pending", "shipped", "delivered"]},
                                      "items": {"type": "array", "maxItems": 3, "items": {
                                          "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                                           "quantity": {"type": "integer", "minimum": 1,
                                                                                        "maximum": 9}},
                                          "required": ["sku", "quantity"], "additionalProperties": False}}},
     "required": ["order_id", "status", "items"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                      "start_time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                                      "location": {"enum": ["office", "home", "remote"]},
                                      "attendees": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["title", "start_time", "location", "attendees"], "additionalProperties": False},
    {"type": "object", "properties": {"sensor_name": {"enum": ["temperature", "humidity", "pressure"]},
                                      "reading_value": {"type": "integer", "minimum": -50, "maximum": 150},
                                      "unit_of_measure": {"enum": ["celsius", "percent", "hectopascal"]},
                                      "is_calibrated": {"type": "boolean"}},
     "required": ["sensor_name", "reading_value", "unit_of_measure", "is_calibrated"],
     "additionalProperties": False},
]


def _jump(model: str, device: str) -> dict:
    import gc
    import time

    import torch

    from services.worker.engine.engine import LLMEngine
    from services.worker.engine.engine_config import EngineConfig
    from services.worker.grammar import Grammars
    from shared.sampling_params import SamplingParams
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_path(model)
    eos = tuple(tok.eos_token_ids)
    results = {}
    answers = {}
    for jf in (0, 16):
        engine = LLMEngine(EngineConfig(model_dir=model, device=device, overlap=device.startswith("cuda"),
                                        jump_forward=jf, max_num_seqs=32, max_num_batched_tokens=2048,
                                        gpu_memory_utilization=0.4))
        grammars = Grammars(model, engine.model_config.vocab_size, eos)
        forwards = tokens = 0
        seconds = 0.0
        outs = []
        for rep in range(3):  # the first round warms up (shapes, kernels, grammar tables)
            for i, schema in enumerate(JUMP_SCHEMAS):
                prompt = tok.encode_chat([{"role": "user", "content": "Answer with one JSON object of this shape: "
                                           + json.dumps(schema)}])
                matcher = asyncio.run(grammars.matcher("json_schema", json.dumps(schema)))
                steps0, t0 = engine.steps, time.perf_counter()
                r = engine.add_request(f"j{jf}-{rep}-{i}", prompt, SamplingParams(max_tokens=256, temperature=0.0),
                                       eos, matcher=matcher)
                while engine.has_unfinished():
                    engine.step()
                if rep:
                    seconds += time.perf_counter() - t0
                    forwards += engine.steps - steps0 - 1  # the prompt's own forward drew the first token
                    tokens += r.num_output_tokens - 1
                    outs.append(r.output_token_ids)
        grammars.close()
        del engine  # its KV pool, before the next engine sizes its own
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        answers[jf] = outs
        results[f"jump_forward_{jf}"] = {"forwards_per_token": round(forwards / tokens, 3),
                                         "decode_tok_s": round(tokens / seconds, 1), "tokens": tokens}
    results["same_answers"] = answers[0] == answers[16]
    # Where each answer first differs (None: identical): bf16 numerics of a multi-token step against
    # a one-token step can flip a near-tie of a random-weight model.
    results["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                        None if len(a) == len(b) else min(len(a), len(b)))
                                   for a, b in zip(answers[0], answers[16])]
    results["example"] = tok.decode(answers[16][0])[:200]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("schemas")
    s.add_argument("dir")
    v = sub.add_parser("valid")
    v.add_argument("url")
    v.add_argument("--requests", type=int, default=128)
    v.add_argument("--out")
    j = sub.add_parser("jump")
    j.add_argument("model")
    j.add_argument("--device", default="cuda")
    j.add_argument("--out")
    args = ap.parse_args()
    if args.command == "jump":
        result = _jump(args.model, args.device)
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result))
        return
    if args.command == "schemas":
        d = Path(args.dir)
        d.mkdir(parents=True, exist_ok=True)
        sixteen = w2_schemas()
        (d / "one.json").write_text(json.dumps(sixteen[0]))
        (d / "sixteen.json").write_text(json.dumps(sixteen))
        return
    result = asyncio.run(_valid(args.url.rstrip("/"), args.requests))
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
