"""Generated JSON schemas of the shapes agents send, for structured-output tests and benchmarks:
nested objects, arrays, enums, anyOf, patterns, bounded numbers, required subsets, a shared $ref.

`bounded`: every string and number has a length or range, so that a random-weight model (which
writes noise) ends each value within a few tokens; otherwise plain strings and numbers appear too,
as in real requests (bench/grammar_ab.py measures compile and mask times on those).
"""

from __future__ import annotations

import random

KEYS = ["id", "name", "city", "items", "price", "tags", "user", "when", "count", "kind", "note", "score"]
PATTERNS = ["^[A-Z][a-z]{2,6}$", "^[0-9]{3}-[0-9]{4}$", "^[a-z_]{1,8}$", "^[0-9]{2}:[0-9]{2}$"]


def schema_corpus(n: int, seed: int = 0, bounded: bool = False) -> list[dict]:
    rng = random.Random(seed)

    def value(depth: int) -> dict:
        r = rng.random()
        if depth < 2 and r < 0.2:
            return obj(depth + 1)
        if depth < 2 and r < 0.32:
            return {"type": "array", "items": value(depth + 1), "maxItems": rng.randint(1, 4)}
        if r < 0.45:
            return {"enum": rng.sample(KEYS, rng.randint(1, 4))}
        if r < 0.55:
            return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "null"}]}
        if r < 0.65:
            return {"type": "string", "pattern": rng.choice(PATTERNS)}
        if r < 0.75:
            return {"type": "string", "maxLength": rng.randint(1, 8)} if bounded else {"type": "string"}
        if r < 0.9:
            return {"type": "integer", "minimum": rng.randint(-100, 0), "maximum": rng.randint(1, 100)}
        return {"type": "boolean"} if bounded or r < 0.95 else {"type": "number"}

    def obj(depth: int) -> dict:
        names = rng.sample(KEYS, rng.randint(1, 4))
        return {"type": "object", "properties": {k: value(depth) for k in names},
                "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}

    out = []
    for i in range(n):
        s = obj(0)
        if i % 10 == 0:  # a shared definition, by reference
            s = {"$defs": {"item": value(1)}, **s}
            s["properties"]["ref"] = {"$ref": "#/$defs/item"}
        out.append(s)
    return out
