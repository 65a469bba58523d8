"""One gateway serving several models (issue 38): each request read, tokenized and answered with the
model its body names; GET /v1/models with `resident` from heartbeats; /ready with a model in standby;
models learnt from heartbeats; the flags. A real nats-server; a NATS peer plays scheduler and workers."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import structlog

from services.gateway.app import bound_port, build_app, start_server
from services.gateway.catalogue import ServedModel
from services.gateway.gateway import Gateway
from services.gateway.main import main, make_config, parse_args
from inferno.tools.make_model import write_model
from shared.config import CONFIG_ERROR_EXIT, GatewayConfig, NatsConfig
from shared.messages import GenerateRequest, RouteReply, TokenBatch, TokenDelta, WorkerHeartbeat
from shared.nats_client import NatsConnection, connect_nats
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from shared.wire import pack_ids
from tests.services.test_gateway import model_dir, wait_for  # noqa: F401 (the tiny model's fixture)

SCRIPT = "Hello world, this is a test."
PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
OTHER_MAX_LEN = 512
# ChatML, no bos: another family's template (and its tool calls read as hermes, not llama3_json).
CHATML = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_other_model(out: Path, **model: object) -> Path:
    """A second tiny model (config and tokenizer; no weights unless `model` asks for them: the gateway
    reads none) whose tokenizer gives the same text other ids (its BPE ids rotated), with a ChatML
    template and a shorter context. `model`: write_model's arguments (arch, seed, weights, ...)."""
    write_model(out, **{"preset": "tiny", "weights": False, **model})
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]  # ids 0..n-1; the special tokens come after them, unchanged
    tok["model"]["vocab"] = {token: (i + 7) % len(vocab) for token, i in vocab.items()}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    for name, key, value in (("tokenizer_config.json", "chat_template", CHATML),
                             ("config.json", "max_position_embeddings", OTHER_MAX_LEN)):
        doc = json.loads((out / name).read_text())
        doc[key] = value
        (out / name).write_text(json.dumps(doc))
    return out


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> Path:
    return write_other_model(tmp_path_factory.mktemp("other") / "other")


@pytest.fixture(scope="module")
def served_models(model_dir, other_dir) -> GatewayConfig:  # noqa: F811
    return GatewayConfig(model_name="tiny", model_dir=str(model_dir), more_models=(("other", str(other_dir)),))


