"""The chat completions format: chat.completion bodies and chat.completion.chunk events."""

from __future__ import annotations

from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.logprobs import chat_entries
from services.gateway.response_format import ResponseFormat
from services.gateway.streaming import ChunkFrame, json_finish, json_str
from services.gateway.tool_calls import CallStream, ToolSpec, new_call_id, parse_answer


_TEXT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    text_tail = _TEXT_TAIL
    id_prefix = "chatcmpl"
    # (ToolSpec, parser name) when the request may call tools: a stream sends the calls as OpenAI's
    # deltas while their tokens arrive (tool_calls.CallStream), or, for a syntax the grammar does not
    # hold, reads the answer at its end.
    tools: tuple[ToolSpec, str] | None = None
    _calls: dict | None = None  # choice index -> its CallStream

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
        if self.tools is not None:
            return self._tool_chunk(choice, update)
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
        message = {"role": "assistant", "content": "".join(choice.parts)}
        finish = choice.finish_reason
        if self.tools is not None:
            content, calls = parse_answer(message["content"], *self.tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": choice.index, "message": message, "logprobs": lp, "finish_reason": finish}

    def _tool_chunk(self, choice: ChoiceState, update: ChoiceUpdate) -> bytes | None:
        """Content and calls as OpenAI streams them: a call's index, id, type and name first, then
        its arguments' fragments; the finish says tool_calls when a call was made."""
        spec, parser = self.tools
        if not spec.streams(parser):
            return self._tool_chunk_at_end(choice, update)
        if self._calls is None:
            self._calls = {}
        stream = self._calls.get(choice.index)
        if stream is None:
            stream = self._calls[choice.index] = CallStream(spec, parser)
        events = stream.feed(update.text or "")
        if update.finish_reason is not None:
            events += stream.end()
        frame, i, out = self.frame, choice.index, []
        k = stream.calls - sum(kind == "call" for kind, _ in events) - 1  # the last call before these
        for kind, text in events:
            if kind == "content":
                delta: dict = {"content": text}
            elif kind == "call":
                k += 1
                delta = {"tool_calls": [{"index": k, "id": new_call_id(), "type": "function",
                                         "function": {"name": text, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": k, "function": {"arguments": text}}]}
            out.append(frame.chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None}))
        if update.finish_reason is not None:
            finish = "tool_calls" if stream.calls and update.finish_reason == "stop" else update.finish_reason
            out.append(frame.chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}))
        return b"".join(out) or None

    def _tool_chunk_at_end(self, choice: ChoiceState, update: ChoiceUpdate) -> bytes | None:
        """Text is held until the end; then the content, each call as OpenAI streams one, and the finish."""
        choice.parts.append(update.text)
        if update.finish_reason is None:
            return None
        content, calls = parse_answer("".join(choice.parts), *self.tools)
        frame, i = self.frame, choice.index
        out = [frame.chunk({"index": i, "delta": {"content": content}, "logprobs": None, "finish_reason": None})
               if content else b""]
        for k, call in enumerate(calls):
            f = call["function"]
            out.append(frame.chunk({"index": i, "delta": {"tool_calls": [
                {"index": k, "id": call["id"], "type": "function", "function": {"name": f["name"], "arguments": ""}}]},
                "logprobs": None, "finish_reason": None}))
            out.append(frame.chunk({"index": i, "delta": {"tool_calls": [
                {"index": k, "function": {"arguments": f["arguments"]}}]}, "logprobs": None, "finish_reason": None}))
        finish = "tool_calls" if calls and update.finish_reason == "stop" else update.finish_reason
        out.append(frame.chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}))
        return b"".join(out)
