"""GET /openapi.json: a valid OpenAPI 3.1 document with every route of the app, whose request
schemas are the ones the validating fields write (schemas.request_schemas)."""

from __future__ import annotations

from openapi_spec_validator import OpenAPIV31SpecValidator

from services.gateway.app import build_app
from services.gateway.schemas import request_schemas
from tests.services.test_gateway import make_stack, model_dir, stack, tokenizer  # noqa: F401


async def test_openapi_is_valid_and_lists_every_route(stack):  # noqa: F811
    status, doc, headers = await stack.get("/openapi.json", key=None)  # served without a key
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert doc["openapi"] == "3.1.0"
    assert list(OpenAPIV31SpecValidator(doc).iter_errors()) == []  # valid against the OpenAPI 3.1 schema

    app = build_app(stack.gw)
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == routes
    assert routes >= {("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
                      ("post", "/tokenize"), ("post", "/detokenize"), ("get", "/openapi.json"), ("get", "/health"),
                      ("get", "/ready"), ("get", "/metrics")}

    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post":  # every body is described, by a schema of the validating fields
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.removeprefix("#/components/schemas/") in request_schemas(stack.gw.limits), path
            for response in op["responses"].values():
                for media in response.get("content", {}).values():
                    ref = media["schema"].get("$ref")
                    assert ref is None or ref.removeprefix("#/components/schemas/") in schemas
            assert op["security"] == ([] if path in ("/health", "/ready", "/openapi.json") else [{"bearer": []}])
    for name, schema in request_schemas(stack.gw.limits).items():
        assert schemas[name] == schema
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["n"] == {"type": ["integer", "null"], "minimum": 1, "maximum": 16,
                                       "description": "Choices to generate."}
    assert chat["properties"]["temperature"]["maximum"] == 100.0
    assert chat["properties"]["model"]["enum"] == ["tiny", None]
    assert "Not supported yet" in chat["properties"]["functions"]["description"]
    assert chat["properties"]["tools"]["type"] == ["array", "null"] and "tool_choice" in chat["properties"]
