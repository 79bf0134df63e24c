"""k3.infer.memory. The heap: with the thresholds set, megabyte activations come from the C heap and freed
ones stay resident (checked in fresh interpreters, where glibc's thresholds are still its defaults). Huge
pages: a model's weights moved into one huge-page-advised mapping keep their values, dtypes, shapes and
ties, give the same logits bit for bit, and (where the kernel offers transparent huge pages to advised
memory) sit in 2 MB pages."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from k3.config import preset
from k3.infer import memory
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM

huge_pages = pytest.mark.skipif(not memory.huge_pages_available(), reason="Linux with MADV_HUGEPAGE only")

PROBE = textwrap.dedent(
    """
    import sys, torch
    from k3.infer import memory

    def heap_range():
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
        return 0, 0

    if sys.argv[1] == "keep":
        assert memory.keep_freed_memory() is True
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
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append(1) or True)
    Engine(nano, EngineConfig(max_model_len=256, num_pages=8, keep_freed_memory=keep))
    assert calls == ([1] if keep else [])


def nano_model():
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("k3-nano").replace(dtype="float32"))
    init_weights(model, 0.5, model.config.num_hidden_layers, seed=0)
    return model.eval()


@huge_pages
def test_values_ties_and_logits_are_kept():
    model = nano_model()
    model.lm_head.weight = model.model.embed_tokens.weight  # a tie to keep
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size - 256, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    tied = model.lm_head.weight.nbytes
    assert memory.rehome(model) >= sum(v.nbytes for v in before.values()) - tied  # one copy of a tie
    after = model.state_dict()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].shape == v.shape and torch.equal(after[k], v), k
        assert after[k].data_ptr() % memory.ALIGN == 0, k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert min(v.data_ptr() for v in after.values()) % memory.HUGE == 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert memory.rehome(model) == 0  # once per model


def _anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


def _thp_for_advised_memory() -> bool:
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in enabled


@huge_pages
def test_the_weights_land_in_huge_pages():
    if not _thp_for_advised_memory():
        pytest.skip("this kernel has transparent huge pages off ([never])")
    model = torch.nn.Linear(2048, 2048, bias=False)  # 16 MB: eight 2 MB pages
    start = _anon_huge_kb()
    memory.rehome(model)
    assert _anon_huge_kb() - start >= 4 * 1024, "no 2 MB pages behind the advised weights"