class Cluster:
    """Scheduler and workers in one: accepts every GenerateRequest, answers SCRIPT in the ids of the
    request's own model, and publishes the heartbeats a test asks for."""

    def __init__(self, nats_cfg: NatsConfig, tokenizers: dict[str, Tokenizer]):
        self.nats_cfg = nats_cfg
        self.subjects = Subjects(nats_cfg.subject_prefix)
        self.tokenizers = tokenizers
        self.requests: list[GenerateRequest] = []
        self.conn: NatsConnection | None = None
        self.seq: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> Cluster:
        self.conn = await connect_nats(self.nats_cfg, "cluster", wait=5.0)
        await self.conn.subscribe(self.subjects.generate, GenerateRequest, self.on_generate)
        await self.conn.flush()
        return self

    def on_generate(self, req: GenerateRequest) -> RouteReply:
        self.requests.append(req)
        task = asyncio.create_task(self._answer(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return RouteReply.accepted(f"w-{req.model}")

    async def _answer(self, req: GenerateRequest) -> None:
        ids = self.tokenizers[req.model].encode(SCRIPT, add_special_tokens=False)
        delta = TokenDelta(request_id=req.request_id, token_ids=pack_ids(ids), finish_reason="length",
                           prompt_tokens=req.num_prompt_tokens, completion_tokens=len(ids))
        await self.conn.publish(req.reply_to, TokenBatch.of(f"w-{req.model}", [delta]))

    async def beat(self, model: str, state: str, model_dir: str = "") -> None:
        """A heartbeat of worker w-<model>, holding `model` in `state`."""
        worker = f"w-{model}"
        self.seq[worker] = self.seq.get(worker, 0) + 1
        await self.conn.publish(self.subjects.heartbeat, WorkerHeartbeat(
            worker_id=worker, role="mixed", model=model, ready=state == "ready", draining=False,
            generate_subject=self.subjects.worker_generate(worker), abort_subject=self.subjects.worker_abort(worker),
            timestamp=time.time(), seq=self.seq[worker], state=state, model_dir=model_dir))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.conn.close()


@dataclass
class Served:
    gw: Gateway
    cluster: Cluster
    url: str
    http: aiohttp.ClientSession

    async def get(self, path: str) -> tuple[int, dict]:
        async with self.http.get(self.url + path) as r:
            return r.status, json.loads(await r.text())

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        async with self.http.post(self.url + path, json=body) as r:
            return r.status, json.loads(await r.text())

    def model(self, name: str) -> ServedModel:
        return self.gw.catalogue.get(name)


@pytest.fixture
async def served(nats_config, nats_conn, served_models):
    """The gateway of two models, over HTTP, as main builds it (each model read from its directory)."""
    cfg = served_models
    models = [ServedModel.load(name, d, max_n=cfg.max_n, tool_call_parser=cfg.tool_call_parser)
              for name, d in cfg.models]
    gw = Gateway(cfg, models=models, subject_prefix=nats_config.subject_prefix)
    runner, _ = await start_server(build_app(gw, nats_conn), "127.0.0.1", 0)
    cluster = await Cluster(nats_config, {m.name: m.tokenizer for m in models}).start()
    cluster.tokenizers["late"] = models[1].tokenizer  # a model learnt later, from the other's directory
    http = aiohttp.ClientSession()
    try:
        yield Served(gw, cluster, f"http://127.0.0.1:{bound_port(runner)}", http)
    finally:
        await http.close()
        await runner.cleanup()
        await cluster.close()


async def test_each_request_is_read_tokenized_and_answered_by_its_model(served):
    tiny, other = served.model("tiny"), served.model("other")
    assert tiny.tokenizer.encode(PROMPT) != other.tokenizer.encode(PROMPT)  # truly two tokenizers
    assert (tiny.tool_parser, other.tool_parser) == ("llama3_json", "hermes")
    assert (tiny.limits.max_model_len, other.limits.max_model_len) == (2048, OTHER_MAX_LEN)
    for model in (tiny, other):
        status, body = await served.post("/v1/chat/completions",
                                         {"model": model.name, "messages": MESSAGES, "max_tokens": 20})
        assert status == 200, body
        assert (body["model"], body["choices"][0]["message"]["content"]) == (model.name, SCRIPT)
        req = served.cluster.requests[-1]
        assert (req.model, req.prompt_token_ids) == (model.name, model.tokenizer.encode_chat(MESSAGES))
        assert body["usage"]["prompt_tokens"] == len(req.prompt_token_ids)

        status, body = await served.post("/v1/completions", {"model": model.name, "prompt": PROMPT, "max_tokens": 9})
        assert (status, body["choices"][0]["text"]) == (200, SCRIPT)
        assert served.cluster.requests[-1].prompt_token_ids == model.tokenizer.encode(PROMPT)

        status, body = await served.post("/tokenize", {"model": model.name, "prompt": PROMPT})
        assert (status, body["tokens"], body["max_model_len"]) == (200, model.tokenizer.encode(PROMPT),
                                                                   model.limits.max_model_len)
        ids = model.tokenizer.encode(SCRIPT, add_special_tokens=False)
        assert await served.post("/detokenize", {"model": model.name, "tokens": ids}) == (200, {"prompt": SCRIPT})

    # No "model": the first one. Each body is held to its own model's limits.
    status, _ = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1000})
    assert status == 200 and served.cluster.requests[-1].model == "tiny"
    status, body = await served.post("/v1/completions", {"model": "other", "prompt": PROMPT, "max_tokens": 1000})
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    assert f"[1, {OTHER_MAX_LEN}]" in body["error"]["message"]


