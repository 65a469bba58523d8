"""The completions format: text_completion bodies and chunks (prompt as text or token ids)."""

from __future__ import annotations

from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.logprobs import CompletionLogprobs
from services.gateway.response_format import ResponseFormat
from services.gateway.streaming import ChunkFrame, json_finish, json_str


_TEXT_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


class CompletionFormat(ResponseFormat):
    object = "text_completion"
    chunk_object = "text_completion"
    text_tail = _TEXT_TAIL
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
                return self.text_chunk(choice.index, update.text)
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
