"""Multi-process (2 CPU processes, gloo, torchrun) check of expert parallelism:
dispatch + combine on 2 ranks equals the single-process result exactly (nothing dropped; bitwise for
row-wise experts, GEMM rounding only for the GLU experts).

Distributed training itself (EP=2 vs one process, save on 2 ranks / resume on 1, `k3 export`) is
tests/parallel/test_train_distributed.py, through `k3 train --nproc 2`.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT = 240  # seconds per launch; generous for a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    return env


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _torchrun(nproc: int, *args: str) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
          "--master-addr=127.0.0.1", f"--master-port={_free_port()}", *args])  # fmt: skip


def test_dispatch_combine_two_ranks_equals_single_process(tmp_path):
    out = tmp_path / "dispatch.json"
    _torchrun(2, str(HERE / "dispatch_worker.py"), str(out))
    r = json.loads(out.read_text())
    assert r["dropped"] == 0
    assert r["rowwise_equal"], f"dispatch/combine not exact: max diff {r['rowwise_max_diff']}"
    assert r["max_diff"] < 1e-6  # real GLU experts: the GEMM row count differs (ep*C vs per-expert count)
    assert r["z_grad_diff"] < 1e-6
    assert r["w1_grad_diff"] <= 1e-6 * max(1.0, r["w1_grad_scale"])
