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
        "at start-up, tens of seconds; k3-tiny on a CPU: ~2.8x faster single-stream decode, docs/serving.md)",
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
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--served-model-name", default="kimi-k3")
    parser.add_argument("--max-pending", type=int, default=256, help="requests in flight before 503")
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="max_tokens limit per request and its default (default: the context length)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit (413)")
    parser.add_argument(
        "--max-header-bytes", type=int, default=16 << 10, help="request line + headers limit (431)"
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
                       compile=getattr(args, "compile", False))  # fmt: skip
    from k3.vision.serving import is_vl_checkpoint, load_vl_engine

    if is_vl_checkpoint(args.checkpoint):  # images through the chat API (k3.vision.serving)
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
    if step.native() is not None:  # the whole-model C step decodes; nothing was compiled for it
        state = "not needed (native decode step)"
    elif step.compile and step.compile_seconds is not None:
        state = f"done in {step.compile_seconds:.0f} s"
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


def run(args) -> int:
    import uvicorn

    from k3.infer.async_engine import AsyncEngine
    from k3.serve.app import ServeConfig, create_app

    aengine = AsyncEngine(build_engine(args), max_pending=args.max_pending)
    cfg = ServeConfig(args.served_model_name, args.api_key, args.max_model_len, args.max_body_bytes,
                      max_output_tokens=args.max_output_tokens,
                      max_header_bytes=args.max_header_bytes)  # fmt: skip
    # h11 caps the request line + headers (uvicorn's httptools backend has no such limit)
    config = uvicorn.Config(create_app(aengine, cfg), host=args.host, port=args.port, log_level="warning",
                            http="h11", h11_max_incomplete_event_size=args.max_header_bytes)  # fmt: skip
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
