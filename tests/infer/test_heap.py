"""k3.infer.heap: with the thresholds set, megabyte activations come from the C heap and freed ones stay
resident (checked in fresh interpreters, where glibc's thresholds are still its defaults)."""

import subprocess
import sys
import textwrap

import pytest

from k3.infer import heap
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine

PROBE = textwrap.dedent(
    """
    import sys, torch
    from k3.infer import heap

    def heap_range():
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
        return 0, 0

    if sys.argv[1] == "keep":
        assert heap.keep_freed_memory() is True
    t = torch.ones(5 << 20)  # 20 MB
    lo, hi = heap_range()
    in_heap = lo <= t.data_ptr() < hi
    del t
    print(in_heap, heap_range()[1] >= hi)
    """
)


def _probe(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_serves_and_keeps_large_blocks_from_the_heap():
    in_heap, kept = _probe("keep")
    assert in_heap == "True", "a 20 MB tensor should come from the heap below the 32 MB mmap threshold"
    assert kept == "True", "freeing it should leave the heap's top resident (no trim)"
    in_heap_default, _ = _probe("default")
    assert in_heap_default == "False", "glibc's default should mmap a first 20 MB block (the probe's premise)"


@pytest.mark.parametrize("keep", [True, False])
def test_engine_sets_the_heap_thresholds_unless_switched_off(monkeypatch, nano, keep):
    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    Engine(nano, EngineConfig(max_model_len=256, num_pages=8, keep_freed_memory=keep))
    assert calls == ([1] if keep else [])
