"""The process layout: ParallelDims (dp x ep) -> a 2-D DeviceMesh with axes ("dp", "ep").

Every rank reads its own tokens (expert parallelism borrows data-parallel ranks, as in DeepSeek-V3 and
torchtitan), so world = dp * ep and the "batch" is split over all of it:

    axis "ep"      the E routed experts are split over it; tokens move along it by all-to-all
    axis "dp"      replicas of one expert shard; expert weights are FSDP-sharded along it
    "dp_ep"        both axes flattened: the dense weights are FSDP-sharded over every rank

("axis" is a mesh axis, "dim" a tensor dim.) gloo on CPU, NCCL on CUDA, the same code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """dp * ep = world size; ep must divide the number of routed experts."""

    dp: int
    ep: int

    def __post_init__(self) -> None:
        for key in ("dp", "ep"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.ep

    @classmethod
    def from_world(cls, world_size: int, ep: int) -> ParallelDims:
        if ep < 1 or world_size % ep:
            raise ValueError(f"ep={ep} must divide the world size {world_size}")
        return cls(dp=world_size // ep, ep=ep)

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide num_experts={num_experts}")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> tuple[int, int]:
    """Join the process group torchrun describes (env RANK, WORLD_SIZE, MASTER_ADDR/PORT); a lone
    process without them becomes a world of one on 127.0.0.1. Returns (rank, world_size)."""
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if device_type() == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Meshes:
    """The 2-D ("dp", "ep") root mesh and the 1-D meshes cut from it."""

    root: DeviceMesh
    dp: DeviceMesh
    ep: DeviceMesh
    dp_ep: DeviceMesh  # both axes flattened: every rank


def build_mesh(dims: ParallelDims) -> Meshes:
    """The ("dp", "ep") mesh of the current process group, with its "dp", "ep" and flattened axes."""
    if dims.world_size != dist.get_world_size():
        raise ValueError(f"dp*ep = {dims.world_size} differs from the world size {dist.get_world_size()}")
    root = init_device_mesh(device_type(), (dims.dp, dims.ep), mesh_dim_names=("dp", "ep"))
    return Meshes(root=root, dp=root["dp"], ep=root["ep"], dp_ep=root["dp", "ep"]._flatten("dp_ep"))
