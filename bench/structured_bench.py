"""Issue 34's structured-output benchmark helpers (bench/structured_gpu.sh runs them):

    python bench/structured_bench.py schemas DIR   # DIR/one.json (a schema), DIR/sixteen.json (16)
    python bench/structured_bench.py valid URL [--requests 128] [--out FILE]

`schemas`: W2's schemas. Each is an object whose "rows" array needs 500 items, so a W2 answer never
ends before its max_tokens: constrained and unconstrained runs make the same tokens, and their tok/s
compare. They differ in what the rows hold (enums, bounded integers, numbers, booleans, short
strings, a nested object), hence in how many tokens each step's mask allows.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("schemas")
    s.add_argument("dir")
    v = sub.add_parser("valid")
    v.add_argument("url")
    v.add_argument("--requests", type=int, default=128)
    v.add_argument("--out")
    args = ap.parse_args()
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
