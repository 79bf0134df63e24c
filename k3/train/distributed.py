"""The Trainer on a torch.distributed dp x ep mesh: k3.train.runtime.LocalRuntime's methods, distributed.

`k3 train --nproc N --ep E` (or torchrun ... -m k3.train ...) runs the one Trainer (k3/train/trainer.py)
with a `DistributedRuntime`; the trainer and the step never branch on the world size, they call:

    prepare_model    model.to(device) -> parallelize(model, mesh): EP -> histogram QB -> FSDP2
    muon_class       DistMuon (whole matrices / head blocks gathered for Newton-Schulz)
    rank/world_size  the data rank: every rank (EP borrows data-parallel ranks) reads its own
                     batch_size / world_size rows of each global micro-batch
    mean_loss, sum   float64 all-reduces (the step's loss, tokens, eval sums, the stop flags)
    clip_grad_norm_  k3.parallel.fsdp.clip_grad_norm_ (each DTensor grad's norm on its own mesh)
    max_logits       per-head max logits all-reduced with MAX, so QK-Clip is the same on every rank
    qk_clip_         on sharded q_b_proj / kv_b_proj: gather the full matrices (only when a head
                     exceeds tau), clip, keep this rank's slice
    update_router_biases  histogram QB, one all-reduce for all layers
    step_stats       the EP drop rate over all ranks
    checkpoints      DCP (k3.parallel.dcp.save_training_dcp / load_training_dcp): a run saved on N
                     ranks resumes on M; the final one is also consolidated into the run directory

Every method is collective unless it says otherwise: all ranks call them in the same order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from k3.optim import clip_factors, qk_clip_
from k3.parallel.apply import parallelize
from k3.parallel.dcp import load_model_no_dist, load_training_dcp, save_training_dcp
from k3.parallel.expert_parallel import drop_stats
from k3.parallel.fsdp import clip_grad_norm_
from k3.parallel.mesh import ParallelDims, build_mesh, device_type, init_distributed
from k3.parallel.muon_dist import DistMuon
from k3.parallel.qb_dist import update_all_router_biases
from k3.train.runtime import LocalRuntime


@dataclass(frozen=True)
class ParallelOptions:
    """The layout of a distributed run: ep divides the world size (dp = world / ep) and num_experts.
    (The expert capacity factor changes what is computed, so it is TrainConfig.capacity_factor.)"""

    ep: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep: must be a positive integer, got {self.ep!r}")


class DistributedRuntime(LocalRuntime):
    """Joins the process group torchrun describes (a world of one without it) and builds the mesh."""

    distributed = True
    muon_class = DistMuon

    def __init__(self, options: ParallelOptions | None = None):
        self.options = options or ParallelOptions()
        local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if device_type() == "cuda" and local >= gpus:
            per_node = os.environ.get("LOCAL_WORLD_SIZE", "?")
            raise ValueError(f"nproc: {per_node} processes on this node, but it has {gpus} GPU(s)")
        self.rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        self.dims = ParallelDims.from_world(self.world_size, self.options.ep)
        self.mesh = build_mesh(self.dims)
        cuda = device_type() == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def describe(self) -> str:
        procs = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        return f"{procs} ({dist.get_backend()}): dp={self.dims.dp} x ep={self.dims.ep}"

    def layout(self) -> dict:
        return {"world_size": self.world_size, "dp": self.dims.dp, **asdict(self.options)}

    # ---- model / data -------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module, capacity_factor: float = 1.25) -> nn.Module:
        self.dims.check_experts(model.config.num_experts)
        return parallelize(model.to(self.device), self.mesh, capacity_factor=capacity_factor)

    @contextlib.contextmanager
    def main_first(self):
        if not self.is_main:
            dist.barrier()
        yield
        if self.is_main:
            dist.barrier()

    # ---- reductions ---------------------------------------------------------------------------------
    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def mean_loss(self, loss: float) -> float:
        return self._all_reduce([loss])[0] / self.world_size

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(list(values))

    def any(self, flag: bool) -> bool:
        return self._all_reduce([float(bool(flag))], dist.ReduceOp.MAX)[0] > 0

    def broadcast(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(t, 0)
        return int(t[0])

    def barrier(self) -> None:
        dist.barrier()

    # ---- step seams ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(params, max_norm)

    def max_logits(self, s_max: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = sorted(s_max)
        if not names:
            return {}
        stacked = torch.stack([s_max[n].float().to(self.device) for n in names])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        return dict(zip(names, stacked.unbind(0), strict=True))

    @torch.no_grad()
    def qk_clip_(
        self,
        q_w: torch.Tensor,
        kv_w: torch.Tensor,
        s_max: torch.Tensor,
        dn: int,
        dr: int,
        dv: int,
        tau: float,
    ) -> torch.Tensor:
        gamma = clip_factors(s_max, tau)
        if not isinstance(q_w, DTensor):
            return super().qk_clip_(q_w, kv_w, s_max, dn, dr, dv, tau)
        if not bool((gamma < 1).any()):  # the same decision on every rank: s_max is maxed over ranks
            return gamma
        full_q, full_kv = q_w.full_tensor(), kv_w.full_tensor()  # all-gathers of the row shards
        qk_clip_(full_q, full_kv, s_max, dn, dr, dv, tau)
        for w, full in ((q_w, full_q), (kv_w, full_kv)):
            mesh = w.device_mesh
            whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
            w.to_local().copy_(whole.redistribute(mesh, w.placements).to_local())  # a local slice
        return gamma

    def update_router_biases(self, model: nn.Module) -> dict[str, dict]:
        return update_all_router_biases(model)

    def step_stats(self, model: nn.Module) -> dict[str, float]:
        local = drop_stats(model)
        dropped, routed = self._all_reduce([local["dropped"], local["routed"]])
        return {"drop_rate": dropped / max(routed, 1.0)} if routed else {}

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(
        self, run_dir, step, model, config, optimizers, trainer_state, *, tokenizer, keep
    ) -> Path:
        return save_training_dcp(
            run_dir,
            step,
            model,
            optimizers,
            config,
            trainer_state,
            tokenizer=tokenizer,
            keep=keep,
            layout=self.layout(),
        )

    def load_checkpoint(self, path: Path, model: nn.Module, optimizers: list) -> dict:
        return load_training_dcp(path, model, optimizers)

    def consolidate(self, ckpt_dir: Path, run_dir: Path) -> nn.Module | None:
        """Rank 0 (no communication): the unsharded model of the DCP checkpoint, also written to
        `run_dir` in the official layout (config.json + safetensors, each file replaced atomically)."""
        if not self.is_main:
            return None
        from k3.checkpoint import save_checkpoint

        with warnings.catch_warnings():  # DCP warns that it loads without a process group: intended
            warnings.simplefilter("ignore", UserWarning)
            model, config, _ = load_model_no_dist(ckpt_dir)
        tmp = Path(run_dir) / f".consolidated-tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(model, config, tmp)
        for f in sorted(tmp.iterdir()):
            os.replace(f, Path(run_dir) / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
        return model.float().eval()

    def close(self, clean: bool = True) -> None:
        if dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()
