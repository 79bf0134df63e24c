"""Distributed training entry: `torchrun --nproc-per-node N -m k3.parallel.launch ...` (gloo on CPU,
NCCL on CUDA), or `python -m k3.parallel.launch --nproc N ...`, which re-launches itself under torchrun.

Each step: every rank takes its slice of the global batch (rank r of dp x ep reads rows
r*B/world .. (r+1)*B/world), forward + backward (EP all-to-alls inside the MoE layers, FSDP2
all-gathers / reduce-scatters around the units), DTensor-aware grad clip, DistMuon + AdamW, then
Quantile Balancing for every router with one all-reduce. Logs the mean loss over ranks, the grad norm
and the EP drop rate (JSON lines on rank 0). DCP checkpoints with --save / --resume.

Data: `--data synthetic` (seeded random tokens, the same global batch for any world size: what the
equivalence tests use). The real corpus pipeline is the single-process trainer's (k3.train); see
docs/distributed.md for what is left.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from k3.config import load_config
from k3.parallel.apply import parallelize
from k3.parallel.dcp import load_dcp, save_dcp
from k3.parallel.expert_parallel import drop_stats
from k3.parallel.fsdp import clip_grad_norm_
from k3.parallel.mesh import ParallelDims, build_mesh, device_type, init_distributed
from k3.parallel.muon_dist import DistMuon
from k3.parallel.qb_dist import update_all_router_biases


def build_model(config, seed: int):
    """The same initial weights on every rank (built full-size, then sharded by parallelize)."""
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    init_weights(model, config.initializer_range, config.num_hidden_layers, seed=seed)
    return model.to(device_type())


def build_optimizers(model, lr: float, adamw_lr: float, weight_decay: float, per_head: bool = True):
    """[DistMuon, AdamW] over the k3.train.param_groups split (Per-Head Muon splits from SPEC §4.2)."""
    from k3.train.param_groups import classify  # the single-process trainer's table, reused

    groups, params = classify(model, per_head=per_head), dict(model.named_parameters())
    muon = [
        {"params": [params[n] for n in names], "head_split": split}
        for split, names in sorted(groups.muon.items(), key=lambda kv: str(kv[0]))
    ]
    adamw = [
        {"params": [params[n] for n in names], "weight_decay": wd}
        for names, wd in ((groups.adamw_decay, weight_decay), (groups.adamw_no_decay, 0.0))
        if names
    ]
    return [
        DistMuon(muon, lr=lr, weight_decay=weight_decay),
        torch.optim.AdamW(adamw, lr=adamw_lr, betas=(0.9, 0.95), eps=1e-8, foreach=False),
    ]


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int, rank: int, world: int):
    """This rank's rows of the step's global [batch, seq + 1] random-token batch -> (inputs, labels)."""
    if batch % world:
        raise ValueError(f"batch={batch} must be divisible by the world size {world}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    rows = ids[rank * batch // world : (rank + 1) * batch // world].to(device_type())
    return rows[:, :-1], rows[:, 1:]


def train_step(model, optimizers, inputs, labels, grad_clip: float) -> dict:
    """One optimizer step on this rank's micro-batch; returns global mean loss, grad norm, QB stats."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss = model(inputs, labels=labels).loss
    loss.backward()
    norm = clip_grad_norm_(
        [p for opt in optimizers for g in opt.param_groups for p in g["params"]], grad_clip
    )
    for opt in optimizers:
        opt.step()
    loads = update_all_router_biases(model)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    drops = torch.tensor(list(drop_stats(model).values())[:2], dtype=torch.float64, device=mean.device)
    dist.all_reduce(drops)
    return {"loss": float(mean) / dist.get_world_size(), "grad_norm": float(norm),
            "drop_rate": float(drops[0] / drops[1].clamp(min=1)),
            "max_load": max((s["max_load"] for s in loads.values()), default=0.0)}  # fmt: skip


def train(args) -> list[dict]:
    rank, world = init_distributed()
    dims = ParallelDims.from_world(world, args.ep)
    config = load_config(args.preset)
    dims.check_experts(config.num_experts)
    mesh = build_mesh(dims)
    model = parallelize(build_model(config, args.seed), mesh, capacity_factor=args.capacity_factor)
    optimizers = build_optimizers(model, args.lr, args.adamw_lr, args.weight_decay)
    start = load_dcp(args.resume, model, optimizers) if args.resume else 0
    log = []
    for step in range(start, args.steps):
        inputs, labels = synthetic_batch(
            step, args.batch, args.seq, config.vocab_size, args.seed, rank, world
        )
        t0 = time.perf_counter()
        rec = {"step": step + 1, **train_step(model, optimizers, inputs, labels, args.grad_clip)}
        rec["seconds"] = time.perf_counter() - t0
        log.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
        if args.save and (step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)):
            save_dcp(os.path.join(args.save, f"step-{step + 1}"), model, optimizers, step + 1, config)
    if args.log_file and rank == 0:
        with open(args.log_file, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
    dist.barrier()
    dist.destroy_process_group()
    return log


def add_arguments(parser) -> None:
    parser.description = "Distributed (dp x ep, FSDP2) training of a K3 model; run under torchrun."
    parser.add_argument("--preset", default="k3-nano", help="a preset name or a config.json path")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides world and E)")
    parser.add_argument("--batch", type=int, default=4, help="global sequences per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--data", choices=("synthetic",), default="synthetic")
    parser.add_argument("--lr", type=float, default=0.02, help="Muon lr (AdamW-matched units)")
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="directory for DCP checkpoints (step-N subdirs)")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", default=None, help="a DCP checkpoint directory to resume from")
    parser.add_argument("--log-file", default=None, help="write the per-step records here (JSON lines)")
    parser.add_argument("--nproc", type=int, default=None, help="re-launch under torchrun with N processes")


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """The torchrun command line that runs this module with `argv` (minus --nproc) on `nproc` processes."""
    from k3.parallel.mesh import _free_port

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1"]
    return [
        *run,
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        "-m",
        "k3.parallel.launch",
        *rest,
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="k3.parallel.launch")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.nproc and "LOCAL_RANK" not in os.environ:
        import subprocess

        return subprocess.call(torchrun_argv(args.nproc, argv))
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
