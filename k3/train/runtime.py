"""Where the training maths meets the devices: the single-process runtime the Trainer uses by default.

The Trainer and `train_step` are written once; everything that differs between one process and a
torch.distributed job goes through a runtime object with the methods below. `LocalRuntime` (this file)
is one process on the CPU: reductions are the identity, the model is used as built, checkpoints are
k3.train.checkpointing's. `k3.train.distributed.DistributedRuntime` overrides the same methods for a
dp x ep mesh (parallelize, DistMuon, all-reduces, DCP checkpoints); see docs/distributed.md.

    model        prepare_model(model) -> model, muon_class, device
    data         rank / world_size (this process's share of every batch), main_first() around caching
    step         mean_loss, sum, clip_grad_norm_, max_logits, qk_clip_, update_router_biases, step_stats
    loop         any(flag), broadcast(int), barrier()
    checkpoints  save_checkpoint, load_checkpoint, consolidate (the final official-layout model)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from k3.model.moe import update_router_biases
from k3.optim import Muon, qk_clip_


class LocalRuntime:
    """One process, one device (CPU): every collective is the identity."""

    distributed = False
    rank, world_size, is_main = 0, 1, True
    device = torch.device("cpu")
    muon_class = Muon

    def describe(self) -> str:
        return "1 process"

    # ---- model / data -------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module, capacity_factor: float = 1.25) -> nn.Module:
        """The model to train (here: as built; `capacity_factor` is expert parallelism's)."""
        return model

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. tokenizer training + caches), then the others."""
        yield

    # ---- reductions (every rank calls them in the same order) ----------------------------------------
    def mean_loss(self, loss: float) -> float:
        """Mean over ranks of each rank's mean loss (equal token counts: the global mean)."""
        return loss

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def broadcast(self, value: int) -> int:
        """Rank 0's value on every rank."""
        return value

    def barrier(self) -> None:
        pass

    # ---- step seams ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def max_logits(self, s_max: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-head max logits of every MLA layer, maxed over ranks."""
        return s_max

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
        """k3.optim.qk_clip_ on the parameters `q_w`, `kv_w` (in place); gamma [H]."""
        return qk_clip_(q_w.data, kv_w.data, s_max, dn, dr, dv, tau)

    def update_router_biases(self, model: nn.Module) -> dict[str, dict]:
        return update_router_biases(model)

    def step_stats(self, model: nn.Module) -> dict[str, float]:
        """Extra per-step metrics of the parallel layer (the EP drop rate); none here."""
        return {}

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(
        self, run_dir, step, model, config, optimizers, trainer_state, *, tokenizer, keep
    ) -> Path:
        from k3.train.checkpointing import save_training_checkpoint

        return save_training_checkpoint(
            run_dir, step, model, config, optimizers, trainer_state, tokenizer=tokenizer, keep=keep
        )

    def load_checkpoint(self, path: Path, model: nn.Module, optimizers: list) -> dict:
        from k3.train.checkpointing import load_training_checkpoint

        return load_training_checkpoint(path, model, optimizers)

    def consolidate(self, ckpt_dir: Path, run_dir: Path) -> nn.Module | None:
        """Write the official-layout model of a distributed checkpoint into `run_dir` (rank 0) and
        return it unsharded; None here: a local checkpoint already is in that layout."""
        return None

    def close(self, clean: bool = True) -> None:
        """End of the run (`clean`: every rank got here; else after an error, without waiting)."""
