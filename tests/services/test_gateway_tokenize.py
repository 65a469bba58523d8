"""POST /tokenize and /detokenize on the real gateway (vLLM's tokenizer endpoints)."""

from __future__ import annotations

import json

from tests.services.test_gateway import KEY, make_stack, model_dir, stack, tokenizer  # noqa: F401 (fixtures)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello, ünïcödé 😀."}]


async def test_tokenize_text_messages_and_ids(stack):  # noqa: F811
    tok = stack.tokenizer
    status, body, _ = await stack.post("/tokenize", json.dumps({"model": "tiny", "prompt": "Hello world"}).encode())
    ids = tok.encode("Hello world")
    assert status == 200 and body == {"count": len(ids), "max_model_len": stack.gw.limits.max_model_len,
                                      "tokens": ids, "token_strs": None}
    status, body, _ = await stack.post("/tokenize", json.dumps({"messages": MESSAGES}).encode())
    assert status == 200 and body["tokens"] == tok.encode_chat(MESSAGES)
    status, body, _ = await stack.post("/tokenize", json.dumps({"prompt": [5, 6, 7]}).encode())
    assert status == 200 and (body["count"], body["tokens"]) == (3, [5, 6, 7])


async def test_detokenize_round_trips(stack):  # noqa: F811
    text = "Say hello, ünïcödé 😀."
    ids = stack.tokenizer.encode(text, add_special_tokens=False)
    status, body, _ = await stack.post("/detokenize", json.dumps({"model": "tiny", "tokens": ids}).encode())
    assert (status, body) == (200, {"prompt": text})


async def test_tokenizer_endpoints_refuse_bad_input(stack):  # noqa: F811
    cases = [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": "hi"}, 400, "messages"),
        ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", [1, 2], 400, None),
    ]
    for path, payload, want, param in cases:
        status, body, _ = await stack.post(path, json.dumps(payload).encode())
        assert status == want, (path, payload, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        if param is not None and want == 400:
            assert body["error"]["param"] == param
    status, body, _ = await stack.post("/tokenize", b'{"prompt": "x"}', key=None)
    assert status == 401 and "error" in body
    # The gateway still serves.
    status, body, _ = await stack.post("/tokenize", json.dumps({"prompt": "ok"}).encode())
    assert status == 200 and body["count"] >= 1
