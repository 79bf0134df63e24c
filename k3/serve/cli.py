"""`k3 serve CHECKPOINT_DIR`: the OpenAI-compatible server on uvicorn (binds 127.0.0.1 by default)."""

from __future__ import annotations

import argparse
import threading


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="checkpoint directory (config.json, safetensors, tokenizer files), or a `k3 train` run "
        "directory (its newest model: the latest checkpoints/step-N, or the finished run's files), or a "
        "kimi-k3 .gguf file",
    )
    parser.add_argument("--max-model-len", type=int, default=8192, help="context length (prompt + output)")
    parser.add_argument(
        "--num-pages", type=int, default=None, help="MLA pages (default: fits 4 x max-model-len)"
    )
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="KDA state slots = concurrent sequences")
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable the hybrid prefix cache")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the batch-1 decode step and the prefill activations (needs a C++ compiler; done "
        "at start-up, tens of seconds; k3-tiny on a CPU: ~2.8x faster single-stream decode, docs/engine.md)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="one answer per request: tokens and logprobs the same bits whatever the batch, prefill chunks, "
        "prefix-cache hits and thread count (prompt tokens run through the native step; costs prefill "
        "speed, docs/serving.md#deterministic-serving)",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="MXFP4 checkpoint: dequantize the routed experts to the model dtype (default: keep them packed)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require `Authorization: Bearer KEY`; give it several times for several keys (each key is "
        "its own prefix-cache tenant)",
    )
    parser.add_argument(
        "--api-key-file", default=None, help="a file of API keys, one per line (blank and # lines skipped)"
    )
    parser.add_argument("--served-model-name", default="kimi-k3")
    parser.add_argument("--max-pending", type=int, default=256, help="requests in flight before 503")
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="max_tokens limit per request and its default (default: the context length)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="request body limit (413; default: 64 KiB + 32 bytes per token of --max-model-len, + 8 MiB "
        "with vision)",
    )
    parser.add_argument(
        "--max-header-bytes", type=int, default=16 << 10, help="request line + headers limit (431)"
    )
    limits = parser.add_argument_group('security limits (docs/serving.md, "Security")')
    limits.add_argument(
        "--max-connections", type=int, default=1024, help="open connections; past it a new one gets 503"
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request line and headers to arrive (408 and closed past it)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request body to arrive after its headers (408 and closed past it)",
    )
    limits.add_argument("--max-stop-strings", type=int, default=16, help="stop strings per request (422)")
    limits.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string (422)")
    limits.add_argument(
        "--max-json-depth", type=int, default=64, help="nesting of arrays / objects in a body (400)"
    )
    limits.add_argument("--max-images", type=int, default=16, help="image parts per request (400)")
    limits.add_argument(
        "--max-image-pixels",
        type=int,
        default=100_000_000,
        help="pixels of one request's images together, from their headers, before decoding (400)",
    )
    limits.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        help="Host names served besides the loopback ones (127.0.0.1, localhost, ::1) when bound to "
        "loopback; bound elsewhere, the only ones served (default: any); '*' turns the check off",
    )
    limits.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        help="an origin whose web pages may call the API (repeatable; default: none, CORS closed)",
    )
    parser.add_argument("--shutdown-after", type=float, default=None, help=argparse.SUPPRESS)  # tests


