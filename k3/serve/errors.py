"""Errors of the HTTP API: `APIError(status, message)` rendered as OpenAI's error JSON, the answer to a
client that hung up (`Gone`, counted as status 499), and the handlers that render them."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from k3.serve.protocol import error_body


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


class ClientGone(Exception):
    """The client hung up; its request was cancelled."""


class Gone(Response):
    """The answer to a client that hung up: nothing is sent (the guard counts it as status 499)."""

    def __init__(self):
        super().__init__(status_code=499)

    async def __call__(self, scope, receive, send) -> None:
        return None


def request_failed(error: str) -> APIError:
    """The 500 of a request whose own step failed in the engine (the error's last line, shortened)."""
    reason = error.strip().splitlines()[-1][:300] if error.strip() else "engine failure"
    return APIError(500, f"this request failed: {reason}", "server_error")


def add_error_handlers(app: FastAPI) -> None:
    """APIError and routing errors (404, 405 with its Allow header) as OpenAI error JSON; a client gone
    while its body was read as `Gone`."""

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(
            error_body(e.message, e.type, e.param, e.status), status_code=e.status, headers=e.headers
        )

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(
            error_body(str(e.detail), "invalid_request_error", None, e.status_code),
            e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone_reading(_, e):
        return Gone()
