"""k3.infer.huge_pages: a model's weights moved into one huge-page-advised mapping keep their values,
dtypes, shapes and ties, give the same logits bit for bit, and (where the kernel offers transparent huge
pages to advised memory) sit in 2 MB pages."""

import re
from pathlib import Path

import pytest
import torch

from k3.config import preset
from k3.infer import huge_pages
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="Linux with MADV_HUGEPAGE only")


def nano():
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("k3-nano").replace(dtype="float32"))
    init_weights(model, 0.5, model.config.num_hidden_layers, seed=0)
    return model.eval()


def test_values_ties_and_logits_are_kept():
    model = nano()
    model.lm_head.weight = model.model.embed_tokens.weight  # a tie to keep
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size - 256, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    tied = model.lm_head.weight.nbytes
    assert huge_pages.rehome(model) >= sum(v.nbytes for v in before.values()) - tied  # one copy of a tie
    after = model.state_dict()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].shape == v.shape and torch.equal(after[k], v), k
        assert after[k].data_ptr() % huge_pages.ALIGN == 0, k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert min(v.data_ptr() for v in after.values()) % huge_pages.HUGE == 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert huge_pages.rehome(model) == 0  # once per model


def _anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


def _thp_for_advised_memory() -> bool:
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in enabled


def test_the_weights_land_in_huge_pages():
    if not _thp_for_advised_memory():
        pytest.skip("this kernel has transparent huge pages off ([never])")
    model = torch.nn.Linear(2048, 2048, bias=False)  # 16 MB: eight 2 MB pages
    start = _anon_huge_kb()
    huge_pages.rehome(model)
    assert _anon_huge_kb() - start >= 4 * 1024, "no 2 MB pages behind the advised weights"
