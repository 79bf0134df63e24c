"""Parameter counting: the analytic contract == the real model (meta device), docs/spec.md#parameter-counts
for k3-full."""

import dataclasses
import json
import math

import pytest

from k3.config import PRESET_DIR, PRESETS, K3Config, preset
from k3.params import (
    COMPONENTS,
    component_of,
    count_parameters,
    expected_shapes,
    format_table,
    inference_state,
    model_shapes,
)

FULL_TOTAL = 2_779_484_476_000
FULL_ACTIVE_INCL = 105_364_017_760
FULL_ACTIVE_EXCL = 104_189_612_640


@pytest.fixture(scope="module")
def full_shapes():
    """The real k3-full model's state_dict shapes (meta device), built once for this module."""
    return model_shapes(preset("k3-full"))


def _variants():
    c = preset("k3-nano")
    la = dataclasses.replace(c.linear_attn_config, use_full_rank_gate=False)
    return {
        "no_attn_res": c.replace(use_attn_res=False),
        "plain_moe": c.replace(use_latent_moe=False),
        "no_latent_norm": c.replace(latent_moe_use_norm=False),
        "no_q_lora": c.replace(q_lora_rank=None),
        "no_mla_gate": c.replace(mla_use_output_gate=False),
        "no_shared": c.replace(num_shared_experts=0),
        "tied": c.replace(tie_word_embeddings=True),
        "two_dense": c.replace(first_k_dense_replace=2),
        "low_rank_kda_gate": c.replace(linear_attn_config=la),
    }


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "k3-full"])
def test_contract_matches_real_model(name):
    assert model_shapes(preset(name)) == expected_shapes(preset(name))


def test_contract_matches_real_model_full(full_shapes):
    assert full_shapes == expected_shapes(preset("k3-full"))


@pytest.mark.parametrize("variant", sorted(_variants()))
def test_contract_matches_real_model_for_ablations(variant):
    c = _variants()[variant]
    assert model_shapes(c) == expected_shapes(c)


@pytest.mark.parametrize("name", PRESETS)
def test_every_tensor_has_a_component(name, full_shapes):
    c = preset(name)
    shapes = full_shapes if name == "k3-full" else model_shapes(c)
    assert [n for n in shapes if component_of(n, c) == "other"] == []


def test_full_matches_spec_totals(full_shapes):
    r = count_parameters(preset("k3-full"), "k3-full", shapes=full_shapes)  # the real model (meta device)
    assert r.total_params == FULL_TOTAL
    assert r.active_incl_embedding == FULL_ACTIVE_INCL
    assert r.active_excl_embedding == FULL_ACTIVE_EXCL


def test_full_matches_spec_components():
    """docs/spec.md#parameter-counts rows, from one layer of each kind (A_log counted as its 96 per-head
    values)."""
    c = preset("k3-full")
    shapes = expected_shapes(c)

    def layer(i: int, sub: str) -> int:
        return sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"model.layers.{i}.{sub}"))

    assert layer(0, "self_attn.") == 443_740_384  # KDA mixer
    assert layer(3, "self_attn.") == 232_196_096  # MLA mixer
    assert layer(0, "mlp.") == 726_663_168  # dense FFN
    assert layer(1, "block_sparse_moe.") - layer(1, "block_sparse_moe.experts.") == 189_927_808
    assert layer(1, "block_sparse_moe.experts.") == 896 * 33_030_144
    r = count_parameters(c, shapes=shapes)
    assert r.total["embedding"] == r.total["lm_head"] == 1_174_405_120
    assert r.total["routed_experts"] == 2_722_740_830_208
    assert r.total_params - r.total["routed_experts"] == 56_743_645_792
    assert r.active["routed_experts"] == 92 * 16 * 33_030_144


def test_full_inference_state():
    s = inference_state(preset("k3-full"))
    assert s["kda_state_bytes_per_sequence"] == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    assert round(s["kda_state_mib_per_sequence"], 1) == 428.6
    assert s["mla_latent_elements_per_token"] == 13_824


@pytest.mark.parametrize("name, low, high", [("k3-nano", 0, 2e6), ("k3-tiny", 20e6, 40e6)])
def test_preset_sizes(name, low, high):
    assert low < count_parameters(preset(name)).total_params < high


def test_small_preset_is_about_half_a_billion():
    assert 0.3e9 < count_parameters(preset("k3-small")).total_params < 0.7e9


def test_tied_embeddings_counted_once():
    c = preset("k3-nano")
    untied, tied = count_parameters(c), count_parameters(c.replace(tie_word_embeddings=True))
    assert tied.total_params == untied.total_params - untied.total["lm_head"]
    assert tied.active_excl_embedding == tied.active_incl_embedding  # the matrix is the output head too


def test_active_counts_top_k_of_routed_experts():
    c = preset("k3-tiny")
    r = count_parameters(c)
    assert r.active["routed_experts"] * c.num_experts == r.total["routed_experts"] * c.num_experts_per_token
    assert all(r.active[k] == r.total[k] for k in COMPONENTS if k != "routed_experts")


def test_table_is_readable(full_shapes):
    text = format_table(count_parameters(preset("k3-full"), "k3-full", shapes=full_shapes))
    assert "2,779,484,476,000" in text and "2779.484B" in text and "104,189,612,640" in text
    assert "428.6 MiB" in text and "13,824 elements" in text
    rows = [line for line in text.splitlines() if line.startswith(("embedding", "routed_experts", "total"))]
    assert len({len(line) for line in rows}) == 1  # aligned columns


def test_every_preset_is_one_json_file_read_by_one_loader():
    """k3/presets/ holds exactly the PRESETS, and preset() gives what K3Config.from_hf makes of each file."""
    assert sorted(p.stem for p in PRESET_DIR.glob("*.json")) == sorted(PRESETS)
    for name in PRESETS:
        config = K3Config.from_hf(json.loads((PRESET_DIR / f"{name}.json").read_text()))
        assert preset(name) == config and preset(name).to_hf() == config.to_hf()
    with pytest.raises(ValueError, match="unknown preset 'k3-huge'"):
        preset("k3-huge")


def test_small_presets_round_trip_as_text_configs():
    """A small preset file is its config's text_config (no wrapper, nothing kept verbatim on the side)."""
    for name in PRESETS:
        c = preset(name)
        if name != "k3-full":
            assert c.wrapper is None and c.extra == {}
            text = c.to_hf(text_only=True)
            del text["architectures"]
            assert json.loads((PRESET_DIR / f"{name}.json").read_text()) == text
