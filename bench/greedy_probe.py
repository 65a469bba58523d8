"""Greedy completions of fixed token prompts, one at a time, written to a JSON file: run against
two stacks of the same model (1 prefill + 1 decode worker, and mixed workers) and compare the
files to check that a hand-off moves the KV intact (a corrupted page changes the tokens within a
few steps). Prompts are token ids (any vocabulary), 1 to ~3,000 tokens: partial and many blocks.
Usage: python bench/greedy_probe.py --base-url URL --vocab-size N --out F
       python bench/greedy_probe.py --compare A.json B.json"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request

LENGTHS = (1, 17, 200, 1000, 2047, 2900)


def run(base_url: str, vocab: int, max_tokens: int) -> dict:
    model = json.load(urllib.request.urlopen(f"{base_url}/v1/models", timeout=30))["data"][0]["id"]
    out = {}
    for n in LENGTHS:
        rng = random.Random(n)
        prompt = [rng.randrange(1, vocab) for _ in range(n)]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "logprobs": 1}).encode()
        req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
        choice = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]
        out[str(n)] = {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}
    return out


def compare(a: dict, b: dict) -> int:
    equal = [n for n in a if n in b and a[n]["text"] == b[n]["text"]]
    worst = max((abs(x - y) for n in equal for x, y in zip(a[n]["logprobs"], b[n]["logprobs"])), default=0.0)
    print(f"greedy parity: {len(equal)}/{len(a)} prompts equal (lengths {', '.join(a)}); "
          f"max |Δ logprob| {worst:.4f}")
    return 0 if len(equal) == len(a) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        return compare(a, b)
    json.dump(run(args.base_url.rstrip("/"), args.vocab_size, args.max_tokens), open(args.out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
