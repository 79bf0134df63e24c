"""The llama.cpp peer for the interop tests: found, or a failure that says how to build it."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from peers.llamacpp import LlamaCppPeer, PeerMissing  # noqa: E402


@pytest.fixture(scope="session")
def llamacpp():
    """The built llama.cpp peer. Missing: the test fails with the build command, unless a person set
    K3_SKIP_PEERS=1 to skip the peer tests on purpose."""
    try:
        return LlamaCppPeer.find()
    except PeerMissing as e:
        if os.environ.get("K3_SKIP_PEERS") == "1":
            pytest.skip(f"K3_SKIP_PEERS=1: {e}")
        pytest.fail(str(e))
