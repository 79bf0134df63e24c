"""MLAAttention's streaming path (online softmax over the state's latent blocks) and ragged states:
chunked prefill of any chunk sizes == one pass, and a ragged batch == each row alone."""

import pytest
import torch
from torch import nn

import k3.model.mla as mla_mod
from k3.config import preset
from k3.infer.cache.paged_mla import PagedBatch, PagedMLAState
from k3.model.layers import Linear
from k3.model.mla import MLAAttention
from k3.model.state import MLAState

CFG = preset("k3-nano").replace(dtype="float32")
ROPE = CFG.replace(mla_use_nope=False)


def build(config) -> MLAAttention:
    torch.manual_seed(0)
    layer = MLAAttention(config, layer_idx=3)
    for m in layer.modules():  # unit-scale projections so attention is far from uniform
        if isinstance(m, Linear):
            nn.init.normal_(m.weight, 0.0, 2.0 * m.in_features**-0.5)
    return layer.eval()


def inputs(B, T, seed=1):
    return torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))


def _rel_err(ref, got):
    return ((ref.double() - got.double()).abs().max() / ref.double().abs().max()).item()


class _NoAppend(MLAState):
    """An MLAState whose dense gather is forbidden: proves the streaming path was taken."""

    def append(self, new):
        raise AssertionError("streaming path expected, got the dense gather")

    def write(self, new):
        MLAState.append(self, new)


@pytest.mark.parametrize("config", [CFG, ROPE], ids=["nope", "rope"])
@pytest.mark.parametrize("chunks", [[1] * 9, [5, 3, 1], [2, 7]], ids=lambda c: "+".join(map(str, c)))
@pytest.mark.parametrize("expand", [False, True], ids=["absorbed", "expanded"])
def test_streaming_chunked_prefill_equals_one_pass(monkeypatch, config, chunks, expand):
    layer = build(config)
    x = inputs(2, sum(chunks))
    monkeypatch.setattr(mla_mod, "MIN_BLOCK", 2)  # several blocks, not dividing the key counts
    monkeypatch.setattr(mla_mod, "expand_pays", lambda *a: expand)  # either form of the blocks
    with torch.no_grad():
        full = layer(x)
        monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 0)  # always stream
        state, parts, t = _NoAppend(), [], 0
        for n in chunks:
            parts.append(layer(x[:, t : t + n], state=state))
            t += n
    assert state.length == x.shape[1]
    assert _rel_err(full, torch.cat(parts, 1)) < 1e-5


def test_long_chunks_stream_expanded(monkeypatch):
    """The layer asks expand_pays with the chunk's query count and its own dims."""
    layer, asked = build(CFG), []
    monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 0)
    monkeypatch.setattr(mla_mod, "expand_pays", lambda *a: asked.append(a) or False)
    with torch.no_grad():
        layer(inputs(1, 6), state=_NoAppend())
    assert asked == [(6, CFG.kv_lora_rank, CFG.qk_nope_head_dim, CFG.v_head_dim)]


def test_threshold_picks_the_path(monkeypatch):
    layer = build(CFG)
    with torch.no_grad():
        monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 31)
        layer(inputs(1, 4), state=_NoAppend())  # H*T*S = 2*4*4 = 32 > 31: streams
        monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 32)
        with pytest.raises(AssertionError, match="streaming path expected"):
            layer(inputs(1, 4), state=_NoAppend())  # 32 <= 32: dense