async def test_an_unknown_model_is_a_404_for_that_request_alone(served):
    error = {"error": {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                       "param": "model", "code": "model_not_found"}}
    for path, body in (("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}),
                       ("/v1/completions", {"model": "nope", "prompt": PROMPT}),
                       ("/tokenize", {"model": "nope", "prompt": PROMPT})):
        assert await served.post(path, body) == (404, error)
    assert served.cluster.requests == []
    status, body = await served.post("/v1/completions", {"model": ["tiny"], "prompt": PROMPT})
    assert (status, body["error"]["param"]) == (400, "model")  # not a string: a 400 naming it
    status, _ = await served.post("/v1/completions", {"model": "other", "prompt": PROMPT})
    assert status == 200


async def test_models_list_every_model_and_resident_follows_heartbeats(served):
    def resident(body: dict) -> dict[str, bool]:
        return {card["id"]: card["resident"] for card in body["data"]}

    status, body = await served.get("/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][1] == {"id": "other", "object": "model", "created": served.gw.created, "owned_by": "inferno",
                               "root": "other", "max_model_len": OTHER_MAX_LEN, "resident": False}
    assert resident(body) == {"tiny": False, "other": False}
    assert (await served.get("/ready"))[0] == 503  # no worker

    await served.cluster.beat("other", "standby")  # registered on its worker, not on its GPU
    await wait_for(lambda: served.gw.health.live())
    assert await served.get("/ready") == (200, {"status": "ready", "workers": 1})  # served after its load
    assert resident((await served.get("/v1/models"))[1]) == {"tiny": False, "other": False}

    await served.cluster.beat("tiny", "ready")
    await wait_for(lambda: "tiny" in served.gw.health.resident_models())
    assert resident((await served.get("/v1/models"))[1]) == {"tiny": True, "other": False}
    await served.cluster.beat("other", "ready")
    await served.cluster.beat("tiny", "unloading")
    await wait_for(lambda: served.gw.health.resident_models() == {"other"})
    assert resident((await served.get("/v1/models"))[1]) == {"tiny": False, "other": True}

    status, doc = await served.get("/openapi.json")
    assert doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"] == \
        ["tiny", "other", None]


async def test_a_model_announced_by_a_heartbeat_becomes_servable(served, other_dir, tmp_path):
    chat = {"model": "late", "messages": MESSAGES, "max_tokens": 20}
    assert (await served.post("/v1/chat/completions", chat))[0] == 404
    with structlog.testing.capture_logs() as logs:
        await served.cluster.beat("late", "standby", model_dir=str(other_dir))
        await served.cluster.beat("ghost", "standby", model_dir=str(tmp_path / "not-here"))
        await wait_for(lambda: "late" in served.gw.catalogue)
        await served.cluster.beat("ghost", "standby", model_dir=str(tmp_path / "not-here"))  # not tried again
        await wait_for(lambda: any(e["event"] == "model_dir_unusable" for e in logs))
        await served.cluster.beat("late", "ready", model_dir=str(other_dir))
        await wait_for(lambda: "late" in served.gw.health.resident_models())
    assert [e["model"] for e in logs if e["event"] == "model_dir_unusable"] == ["ghost"]
    assert "ghost" not in served.gw.catalogue

    status, body = await served.post("/v1/chat/completions", chat)
    assert (status, body["choices"][0]["message"]["content"]) == (200, SCRIPT)
    late = served.model("late")
    assert served.cluster.requests[-1].prompt_token_ids == late.tokenizer.encode_chat(MESSAGES)
    assert late.tokenizer.encode_chat(MESSAGES) == served.model("other").tokenizer.encode_chat(MESSAGES)
    status, body = await served.get("/v1/models")
    assert [(c["id"], c["max_model_len"], c["resident"]) for c in body["data"]] == \
        [("tiny", 2048, False), ("other", OTHER_MAX_LEN, False), ("late", OTHER_MAX_LEN, True)]


def test_flags_pair_names_with_dirs_and_refuse_a_name_twice(capsys):
    cfg, _ = make_config(parse_args(["--model-dir", "/m/a", "--model-dir", "/m/b.gguf", "--model-dir", "/m/c",
                                     "--model-name", "x"]))
    assert cfg.models == (("x", "/m/a"), ("b", "/m/b.gguf"), ("c", "/m/c"))
    assert (cfg.model_name, cfg.model_dir) == ("x", "/m/a")  # the first is the default
    cfg, _ = make_config(parse_args(["--model-dir", "/m/a"]))
    assert cfg.models == (("a", "/m/a"),) and cfg.more_models == ()
    for argv, why in (
            (["--model-dir", "/m/a", "--model-dir", "/m/b", "--model-name", "x", "--model-name", "x"], "served twice"),
            (["--model-dir", "/m/a", "--model-dir", "/n/a"], "served twice"),  # two default names alike
            (["--model-dir", "/m/a", "--model-name", "x", "--model-name", "y"], "2 --model-name for 1 --model-dir")):
        assert main(argv) == CONFIG_ERROR_EXIT  # before any model is read or NATS is dialled
        assert why in capsys.readouterr().out
