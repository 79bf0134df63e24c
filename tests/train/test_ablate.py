"""`k3 ablate`: every variant is a valid recipe; the sweep resumes, tabulates and plots."""

from k3.model.transformer import K3ForCausalLM
from k3.train.ablate import VARIANTS, ablation_base, plot_results, results_table, run_ablation, variant_config
from k3.train.param_groups import classify


def test_every_variant_builds(tmp_path):
    base = ablation_base()
    for name in VARIANTS:
        tc = variant_config(base, name, 0, tmp_path)
        cfg = tc.model_config()
        model = K3ForCausalLM(cfg)
        groups = classify(model, tc.per_head, tc.optimizer)
        if name == "K2":
            assert not cfg.mla_use_nope and cfg.bias_update == "sign" and cfg.hidden_act == "silu"
            assert not cfg.use_attn_res and not cfg.use_latent_moe and list(groups.muon) == [None]
        if name == "AdamW":
            assert groups.muon == {}
        if name == "K3":
            assert cfg == ablation_base().model_config() and len(groups.muon) > 1


def test_table_statistics():
    recs = [
        {"variant": v, "seed": s, "val_bpb": b, "params": 1e6}
        for v, s, b in [
            ("K3", 0, 2.0),
            ("K3", 1, 2.2),
            ("K3", 2, 2.4),
            ("K2", 0, 2.5),
            ("K2", 1, 2.5),
            ("K2", 2, 2.5),
        ]
    ]
    table = results_table(recs, ["K3", "K2"])
    assert "| K3 | the K3 recipe | 2.2000 ± 0.2000 | — | 3 |" in table
    assert "| 2.5000 ± 0.0000 | +0.3000 ± 0.2000 | 3 |" in table  # paired: +0.5, +0.3, +0.1


def test_sweep_runs_and_skips_finished_runs(corpus_dir, tmp_path):
    base = ablation_base(
        preset="k3-nano",
        vocab_size=None,
        data=str(corpus_dir),
        steps=2,
        seq_len=32,
        batch_size=2,
        warmup_steps=1,
        eval_tokens=256,
    )
    logs = []
    recs = run_ablation(base, ["K3", "-QB"], [0], tmp_path, log=logs.append)
    assert [r["variant"] for r in recs] == ["K3", "-QB"] and len(logs) == 2
    assert all(r["val_bpb"] > 0 and r["tokens"] == 2 * 2 * 32 for r in recs)
    again = run_ablation(base, ["K3", "-QB"], [0], tmp_path, log=logs.append)
    assert again == recs and len(logs) == 2  # nothing retrained
    plot_results(recs, ["K3", "-QB"], tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000
