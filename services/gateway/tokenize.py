"""POST /tokenize and /detokenize: the tokenizer endpoints vLLM users script against."""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.gateway.schemas import parse_detokenize, parse_tokenize
from services.gateway.serving import GATEWAY, read_json


async def handle_tokenize(request: web.Request) -> web.Response:
    """{"prompt": text or ids} or {"messages": [...]} → the ids the model would see."""
    gw = request.app[GATEWAY]
    ids = await gw.tokenize(parse_tokenize(await read_json(request), gw.limits))
    return web.json_response({"count": len(ids), "max_model_len": gw.limits.max_model_len, "tokens": ids,
                              "token_strs": None})


async def handle_detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} → {"prompt": text}; decoded off the event loop."""
    gw = request.app[GATEWAY]
    ids = parse_detokenize(await read_json(request), gw.limits)
    text = await asyncio.get_running_loop().run_in_executor(gw.executor, gw.tokenizer.decode, ids)
    return web.json_response({"prompt": text})
