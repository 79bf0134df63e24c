"""`k3 export SRC --out OUT [--format hf|gguf]`: a checkpoint in the release layout, or a GGUF for llama.cpp.

    k3 export runs/k3-tiny --out k3-tiny-release                     # release layout (safetensors)
    k3 export runs/k3-tiny --out k3-tiny.gguf --format gguf          # llama.cpp's kimi-k3, f32
    k3 export runs/k3-tiny --out k3-tiny-q8.gguf --format gguf --outtype q8_0
    k3 export runs/k3-tiny --out k3-tiny-moe.gguf --format gguf --outtype mxfp4_moe   # llama.cpp's recipe

SRC is a checkpoint directory, a run folder (its final weights, else its latest checkpoints/step-N), a
`k3 quantize` output, or a DCP checkpoint of distributed training. See docs/interop.md.
"""

import time
from pathlib import Path

from k3.export.gguf import OUTTYPES
from k3.export.hf import DTYPES


def add_arguments(parser) -> None:
    parser.description = (
        "Export a checkpoint: the release's safetensors layout (--format hf) or a GGUF file that "
        "llama.cpp's kimi-k3 model runs (--format gguf)."
    )
    parser.add_argument("source", help="checkpoint, run folder, quantized checkpoint or DCP checkpoint")
    parser.add_argument("--out", required=True, help="output directory (hf) or .gguf file / directory (gguf)")
    parser.add_argument("--format", choices=("hf", "gguf"), default="hf", help="output format (default hf)")
    parser.add_argument(
        "--outtype",
        choices=OUTTYPES,
        default="f32",
        help="GGUF tensor storage: f32, bf16, q8_0 matrices, mxfp4 routed experts, or mxfp4_moe "
        "(llama.cpp's MXFP4_MOE: MXFP4 experts, Q8_0 matrices) (default f32)",
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="keep", help="hf: floating dtype to store (default keep)"
    )


def run(args) -> int:
    from k3.export.source import load_source

    start = time.perf_counter()
    print(f"reading {args.source}")
    source = load_source(args.source)
    print(f"  weights from {source.checkpoint}")
    if args.format == "hf":
        from k3.export.hf import export_hf

        out = export_hf(source, args.out, dtype=args.dtype)
    else:
        from k3.export.gguf import write_gguf

        if source.tokenizer_dir is None:
            raise ValueError(f"{args.source}: no tokenizer.json found beside the weights; a GGUF needs one")
        out = Path(args.out)
        if out.is_dir():
            out = out / f"{Path(args.source).resolve().name}-{args.outtype}.gguf"
        state = source.model.state_dict()
        out = write_gguf(state, source.config, source.tokenizer_dir, out, outtype=args.outtype)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0