@pytest.mark.parametrize(
    "config,stream,T",
    [(CFG, False, 1), (CFG, True, 1), (ROPE, True, 3), (ROPE, False, 3), (CFG, "expanded", 3)],
    ids=["nope-dense-T1", "nope-streaming-T1", "rope-streaming-T3", "rope-dense-T3", "nope-expanded-T3"],
)
def test_ragged_paged_batch_equals_rows_alone(monkeypatch, config, stream, T):
    """Rows with 0, 5 and 11 cached tokens in scattered pages, fed T tokens together == each alone."""
    if stream:
        monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 0)
        monkeypatch.setattr(mla_mod, "MIN_BLOCK", 3)
        monkeypatch.setattr(mla_mod, "expand_pays", lambda *a: stream == "expanded")
    layer, ps, lengths = build(config), 4, [5, 0, 11]
    W = config.kv_lora_rank + config.qk_rope_head_dim
    pool = torch.full((16 * ps, W), 7.0)  # never-written rows hold garbage the mask must hide
    tables = [[9, 2], [5], [0, 14, 3, 11]]  # pages per row, enough for c_b + T tokens
    histories = [inputs(1, c, seed=10 + b) for b, c in enumerate(lengths)]
    x = inputs(3, T, seed=20)
    alone = []
    with torch.no_grad():
        for b, c in enumerate(lengths):
            dense = MLAState()
            if c:  # the history through the layer, alone and into the row's pages
                layer(histories[b], state=dense)
                single = PagedBatch.from_tables([tables[b]], [0], c, ps)
                PagedMLAState(pool, single).write(dense.latent)
            alone.append(layer(x[b : b + 1], state=dense))
        state = PagedMLAState(pool, PagedBatch.from_tables(tables, lengths, T, ps))
        together = layer(x, state=state)
    assert state.lengths.tolist() == [c + T for c in lengths] and state.length == 11 + T
    assert _rel_err(torch.cat(alone), together) < 1e-5


@pytest.mark.parametrize("config", [CFG, ROPE], ids=["nope", "rope"])
@pytest.mark.parametrize("stream", [False, True], ids=["dense", "streaming"])
@pytest.mark.parametrize("keep", [0, 1, 2])
def test_keep_queries_only_the_last_positions(monkeypatch, config, stream, keep):
    """keep on a ragged paged batch: y [B, keep, D] == the full call's last positions, and the pages hold
    the same latents (every token is still written)."""
    if stream:
        monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 0)
        monkeypatch.setattr(mla_mod, "MIN_BLOCK", 3)
    layer, ps, lengths, T = build(config), 4, [5, 0, 11], 3
    W = config.kv_lora_rank + config.qk_rope_head_dim
    tables = [[9, 2], [5], [0, 14, 3, 11]]
    base = torch.randn(16 * ps, W, generator=torch.Generator().manual_seed(3))  # the cached latents
    x = inputs(3, T, seed=20)
    runs = {}
    with torch.no_grad():
        for k in (None, keep):
            pool = base.clone()
            state = PagedMLAState(pool, PagedBatch.from_tables(tables, lengths, T, ps))
            runs[k] = layer(x, state=state, keep=k), pool
        no_state = layer(x, keep=keep)  # no cache: the kept queries over the call's own keys
        assert no_state.shape == (3, keep, config.hidden_size)
        if keep:
            assert _rel_err(layer(x)[:, T - keep :], no_state) < 1e-5
        with pytest.raises(ValueError, match="keep"):
            layer(x, keep=T + 1)
    (full, full_pool), (kept, kept_pool) = runs[None], runs[keep]
    assert kept.shape == (3, keep, config.hidden_size)
    assert torch.equal(full_pool, kept_pool)
    if keep:
        assert _rel_err(full[:, T - keep :], kept) < 1e-5


def test_keep_streams_whenever_the_whole_call_would(monkeypatch):
    """The path follows the call's T, not the kept queries: a long chunk over a long cache streams even
    for one kept query (the dense path would gather every cached latent: O(S) memory at once)."""
    layer = build(CFG)
    x = inputs(1, 6)
    monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 2 * 1 * 6)  # H*T*S = 2*6*6 streams, H*1*S = 12 would not
    with torch.no_grad():
        full = layer(x)
        kept = layer(x, state=_NoAppend(), keep=1)  # raises if the dense gather runs
    assert _rel_err(full[:, -1:], kept) < 1e-5
