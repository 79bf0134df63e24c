"""Find and drive the llama.cpp peer that bench/peers/llamacpp.sh builds (its `kimi-k3` model, CPU).

    peer = LlamaCppPeer.find()          # raises PeerMissing with the build command if it is not built
    llm = peer.load(gguf_path, n_ctx=2048, threads=2)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)

The model is driven through the Python bindings shipped in the same llama-cpp-python source
distribution (ctypes over the built libllama), loaded from the peer folder, never installed; the
binaries (llama-completion, llama-server, ...) are in `peer.bin`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"
BUILD_COMMAND = "bench/peers/llamacpp.sh"


class PeerMissing(RuntimeError):
    """The llama.cpp peer is not built here (the message says how to build it)."""


def peer_root() -> Path:
    """Where llamacpp.sh puts its build: $K3_PEERS (default ~/.cache/k3/peers)/llama.cpp-VERSION."""
    base = os.environ.get("K3_PEERS") or str(Path.home() / ".cache" / "k3" / "peers")
    return Path(base) / f"llama.cpp-{VERSION}"


@dataclass(frozen=True)
class LlamaCppPeer:
    root: Path

    @classmethod
    def find(cls) -> LlamaCppPeer:
        root = peer_root()
        if not (root / "READY").exists():
            raise PeerMissing(
                f"the llama.cpp peer (llama-cpp-python {VERSION}'s vendored llama.cpp) is not built at "
                f"{root}; build it with `{BUILD_COMMAND}` (about 5-25 minutes on 2 cores, once)"
            )
        return cls(root)

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def source(self) -> Path:
        """The vendored llama.cpp tree (its kimi-k3 model, converter and templates)."""
        return self.root / "src" / "vendor" / "llama.cpp"

    @property
    def chat_template(self) -> Path:
        """The release's own Kimi K3 chat template, as llama.cpp bundles it."""
        return self.source / "models" / "templates" / "Kimi-K3.jinja"

    def describe(self) -> str:
        """A one-line version for reports: the sdist and the build's own version line."""
        info = self.root / "version.txt"
        build = info.read_text().strip() if info.exists() else "version unknown"
        return f"llama.cpp from llama-cpp-python {VERSION} ({build}), CPU build"

    def bindings(self):
        """The `llama_cpp` module of the sdist, bound to the peer's libllama."""
        os.environ["LLAMA_CPP_LIB_PATH"] = str(self.lib)
        src = str(self.root / "src")
        if src not in sys.path:
            sys.path.insert(0, src)
        try:
            import llama_cpp
        except ImportError as e:
            raise PeerMissing(f"cannot import the llama.cpp bindings from {src}: {e}") from e
        return llama_cpp

    def load(self, gguf_path: str | Path, n_ctx: int = 2048, threads: int = 2, n_batch: int = 512):
        """A `llama_cpp.Llama` over `gguf_path` that keeps the logits of every position."""
        llama_cpp = self.bindings()
        return llama_cpp.Llama(
            model_path=str(gguf_path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            verbose=False,
        )
