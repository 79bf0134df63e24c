"""A world-of-one gloo process group for the in-process k3.parallel tests (module-scoped, torn down)."""

import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world1():
    from k3.parallel.mesh import ParallelDims, build_mesh

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield build_mesh(ParallelDims(1, 1))
    dist.destroy_process_group()
