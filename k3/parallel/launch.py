"""Launching distributed training on this machine: `k3 train --nproc N ...` re-runs itself under torchrun.

    k3 train --nproc 2 --ep 2 ARGS
      -> python -m torch.distributed.run --nproc-per-node=2 --nnodes=1 --master-addr=127.0.0.1
             --master-port=<free> -m k3.train --ep 2 ARGS              (N workers, LOCAL_RANK set)

Each worker runs the one Trainer (k3/train/trainer.py) with a k3.train.distributed.DistributedRuntime:
gloo on CPU, NCCL on CUDA. On several nodes run torchrun yourself with the same `-m k3.train ARGS`
(docs/distributed.md). `python -m k3.parallel.launch --nproc N ARGS` is kept as an alias of
`k3 train --nproc N ARGS`.

The launching process only notes a Ctrl-C while it waits: the terminal delivers it to torchrun and the
workers too, which finish the step, save and exit (torchrun forwards it once more; the trainer treats
the two as one interrupt). It then returns 130, like `k3 train` interrupted on one process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading


def torchrun_argv(nproc: int, argv: list[str], module: str = "k3.train") -> list[str]:
    """The torchrun command line that runs `python -m module argv` (minus any --nproc) on `nproc`
    processes of this machine."""
    from k3.parallel.mesh import _free_port

    if nproc < 1:
        raise ValueError(f"nproc: must be >= 1, got {nproc}")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1"]
    return [*run, "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "-m", module, *rest]


def relaunch(nproc: int, argv: list[str], module: str = "k3.train") -> int:
    """Run `module argv` under torchrun with `nproc` processes; returns torchrun's exit code (130
    after a Ctrl-C that stopped it)."""
    proc = subprocess.Popen(torchrun_argv(nproc, argv, module))
    interrupted = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1)) if main else None
    try:
        code = proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 130 if interrupted and code != 0 else code


def main(argv: list[str] | None = None) -> int:
    from k3.cli import main as k3_main

    return k3_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
