"""The server's settings (`ServeConfig`): every limit is a `k3 serve` option (docs/serving.md, "Security")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str = "kimi-k3"
    api_keys: tuple[str, ...] = ()  # any of them is accepted; each is its own prefix-cache tenant
    max_model_len: int = 8192
    max_body_bytes: int | None = None  # 413 above it; None: body_cap() from the context (and vision)
    retry_after_s: int = 1  # the 503's Retry-After
    max_output_tokens: int | None = None  # per request (422 above it; the default); None: the context
    max_header_bytes: int = 16 << 10  # request line + headers (431 above it)
    max_stop_strings: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_json_depth: int = 64  # nesting of arrays / objects in a body
    max_images: int = 16  # image parts per request
    max_image_pixels: int = 100_000_000  # pixels of a request's images together (header sizes)
    allowed_hosts: frozenset[str] | None = None  # Host names answered (None: any); k3.serve.guard
    cors_origins: tuple[str, ...] = ()  # origins allowed to read answers cross-site (none: closed)
    prepare_threads: int = 2  # the pool that parses, renders and tokenizes requests

    @property
    def output_cap(self) -> int:
        return self.max_output_tokens or self.max_model_len

    def body_cap(self, vision: bool) -> int:
        """Bytes a request body may have. Unset, it is what the context can use: 32 bytes a token (JSON
        escapes included, ~8x what text takes) + 64 KiB of other fields, + 8 MiB of images on a vision
        server; a body no prompt of this context could fill is refused before it is read or parsed."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return (64 << 10) + 32 * self.max_model_len + ((8 << 20) if vision else 0)
