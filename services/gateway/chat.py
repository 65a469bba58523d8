"""The chat completions format: chat.completion bodies and chat.completion.chunk events."""

from __future__ import annotations

from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.logprobs import chat_entries
from services.gateway.response_format import ResponseFormat
from services.gateway.streaming import ChunkFrame, json_finish, json_str


_TEXT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    text_tail = _TEXT_TAIL
    id_prefix = "chatcmpl"

    def _entries(self, update: ChoiceUpdate) -> list[dict] | None:
        if update.token_ids is None:
            return None
        return chat_entries(self.texts, update.token_ids, update.logprobs, update.top_ids, update.top_lps)

    def begin(self, frame: ChunkFrame, choices: list[ChoiceState]) -> bytes:
        self.frame = frame
        self.heads = [b'%s{"index":%d,"delta":{"content":' % (frame.head, c.index) for c in choices]
        return b"".join(frame.chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}) for c in choices)

    def chunk(self, choice: ChoiceState, update: ChoiceUpdate) -> bytes | None:
        if update.token_ids is None and update.finish_reason is None:
            if not update.text:
                return None  # text held back (a partial character, a possible stop string)
            return self.text_chunk(choice.index, update.text)
        frame = self.frame
        if update.token_ids is not None:
            return frame.chunk({"index": choice.index, "delta": {"content": update.text} if update.text else {},
                                "logprobs": {"content": self._entries(update)},
                                "finish_reason": update.finish_reason})
        if update.text:
            return b'%s{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":%s}]}\n\n' % (
                frame.head, choice.index, json_str(update.text), json_finish(update.finish_reason))
        return b'%s{"index":%d,"delta":{},"logprobs":null,"finish_reason":%s}]}\n\n' % (
            frame.head, choice.index, json_finish(update.finish_reason))

    def collect(self, choice: ChoiceState, update: ChoiceUpdate) -> None:
        if update.text:
            choice.parts.append(update.text)
        entries = self._entries(update)
        if entries is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(entries)

    def final_choice(self, choice: ChoiceState) -> dict:
        lp = {"content": choice.logprobs or []} if self.want_logprobs else None
        return {"index": choice.index, "message": {"role": "assistant", "content": "".join(choice.parts)},
                "logprobs": lp, "finish_reason": choice.finish_reason}
