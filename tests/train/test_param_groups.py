"""Muon/AdamW routing: every trainable parameter exactly once, head splits per
docs/spec_training.md#per-head-muon."""

import pytest
import torch

from k3.config import preset
from k3.model.transformer import K3ForCausalLM
from k3.train.config import K2_MODEL, nano_smoke
from k3.train.param_groups import ParamGroups, build_optimizers, check_coverage, classify


def _model(**overrides):
    cfg = preset("k3-nano")
    return K3ForCausalLM(cfg.replace(**overrides) if overrides else cfg), cfg


def _split_of(groups: ParamGroups, name: str):
    hits = [split for split, names in groups.muon.items() if name in names]
    return hits[0] if hits else "adamw"


@pytest.mark.parametrize(
    "overrides",
    [{}, K2_MODEL, {"q_lora_rank": None}, {"tie_word_embeddings": True}],
    ids=["k3", "k2", "no-q-lora", "tied"],
)
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_groups_cover_every_parameter_once(overrides, optimizer):
    model, _ = _model(**overrides)
    groups = classify(model, optimizer=optimizer)
    names = groups.all_names()
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))
    opts = build_optimizers(model, optimizer=optimizer)
    ids = [id(p) for o in opts for g in o.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))


def test_head_splits_follow_the_spec_table():
    model, cfg = _model()
    g = classify(model)
    Hm, Hk = cfg.num_attention_heads, cfg.linear_attn_config.num_heads
    mla, kda, moe = (
        "model.layers.3.self_attn.",
        "model.layers.0.self_attn.",
        "model.layers.1.block_sparse_moe.",
    )
    expect = {
        mla + "q_b_proj.weight": (0, Hm), mla + "kv_b_proj.weight": (0, Hm), mla + "g_proj.weight": (0, Hm),
        mla + "o_proj.weight": (1, Hm), mla + "q_a_proj.weight": None,
        mla + "kv_a_proj_with_mqa.weight": None,
        kda + "q_proj.weight": (0, Hk), kda + "k_proj.weight": (0, Hk), kda + "v_proj.weight": (0, Hk),
        kda + "f_b_proj.weight": (0, Hk), kda + "g_proj.weight": (0, Hk), kda + "o_proj.weight": (1, Hk),
        kda + "f_a_proj.weight": None, kda + "b_proj.weight": None,
        moe + "gate.weight": None, moe + "experts.w1": None, moe + "routed_expert_down_proj.weight": None,
        moe + "shared_experts.down_proj.weight": None, "model.layers.0.mlp.up_proj.weight": None,
    }  # fmt: skip
    for name, split in expect.items():
        assert _split_of(g, name) == split, name
    adamw = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        kda + "A_log",
        kda + "dt_bias",
        kda + "q_conv1d.weight",
        kda + "o_norm.weight",
        mla + "kv_a_layernorm.weight",
        "model.layers.0.self_attention_res_proj.weight",
        "model.norm.weight",
        moe + "routed_expert_norm.weight",
    ]
    for name in adamw:
        assert _split_of(g, name) == "adamw", name
    assert "model.embed_tokens.weight" in g.adamw_decay and kda + "A_log" in g.adamw_no_decay
    buffers = {n for n, _ in model.named_buffers()}
    assert any(n.endswith("e_score_correction_bias") for n in buffers)
    assert not any(n.endswith("e_score_correction_bias") for n in g.all_names())


def test_no_per_head_is_whole_matrix_muon():
    model, _ = _model()
    g = classify(model, per_head=False)
    assert list(g.muon) == [None]
    assert len(g.muon[None]) == sum(len(v) for v in classify(model).muon.values())


def test_coverage_check_catches_duplicates_and_gaps():
    model, _ = _model()
    g = classify(model)
    dup = ParamGroups(
        muon=dict(g.muon),
        adamw_decay=g.adamw_decay + [g.adamw_no_decay[0]],
        adamw_no_decay=list(g.adamw_no_decay),
    )
    with pytest.raises(ValueError, match="duplicated"):
        check_coverage(model, dup)
    gap = ParamGroups(muon=dict(g.muon), adamw_decay=g.adamw_decay, adamw_no_decay=g.adamw_no_decay[1:])
    with pytest.raises(ValueError, match="missing"):
        check_coverage(model, gap)


def test_frozen_parameters_are_left_out():
    model, _ = _model()
    model.lm_head.weight.requires_grad_(False)
    assert "lm_head.weight" not in classify(model).all_names()


def test_optimizers_step_every_parameter():
    torch.manual_seed(0)
    model, _ = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 500, (2, 16))
    model(ids, labels=ids).loss.backward()
    for opt in build_optimizers(model):
        opt.step()
    unchanged = [
        n
        for n, p in model.named_parameters()
        if torch.equal(before[n], p) and p.grad is not None and p.grad.abs().sum() > 0
    ]
    assert unchanged == []


def test_train_config_optimizer_options_reach_the_optimizers():
    """TrainConfig.optimizer_options() is what the trainer and the training bench pass on: every field
    it names must arrive in the optimizers' groups."""
    tc = nano_smoke(lr=0.07, adamw_lr=0.004, weight_decay=0.2, momentum=0.9, betas=(0.8, 0.9))
    model = K3ForCausalLM(tc.model_config())
    muon, adamw = build_optimizers(model, **tc.optimizer_options())
    assert {g["lr"] for g in muon.param_groups} == {0.07}
    assert muon.defaults["momentum"] == 0.9 and muon.defaults["weight_decay"] == 0.2
    assert {g["lr"] for g in adamw.param_groups} == {0.004}
    assert adamw.defaults["betas"] == (0.8, 0.9)
    (only,) = build_optimizers(model, **tc.replace(optimizer="adamw").optimizer_options())
    assert {g["lr"] for g in only.param_groups} == {0.004}