def build_engine(args):
    from k3.infer.config import EngineConfig
    from k3.train.checkpointing import model_dir

    args.checkpoint = str(model_dir(args.checkpoint))
    n = args.max_model_len
    pages = args.num_pages or -(-4 * n // args.page_size)
    cfg = EngineConfig(page_size=args.page_size, prefix_unit=min(64, args.page_size), num_pages=pages,
                       max_num_seqs=args.max_num_seqs, max_model_len=n,
                       enable_prefix_cache=not args.no_prefix_cache,
                       compile=getattr(args, "compile", False),
                       deterministic=getattr(args, "deterministic", False))  # fmt: skip
    from k3.infer.vision import is_vl_checkpoint, load_vl_engine

    if is_vl_checkpoint(args.checkpoint):  # images through the chat API (k3.infer.vision)
        engine = load_vl_engine(args.checkpoint, cfg, device=args.device)
    else:
        engine = load_engine(args.checkpoint, cfg, args.device, dequantize=args.dequantize)
    if engine.tokenizer is None:
        raise ValueError(f"checkpoint {args.checkpoint!r} has no tokenizer files (tokenizer_config.json)")
    if cfg.compile:
        warm_up(engine)
    return engine


def warm_up(engine) -> None:
    """Compile the decode step before serving: one throw-away two-token generation (its slot and pages
    are freed when it finishes; a one-token prompt leaves nothing in the prefix cache)."""
    import sys

    from k3.infer.sequence import SamplingParams

    print("compiling the decode step (torch.compile) ...", file=sys.stderr, flush=True)
    engine.generate([[engine.eos_token_id]], SamplingParams(max_tokens=2, ignore_eos=True))
    step = engine.runner.decode
    if step.native is not None:  # the whole-model C step decodes; nothing was compiled for it
        state = "not needed (native decode step)"
    elif step.torch.compile and step.torch.compile_seconds is not None:
        state = f"done in {step.torch.compile_seconds:.0f} s"
    else:
        state = "failed; decoding eagerly"
    print(f"compiling the decode step: {state}", file=sys.stderr, flush=True)


def load_engine(ckpt_dir: str, cfg, device: str = "cpu", dequantize: bool = False):
    """Engine on a checkpoint dir. An MXFP4 one (`k3 quantize`, the release) keeps its routed experts packed
    (k3.quant.packed: 4.25 bits/weight, dequantized per expert per call) unless `dequantize`."""
    from pathlib import Path

    from k3.config import K3Config
    from k3.infer.engine import Engine
    from k3.quant.checkpoint import is_mxfp4_config, load_mxfp4_checkpoint
    from k3.tokenizer import K3Tokenizer

    d = Path(ckpt_dir)
    if not (d / "config.json").exists() or not is_mxfp4_config(K3Config.load(d)):
        return Engine.from_checkpoint(ckpt_dir, cfg, device=device)
    model, _ = load_mxfp4_checkpoint(d, packed=not dequantize, device=device)
    tokenizer = K3Tokenizer.from_dir(d) if (d / "tokenizer_config.json").exists() else None
    return Engine(model, cfg, tokenizer=tokenizer)


def api_keys(args) -> tuple[str, ...]:
    """The keys of --api-key and --api-key-file (ValueError for a file without any)."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        from pathlib import Path

        lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
        keys += found
    if any(not k for k in keys):
        raise ValueError("--api-key must not be empty")
    return tuple(dict.fromkeys(keys))


def serve_config(args):
    from k3.serve.config import ServeConfig
    from k3.serve.guard import allowed_hosts

    positive = ("max_body_bytes", "max_connections", "header_timeout", "body_timeout", "max_stop_strings",
                "max_stop_chars", "max_json_depth", "max_images", "max_image_pixels")  # fmt: skip
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return ServeConfig(args.served_model_name, api_keys(args), args.max_model_len, args.max_body_bytes,
                       max_output_tokens=args.max_output_tokens, max_header_bytes=args.max_header_bytes,
                       max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                       max_json_depth=args.max_json_depth, max_images=args.max_images,
                       max_image_pixels=args.max_image_pixels,
                       allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                       cors_origins=tuple(args.cors_origin or ()))  # fmt: skip


def run(args) -> int:
    import uvicorn

    from k3.infer.async_engine import AsyncEngine
    from k3.serve.app import create_app
    from k3.serve.guard import ConnectionLimits, guarded_protocol, raise_open_file_limit

    cfg = serve_config(args)  # option errors before the model loads
    limits = ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout)
    raise_open_file_limit(args.max_connections + 256)  # the cap comes before the descriptors run out
    aengine = AsyncEngine(build_engine(args), max_pending=args.max_pending)
    # h11 caps the request line + headers (uvicorn's httptools backend has no such limit); the guarded
    # protocol adds the connection cap and the header / body deadlines (k3.serve.guard)
    config = uvicorn.Config(create_app(aengine, cfg), host=args.host, port=args.port, log_level="warning",
                            http=guarded_protocol(limits),
                            h11_max_incomplete_event_size=args.max_header_bytes)  # fmt: skip
    server = uvicorn.Server(config)
    if args.shutdown_after:
        threading.Timer(args.shutdown_after, lambda: setattr(server, "should_exit", True)).start()
    try:
        server.run()
    finally:
        aengine.shutdown()
    return 0


if __name__ == "__main__":  # `python -m k3.serve.cli ...` (the same as `k3 serve ...`)
    import sys

    _parser = argparse.ArgumentParser(prog="k3 serve")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
