"""The server processes the benches drive: `Server` starts one (its own process group, output to a log)
and stops it whatever happens; the load itself is k3.serve.loadgen's, the same client for every server.

    with Server(cmd, port, log) as url:      # a subprocess, up when /health answers 200
        result = asyncio.run(burst(url, prompts, max_tokens=128))
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its own process group, output to `log`), stopped on exit whatever happens."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict | None = None, start_s: float = 900):
        self.cmd, self.port, self.log, self.env, self.start_s = cmd, port, log, env, start_s
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> str:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as f:
            f.write("$ " + " ".join(self.cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
            )
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.start_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} at start-up; log: {self.log}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:  # refused while starting, a non-200 answer (HTTPError), a timeout
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.start_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
