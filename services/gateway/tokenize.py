"""vLLM's tokenizer endpoints (/tokenize and /detokenize), for any transport: JSON body in, answer out."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from services.gateway.schemas import decode_body, parse_detokenize, parse_tokenize

if TYPE_CHECKING:
    from services.gateway.gateway import Gateway


async def tokenize(gw: Gateway, raw: bytes) -> dict:
    """{"prompt": text or ids} or {"messages": [...]} → the ids the model (the body's "model") would see."""
    body = decode_body(raw)
    model = gw.catalogue.of_body(body)
    ids = await gw.tokenize(parse_tokenize(body, model.limits), model)
    return {"count": len(ids), "max_model_len": model.limits.max_model_len, "tokens": ids, "token_strs": None}


async def detokenize(gw: Gateway, raw: bytes) -> dict:
    """{"tokens": [ids]} → {"prompt": text}; decoded off the event loop."""
    body = decode_body(raw)
    model = gw.catalogue.of_body(body)
    ids = parse_detokenize(body, model.limits)
    text = await asyncio.get_running_loop().run_in_executor(gw.executor, model.tokenizer.decode, ids)
    return {"prompt": text}
