"""The server's OpenAPI 3.1 document, built from the pydantic schemas of k3.serve.protocol.

Every route is there with its request body, every status it can answer (with the OpenAI error body)
and the headers those carry (401 `WWW-Authenticate`, 503 `Retry-After`); streaming answers are
`text/event-stream`, `/metrics` is Prometheus text. The document is written per server, so that what
it allows is what the server accepts: the model name is the served one, token ids stay below the
vocabulary, `max_tokens` within `--max-output-tokens`, and image content parts appear only when the checkpoint
has vision. With an API key every route but `/health` declares bearer authentication.
"""

from __future__ import annotations

import copy

from k3.serve import protocol as P

REF = "#/components/schemas/{model}"
ERRORS = {
    400: "a request the server cannot serve: bad JSON or Unicode, JSON nested over --max-json-depth, a "
    "prompt that does not fit the context, an image that cannot be used, more images or pixels than "
    "--max-images / --max-image-pixels, a Host outside --allowed-hosts",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body over --max-body-bytes",
    415: "a POST whose Content-Type is not application/json (also none)",
    422: "a field of the wrong type or out of its range",
    431: "request line + headers over --max-header-bytes",
    500: "a failure inside this request (the server keeps serving the others)",
    503: "more requests in flight than --max-pending; retry after the Retry-After seconds",
}
HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}},
    503: {"Retry-After": {"schema": {"type": "string"}, "required": True}},
}


def _request_schemas() -> dict:
    out: dict = {}
    for m in (P.ChatCompletionRequest, P.CompletionRequest):
        s = m.model_json_schema(ref_template=REF, mode="validation")
        out.update(s.pop("$defs", {}))
        out[m.__name__] = s
    return out


def _json(model: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=model)}}}


def _errors(*codes: int) -> dict:
    return {
        str(c): {"description": ERRORS[c], "content": _json("ErrorResponse"), **({"headers": HEADERS[c]}
                 if c in HEADERS else {})}
        for c in codes
    }  # fmt: skip


def _tighten(schemas: dict, model_name: str, vocab_size: int, max_output: int, vision: bool,
             stop_limits: tuple[int, int] | None = None) -> None:  # fmt: skip
    """Write the server's own limits into the request schemas (in place)."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        if stop_limits is not None:  # (--max-stop-strings, --max-stop-chars)
            for alt in props["stop"]["anyOf"]:
                if alt.get("type") == "string":
                    alt["maxLength"] = stop_limits[1]
                elif alt.get("type") == "array":
                    alt["maxItems"] = stop_limits[0]
                    alt["items"] = {**alt["items"], "maxLength": stop_limits[1]}
        props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                for alt in props[key]["anyOf"]:
                    if alt.get("type") == "integer":
                        alt["maximum"] = max_output
    for alt in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        items = alt.get("items", {})
        inner = items.get("items", items)
        if inner.get("type") == "integer":
            inner.update(minimum=0, maximum=vocab_size - 1)
    if not vision:
        content = schemas["ChatMessage"]["properties"]["content"]
        for alt in content["anyOf"]:
            if alt.get("type") == "array":
                alt["items"] = {"$ref": REF.format(model="TextPart")}
        for key in ("ImagePart", "ImageURL"):
            schemas.pop(key, None)


def build_openapi(
    model_name: str,
    vocab_size: int,
    max_output: int,
    vision: bool,
    api_key: bool,
    title: str = "k3",
    stop_limits: tuple[int, int] | None = None,
) -> dict:
    """The OpenAPI document of a server with these settings (`max_output`: the max_tokens limit;
    `stop_limits`: (stop strings, characters per stop string) at most)."""
    schemas = _request_schemas()
    responses = (P.ChatCompletion, P.ChatCompletionChunk, P.Completion, P.ModelList, P.Health)
    for m in (*responses, P.ErrorResponse):
        s = m.model_json_schema(ref_template=REF, mode="serialization")
        schemas.update(s.pop("$defs", {}))
        schemas[m.__name__] = s
    _tighten(schemas, model_name, vocab_size, max_output, vision, stop_limits)
    auth = (401,) if api_key else ()

    def sse(chunk: str) -> dict:
        """Each event's data: a JSON chunk or error, or the closing [DONE] (OpenAPI 3.2's itemSchema)."""
        payload = {"anyOf": [{"$ref": REF.format(model=chunk)}, {"$ref": REF.format(model="ErrorResponse")}]}
        data = {"type": "string", "if": {"const": "[DONE]"},
                "else": {"contentMediaType": "application/json", "contentSchema": payload}}  # fmt: skip
        item = {"type": "object", "required": ["data"], "properties": {"data": data}}
        return {"text/event-stream": {"itemSchema": item}}

    def generate(req: str, resp: str, chunk: str, summary: str) -> dict:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": _json(req)},
                "responses": {
                    "200": {
                        "description": f"a {resp}, or with stream=true server-sent events of chunks "
                        "ending in `data: [DONE]`",
                        "content": {**_json(resp), **sse(chunk)},
                    },
                    **_errors(400, *auth, 404, 413, 415, 422, 431, 500, 503),
                },
            }
        }

    def get(content: dict, summary: str) -> dict:
        return {"get": {"summary": summary, "responses": {"200": {"description": summary,
                                                                  "content": content}}}}  # fmt: skip

    paths = {
        "/v1/chat/completions": generate(
            "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "chat completion"
        ),
        "/v1/completions": generate("CompletionRequest", "Completion", "Completion", "text completion"),
        "/v1/models": get(_json("ModelList"), "the served model"),
        "/health": get(_json("Health"), "liveness"),
        "/metrics": get(
            {"text/plain": {"schema": {"type": "string"}}}, "Prometheus text exposition (version 0.0.4)"
        ),
    }
    for path, ops in paths.items():
        for op in ops.values():
            op["operationId"] = path.strip("/").replace("/", "_").replace(".", "_") + "_" + next(iter(ops))
            if api_key and path != "/health":
                op["security"] = [{"bearer": []}]
                op["responses"].update(copy.deepcopy(_errors(401)))
    doc = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
