"""The OpenAI-compatible HTTP app: `create_app(engine, cfg)` wires the server's parts together.

    RequestGuard (k3.serve.guard)      header size, Host, status counts, a 500 for anything unexpected
      -> CORS (only with --cors-origin)
      -> routes (k3.serve.routes)      info: /health /metrics /openapi.json /v1/models / /static/...
                                       generation: /v1/chat/completions /v1/completions
           api_key (k3.serve.auth)     the bearer key, a dependency of every route but /health and files
           body (k3.serve.body)        Content-Type, the capped read, strict JSON
           prepare (k3.serve.prepare)  schema, limits, rendering, tokenizing, images (worker threads)
           streams (k3.serve.streams)  the whole answer or its SSE stream; the disconnect watcher
      errors (k3.serve.errors)         APIError -> OpenAI error JSON; a client gone -> nothing sent

One request's failure stays its own: tokenizing errors answer 400, a failure while sampling or
detokenizing it ends that request with 500 (or an error event when streaming) while its batch goes on,
and anything else unexpected answers 500 in the OpenAI shape. `max_tokens` is an upper bound (at most
`--max-output-tokens`, also its default): generation also ends where the context does (finish_reason
"length"). Images need an engine with `.vision` (`k3.infer.vision.load_vl_engine`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI

from k3.infer.async_engine import AsyncEngine
from k3.serve.config import ServeConfig
from k3.serve.errors import add_error_handlers
from k3.serve.guard import RequestGuard
from k3.serve.metrics import ServerMetrics
from k3.serve.openapi import build_openapi
from k3.serve.prepare import Preparer
from k3.serve.routes import Server, generation, info


def create_app(engine: AsyncEngine, cfg: ServeConfig) -> FastAPI:
    app = FastAPI(title="k3", docs_url=None, redoc_url=None, openapi_url=None)
    vision = getattr(engine.engine, "vision", None)
    stats = ServerMetrics()
    doc = build_openapi(cfg.served_model_name, engine.engine.vocab_size, cfg.output_cap,
                        vision is not None, bool(cfg.api_keys), stop_limits=(cfg.max_stop_strings,
                        cfg.max_stop_chars))  # fmt: skip
    if cfg.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])  # fmt: skip
    app.add_middleware(
        RequestGuard, stats=stats, max_header_bytes=cfg.max_header_bytes, hosts=cfg.allowed_hosts
    )
    app.state.api_keys = cfg.api_keys
    app.state.server = Server(
        engine=engine,
        cfg=cfg,
        stats=stats,
        doc=doc,
        prepare=Preparer(cfg, engine.tokenizer, vision),
        body_cap=cfg.body_cap(vision is not None),
        pool=ThreadPoolExecutor(cfg.prepare_threads, thread_name_prefix="k3-prepare"),
        image_pool=ThreadPoolExecutor(1, thread_name_prefix="k3-images"),
    )
    add_error_handlers(app)
    app.include_router(info)
    app.include_router(generation)
    return app
