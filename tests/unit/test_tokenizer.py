"""shared.tokenizer and shared.chat_template against transformers on a generated model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inferno.tools import make_model as mm
from shared.chat_template import ChatTemplateError, render_chat_template
from shared.tokenizer import Tokenizer, TokenizerError, TokenizerFileNotFound

transformers = pytest.importorskip("transformers")

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city <b>&</b> 'quotes' \"double\" — ünïcode",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}],
    "multi_turn": [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?\n"},
        {"role": "assistant", "content": " 6 "},
        {"role": "user", "content": "Thanks! 😀 日本語"},
    ],
    "ends_with_assistant": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                   {"type": "text", "text": "part two"}]}],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
    ],
    "tool_call_dict_args": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    ],
    "special_text_in_content": [{"role": "user", "content": "print('<|eot_id|>') and <b>bold</b>"}],
    "empty_content": [{"role": "user", "content": ""}],
    "system_only": [{"role": "system", "content": "Only a system prompt."}],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return mm.write_model(tmp_path_factory.mktemp("tok") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


# ------------------------------------------------------------------ chat template


@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tok, hf, name, add_generation_prompt, with_tools):
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    theirs = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    tokenize=False)
    assert ours == theirs
    # Tokenised as transformers tokenises a chat (no second bos).
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    hf_ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    tokenize=True, return_dict=False)
    assert ids == list(hf_ids)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_chat_template_shape(tok):
    text = tok.apply_chat_template(CONVERSATIONS["system_user"], add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tok.apply_chat_template(CONVERSATIONS["user"], add_generation_prompt=False).endswith("\n\n")


def test_messages_are_not_mutated(tok):
    messages = json.loads(json.dumps(CONVERSATIONS["tool_call"]))
    before = json.dumps(messages)
    tok.apply_chat_template(messages)
    assert json.dumps(messages) == before


def test_template_environment_matches_transformers(tok, hf):
    """Custom templates exercising the environment: tojson options, loop controls, namespace,
    dict, strftime_now, special-token variables, extra kwargs, trim/lstrip blocks."""
    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "    {% set ns.n = ns.n + 1 %}\n"
        "  {{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}|{{ m | tojson(separators=(',', ':')) }}\n"
        "{% endfor %}\n"
        "n={{ ns.n }} bos={{ bos_token }} eos={{ eos_token }} extra={{ extra_var | default('none') }}\n"
        "{{ dict(a=1, b=[1, 2]) | tojson }} {{ strftime_now('%Y') | length }}\n"
        "{% if add_generation_prompt %}GEN{% endif %}"
    )
    messages = [{"role": "system", "content": "<s> & \"q\""}, {"role": "user", "content": "héllo 😀"},
                {"role": "assistant", "content": "x"}]
    for kwargs in ({}, {"extra_var": "given"}, {"bos_token": "OVERRIDDEN"}):
        ours = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, **kwargs)
        theirs = hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                        tokenize=False, **kwargs)
        assert ours == theirs
    assert "OVERRIDDEN" in tok.apply_chat_template(messages, chat_template=template, bos_token="OVERRIDDEN")


def test_raise_exception_gives_value_error(tok):
    with pytest.raises(ValueError, match="Unknown message role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="Only text content parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="custom failure"):
        tok.apply_chat_template(CONVERSATIONS["user"], chat_template="{{ raise_exception('custom failure') }}")


def test_template_errors_are_value_errors(tok):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template(CONVERSATIONS["user"], chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute tricks
        tok.apply_chat_template(CONVERSATIONS["user"], chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        tok.apply_chat_template(CONVERSATIONS["user"], chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError):  # the sandbox is immutable
        tok.apply_chat_template(CONVERSATIONS["user"], chat_template="{% set _ = messages.append(1) %}")
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="not a dict"):
        tok.apply_chat_template(["hello"])
    with pytest.raises(ChatTemplateError, match="tools"):
        tok.apply_chat_template(CONVERSATIONS["user"], tools="not a list")


def test_render_chat_template_directly():
    out = render_chat_template("{{ bos_token }}{{ messages[0].content }}{{ x }}", [{"role": "user", "content": "a"}],
                               special_tokens={"bos_token": "<s>"}, x=1)
    assert out == "<s>a1"


# ------------------------------------------------------------------ encode / decode

TEXTS = [
    "Hello, world!",
    "",
    " leading space",
    "trailing space ",
    "multiple   spaces\n\n\nand newlines\r\n",
    "numbers 1234567 3.14159 2024-07-26",
    "def f(x):\n    return x ** 2  # comment",
    "<|eot_id|> and <|begin_of_text|> inside text",
    "<|not_a_special|>",
    "émoji 😀👍🏽 CJK 日本語 中文 한국어",
    "don't won't it's I'll we've",
    "\x00\x01\t\u200b",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    for add_special in (True, False):
        assert tok.encode(text, add_special_tokens=add_special) == hf(text, add_special_tokens=add_special).input_ids
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_special_ids(tok, hf, model_dir):
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tf = mm.build_tokenizer_json()
    assert tok.bos_token_id == hf.bos_token_id == tf.special_ids["<|begin_of_text|>"]
    assert tok.eos_token_id == hf.eos_token_id == tf.special_ids["<|eot_id|>"]
    assert set(tok.eos_token_ids) == set(gen["eos_token_id"]) | {hf.eos_token_id}
    assert list(tok.eos_token_ids) == gen["eos_token_id"]  # generation config order, tokenizer eos already in it
    assert tok.vocab_size == len(hf) == tf.size == len(tok)
    assert tok.all_special_ids == set(tf.special_ids.values())
    assert tok.special_tokens_map == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert tok.model_max_length == 2048


def test_tokens_and_bytes(tok, hf):
    text = "héllo 😀 wörld<|eot_id|>日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.id_to_token(tok.bos_token_id) == "<|begin_of_text|>"
    assert tok.token_to_id("<|eot_id|>") == tok.eos_token_id
    # Ids in the model's padded vocabulary that the tokenizer lacks: no token, no bytes, no text.
    cfg = json.loads((Path(tok._source) / "config.json").read_text())
    for unknown in range(tok.vocab_size, cfg["vocab_size"]):
        assert tok.id_to_token(unknown) is None and tok.token_bytes(unknown) == b""
        assert tok.decode([ids[0], unknown, ids[1]]) == tok.decode([ids[0], ids[1]])
    assert tok.id_to_token(-1) is None
    assert tok.token_text(tok.eos_token_id) == "<|eot_id|>"


def test_warm_token_tables_equal_the_exact_path(model_dir):
    """The gateway fills the detokenizer's caches for every id at start (a translate per token for
    byte-level vocabularies): each entry equals token_bytes and its UTF-8 text, special tokens and
    tokens that are parts of a character included; ids past the tokenizer stay lazy and empty."""
    warm = Tokenizer.from_dir(model_dir)
    warm.warm_token_tables()
    exact = Tokenizer.from_dir(model_dir)
    partial = 0
    for i in range(exact.vocab_size):
        b = exact.token_bytes(i)
        assert warm.cached_token_bytes(i) == b
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = None
            partial += 1
        assert warm.cached_token_text(i) == text
    assert partial > 0 and warm.cached_token_bytes(warm.eos_token_id) == b"<|eot_id|>"
    assert warm.cached_token_bytes(warm.vocab_size + 3) == b""


# ------------------------------------------------------------------ loading variants and errors


def _copy(model_dir: Path, dst: Path) -> Path:
    shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def test_missing_files_are_named(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "a")
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerFileNotFound, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    d = _copy(model_dir, tmp_path / "b")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    d = _copy(model_dir, tmp_path / "c")
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_dir(d)
    d = _copy(model_dir, tmp_path / "d")
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(d)


def test_without_generation_config_uses_config_and_tokenizer_eos(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "nogen")
    (d / "generation_config.json").unlink()
    t = Tokenizer.from_dir(d)
    cfg = json.loads((d / "config.json").read_text())
    assert set(t.eos_token_ids) == set(cfg["eos_token_id"]) | {t.eos_token_id}
    (d / "config.json").unlink()
    assert Tokenizer.from_dir(d).eos_token_ids == (t.eos_token_id,)


def test_chat_template_file_overrides_config(model_dir, tmp_path, hf):
    d = _copy(model_dir, tmp_path / "jinja")
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    ours = Tokenizer.from_dir(d).apply_chat_template(CONVERSATIONS["user"])
    theirs = transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        CONVERSATIONS["user"], tokenize=False, add_generation_prompt=True)
    assert ours == theirs == "[user]Hi"


def test_named_templates(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "named")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template(CONVERSATIONS["user"]) == "D"
    assert t.apply_chat_template(CONVERSATIONS["user"], tools=TOOLS) == "T"
    assert t.apply_chat_template(CONVERSATIONS["user"], chat_template="tool_use") == "T"
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template(CONVERSATIONS["user"])


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True},
                                   {"add_eos_token": True}])
def test_explicit_add_bos_eos_matches_transformers(model_dir, tmp_path, flags):
    d = _copy(model_dir, tmp_path / "flags")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(flags)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ("Hello there", ""):
        assert ours.encode(text) == theirs(text).input_ids
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids
