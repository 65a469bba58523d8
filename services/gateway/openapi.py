"""The OpenAPI 3.1 document of the HTTP API, built from the route table (app.py) and the request
bodies' field definitions (schemas.py), which are also what validates requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from services.gateway.fields import Limits
from services.gateway.schemas import request_schemas

OPENAPI_VERSION = "3.1.0"
API_VERSION = "0.1.0"

# Statuses a route may answer besides 200, with what they mean here.
ERRORS = {
    400: "Invalid request (OpenAI-shaped error naming the parameter in `param`).",
    401: "Missing or wrong API key.",
    404: "Unknown model or route.",
    413: "Request body over the size limit.",
    429: "Admission control refused the request; retry after Retry-After seconds.",
    503: "No worker can serve now (or the gateway is shutting down); retry after Retry-After seconds.",
    504: "The request passed its deadline.",
}


@dataclass(frozen=True, slots=True)
class RouteDoc:
    """What the document says of one route."""

    method: str
    path: str
    operation_id: str
    summary: str
    body: str | None = None  # the components/schemas name of its JSON request body
    answer: str | None = None  # the components/schemas name of its JSON answer (None: text/plain)
    streams: bool = False  # answers with server-sent events when the body asks to stream
    errors: tuple[int, ...] = (401,)
    open: bool = False  # served without an API key


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _usage() -> dict:
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "completion_tokens_details": {"type": "object", "properties": {
            "accepted_prediction_tokens": {"type": "integer"}, "rejected_prediction_tokens": {"type": "integer"}}}}}


def _completion(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": _usage()}}


FINISH = {"enum": ["stop", "length", None]}
ANSWERS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}},
    "ChatCompletion": _completion("chat.completion", {"type": "object", "properties": {
        "index": {"type": "integer"}, "finish_reason": FINISH,
        "message": {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}},
        "logprobs": {"type": ["object", "null"]}}}),
    "Completion": _completion("text_completion", {"type": "object", "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": FINISH,
        "logprobs": {"type": ["object", "null"]}}}),
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object"], "properties": {
                "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"},
                "resident": {"type": "boolean", "description": "On some worker's GPU now (else served after "
                                                               "a worker loads it)."}}}}}},
    "Tokenized": {"type": "object", "required": ["count", "tokens"], "properties": {
        "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}}}},
    "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "Status": {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string"}, "workers": {"type": "integer"}}},
    "OpenApi": {"type": "object", "required": ["openapi", "paths"]},
}


def _operation(route: RouteDoc) -> dict:
    ok: dict = {"description": "OK"}
    if route.answer is None:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    else:
        ok["content"] = {"application/json": {"schema": _ref(route.answer)}}
        if route.streams:
            ok["content"]["text/event-stream"] = {"schema": {
                "type": "string", "description": "`data: <chunk JSON>` events, then `data: [DONE]`."}}
    responses: dict = {"200": ok}
    for status in route.errors:
        if route.open and status == 401:
            continue
        responses[str(status)] = {"description": ERRORS[status], "content": {"application/json": {
            "schema": _ref("Error")}}}
    op: dict = {"operationId": route.operation_id, "summary": route.summary, "responses": responses,
                "security": [] if route.open else [{"bearer": []}]}
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(route.body)}}}
    return op


def document(routes: Sequence[RouteDoc], limits: Limits) -> dict:
    """The OpenAPI document of these routes, for the served models' limits (Catalogue.doc_limits)."""
    paths: dict[str, dict] = {}
    names = ", ".join(f"`{name}`" for name in limits.model_names or (limits.model_name,))
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "Inferno", "version": API_VERSION,
                 "description": f"OpenAI-compatible API of Inferno, serving {names} (context up to "
                                f"{limits.max_model_len} tokens). The same bodies are served over NATS "
                                "(see the README)."},
        "paths": paths,
        "components": {"schemas": {**request_schemas(limits), **ANSWERS},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
