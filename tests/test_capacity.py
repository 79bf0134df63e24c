"""k3 plan: per-GPU numbers against hand computations from docs/spec.md#parameter-counts and
docs/distributed.md's formulas."""

import pytest

from k3.capacity import (
    activation_bytes_per_token,
    layer_activation_bytes,
    make_plan,
    min_training_gpus,
    param_split,
)
from k3.cli import main
from k3.config import preset

P_TOTAL = 2_779_484_476_000  # docs/spec.md#parameter-counts text model (router biases included)
P_EXPERTS = 2_722_740_830_208
ROUTER_BIAS = 92 * 896
D = 7168


@pytest.fixture(scope="module")
def full_plan():
    return make_plan(preset("k3-full"), 64, name="k3-full", serve_context=131072, seq=8192)


def test_param_split_by_hand():
    s = param_split(preset("k3-full"))
    assert s.experts == P_EXPERTS
    assert s.buffers == ROUTER_BIAS
    assert s.experts + s.dense + s.buffers == P_TOTAL
    kda_vectors = 3 * 12288 * 4 + 12288 + 96 + 128  # conv1d q/k/v, dt_bias, A_log, o_norm
    mla_vectors = 1536 + 512  # q_a / kv_a layernorms
    adamw = 2 * 1_174_405_120 + 69 * kda_vectors + 24 * mla_vectors + 93 * 6 * D + 92 * 3584 + 3 * D
    assert s.adamw == adamw
    assert s.muon == P_TOTAL - ROUTER_BIAS - adamw


def test_k3_full_64_gpus_by_hand(full_plan):
    rows = {r.item: r.bytes for r in full_plan.train + full_plan.serve}
    G = 64
    assert full_plan.ep == 64  # gcd(64, 896)
    assert rows["master weights (fp32, FSDP shard)"] == 4 * P_TOTAL / G
    assert rows["gradients (fp32, FSDP shard)"] == 4 * (P_TOTAL - ROUTER_BIAS) / G
    # 4.25 bits; 1,446.5 GB in all (docs/spec.md#parameter-counts)
    assert rows["routed experts (MXFP4)"] == P_EXPERTS * 17 / 32 / G
    assert abs(P_EXPERTS * 17 / 32 / 1e9 - 1446.5) < 0.1
    assert rows["dense weights (bf16)"] == 2 * (P_TOTAL - P_EXPERTS) / G
    assert rows["MLA latent cache, 1 seq @ 131,072"] == 24 * 576 * 2 * 131072
    kda = 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    # docs/spec.md#parameter-counts
    assert rows["KDA state, 1 seq"] == kda and abs(kda / 2**20 - 428.6) < 0.05
    # 2.78T with fp32 master + fp32 grads + fp32 Muon momentum is ~12 B/param: not on 64 x 141 GB
    assert not full_plan.to_dict()["train_fits"]
    assert full_plan.train_total > 12 * P_TOTAL / G
    free = G * (141e9 - rows["dense weights (bf16)"] - rows["routed experts (MXFP4)"])
    assert full_plan.sequences_per_deployment() == int(
        free // (rows["MLA latent cache, 1 seq @ 131,072"] + kda)
    )


def test_min_training_gpus_k3_full():
    g = min_training_gpus(preset("k3-full"))
    assert g == 512
    assert (
        make_plan(preset("k3-full"), g).train_total
        <= 141e9
        < make_plan(preset("k3-full"), g // 2).train_total
    )


def test_activation_formula_by_hand_nano():
    c = preset("k3-nano")  # d=64; KDA 2 heads x 32; MoE 8 experts top-2, I=32, latent 32, 1 shared
    kda = 2 * (64 + 10 * 64 + 2) + 4 * (64 + 2 * 32 * 32 // 64)
    moe = 2 * (64 + 3 * 32 + 2 * 2.5 * 32 + 2.5 * 3 * 32 + 3 * 32) + 4 * 8
    assert layer_activation_bytes(c, 1) == int(kda + moe + 2 * 6 * 64)
    none, full = activation_bytes_per_token(c, "none"), activation_bytes_per_token(c, "full")
    assert full < none
    assert full == 2 * 64 * (4 + 3) + max(layer_activation_bytes(c, i) for i in range(4)) + 6 * c.vocab_size


def test_bad_inputs():
    with pytest.raises(ValueError, match="ep"):
        make_plan(preset("k3-full"), 64, ep=48)
    with pytest.raises(ValueError, match="gpus"):
        make_plan(preset("k3-full"), 0)


def test_cli(capsys):
    assert main(["plan", "k3-full", "--gpus", "64", "--serve-context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "ep=64" in out and "routed experts (MXFP4)" in out and "does NOT fit" in out and "512" in out
