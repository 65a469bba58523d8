"""POST /v1/completions: a prompt (text or token ids) in, text_completion objects out."""

from __future__ import annotations

import time

from aiohttp import web

from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.logprobs import CompletionLogprobs
from services.gateway.schemas import parse_completion, resolve_max_tokens
from services.gateway.serving import GATEWAY, ResponseFormat, generate, read_json
from services.gateway.streaming import ChunkFrame, json_finish, json_str


_TEXT_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


class CompletionFormat(ResponseFormat):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, choice: ChoiceState, update: ChoiceUpdate) -> dict | None:
        if update.token_ids is None:
            return None
        if choice.logprobs is None:
            choice.logprobs = CompletionLogprobs()
        return choice.logprobs.add(self.texts, update.token_ids, update.logprobs, update.top_ids, update.top_lps)

    def begin(self, frame: ChunkFrame, choices: list[ChoiceState]) -> bytes:
        self.frame = frame
        self.heads = [b'%s{"index":%d,"text":' % (frame.head, c.index) for c in choices]
        return b""

    def chunk(self, choice: ChoiceState, update: ChoiceUpdate) -> bytes | None:
        if update.token_ids is None:
            if update.finish_reason is None:
                if not update.text:
                    return None  # text held back (a partial character, a possible stop string)
                # The per-token path: a byte template filled with the JSON string, no dict, no encoder.
                return self.heads[choice.index] + json_str(update.text) + _TEXT_TAIL
            return b'%s%s,"logprobs":null,"finish_reason":%s}]}\n\n' % (
                self.heads[choice.index], json_str(update.text), json_finish(update.finish_reason))
        lp = self._logprobs(choice, update)
        return self.frame.chunk({"index": choice.index, "text": update.text, "logprobs": lp,
                                 "finish_reason": update.finish_reason})

    def collect(self, choice: ChoiceState, update: ChoiceUpdate) -> None:
        if update.text:
            choice.parts.append(update.text)
        self._logprobs(choice, update)

    def final_choice(self, choice: ChoiceState) -> dict:
        lp = None
        if self.want_logprobs:
            lp = (choice.logprobs or CompletionLogprobs()).as_dict()
        return {"index": choice.index, "text": "".join(choice.parts), "logprobs": lp,
                "finish_reason": choice.finish_reason}


async def handle_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    arrival = time.monotonic()
    spec = parse_completion(await read_json(request), gw.limits)
    prompt_ids = await gw.tokenize(spec)
    resolve_max_tokens(spec, len(prompt_ids), gw.limits.max_model_len, gw.cfg.max_tokens_default)
    fmt = CompletionFormat(gw.texts, spec.logprobs is not None)
    return await generate(gw, request, spec, prompt_ids, fmt, arrival)
