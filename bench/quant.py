"""Measurements of docs/quantization.md: the QAT branch of a high-precision run, and the engine's
resident memory with packed vs dequantized MXFP4 experts.

    python bench/quant.py qat-branch HP_RUN/checkpoints/step-N OUT N
        continue a high-precision `k3 train` run from its step-N checkpoint with `--qat mx
        --qat-from-step N`: the same run as `k3 train <its flags> --qat mx --qat-from-step N` from
        scratch (steps < N are bit-identical to the plain run and resume is bit-exact, both tested in
        tests/quant/test_qat_from_step.py), without training the N shared steps twice.
    python bench/quant.py eval-w4a8 RUN_DIR
        `k3 eval RUN_DIR` (the run's validation tokens and settings) with the routed experts fake-quantized
        as in QAT (MXFP4 weights, MXFP8 E4M3 activations): post-training W4A8.
    python bench/quant.py memory MXFP4_CKPT_DIR [--json F]
        one fresh process per mode (packed, --dequantize): routed-expert bytes, all model tensor bytes,
        RSS after loading and after a 16-token greedy generation (k3.serve.cli.load_engine, the server's
        loader).
"""

import argparse
import json
import subprocess
import sys


def qat_branch(ckpt: str, out: str, n: int) -> None:
    from k3.train.trainer import Trainer, resume_config

    tc = resume_config(ckpt, out=out).replace(model_transforms=("qat-mx",), qat_from_step=n)
    trainer = Trainer(tc, resume=ckpt)
    if trainer.state["step"] != n:
        raise ValueError(f"ckpt: {ckpt} is at step {trainer.state['step']}, not {n}")
    print(json.dumps(trainer.run(measure_peak=False), default=str))


def eval_w4a8(run_dir: str) -> None:
    from k3.data import load_corpus, tokenize_documents
    from k3.quant.qat import convert_qat
    from k3.train.cli import _load
    from k3.train.config import TrainConfig
    from k3.train.evaluate import evaluate, token_byte_lengths

    model, _, tok, tc = _load(run_dir)  # FP32, like k3 eval
    convert_qat(model, "mx", enabled=True)
    run = tc or TrainConfig()
    docs = tokenize_documents(tok, load_corpus(run.data, "val", run.val_percent).documents)
    res = evaluate(model, docs, token_byte_lengths(tok), tok.eos_id, seq_len=run.seq_len,
                   batch_size=run.batch_size, max_tokens=run.eval_tokens, bf16=run.bf16)  # fmt: skip
    print(json.dumps(res))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def memory_one(ckpt: str, mode: str) -> dict:
    import resource

    import torch

    from k3.infer.config import EngineConfig
    from k3.infer.sequence import SamplingParams
    from k3.quant.packed import expert_bytes
    from k3.serve.cli import load_engine

    torch.set_num_threads(1)
    before = _rss_mib()
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=64, max_model_len=256, max_num_seqs=2)
    engine = load_engine(ckpt, cfg, dequantize=mode == "dequantize")
    loaded = _rss_mib()
    storages = {}
    for t in [*engine.model.parameters(), *engine.model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    engine.generate([list(range(1, 9))], SamplingParams(max_tokens=16, ignore_eos=True))
    b = expert_bytes(engine.model)
    return {
        "mode": mode,
        "expert_bytes": b["packed"] + b["dense"],
        "bf16_expert_bytes": b["bf16_equivalent"],
        "model_tensor_bytes": sum(storages.values()),
        "rss_before_load_mib": round(before, 1),
        "rss_after_load_mib": round(loaded, 1),
        "rss_after_generate_mib": round(_rss_mib(), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def memory(ckpt: str, json_out: str | None) -> None:
    rows = []
    for mode in ("packed", "dequantize"):
        cmd = [sys.executable, __file__, "_memory-one", ckpt, mode]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    p, d = rows
    mib = 1 << 20
    print("| | packed | --dequantize | ratio |\n|---|---|---|---|")
    for key, unit in [("expert_bytes", mib), ("model_tensor_bytes", mib)]:
        print(f"| {key} (MiB) | {p[key] / unit:.2f} | {d[key] / unit:.2f} | {p[key] / d[key]:.4f} |")
    for key in ("rss_after_load_mib", "rss_after_generate_mib", "peak_rss_mib"):
        print(f"| {key} | {p[key]} | {d[key]} | {p[key] / d[key]:.3f} |")
    print(f"(RSS before loading: {p['rss_before_load_mib']} / {d['rss_before_load_mib']} MiB)")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"bench": "quant_memory", "rows": rows}, f, indent=2)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_memory-one":
        print(json.dumps(memory_one(sys.argv[2], sys.argv[3])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("qat-branch")
    b.add_argument("ckpt")
    b.add_argument("out")
    b.add_argument("n", type=int)
    e = sub.add_parser("eval-w4a8")
    e.add_argument("run_dir")
    m = sub.add_parser("memory")
    m.add_argument("ckpt")
    m.add_argument("--json")
    args = p.parse_args()
    if args.cmd == "qat-branch":
        qat_branch(args.ckpt, args.out, args.n)
    elif args.cmd == "eval-w4a8":
        eval_w4a8(args.run_dir)
    else:
        memory(args.ckpt, args.json)


if __name__ == "__main__":
    main()
