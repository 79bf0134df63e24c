"""`k3 bench`: the suite runner on fake bench scripts (tiny programs writing JSON), never the real suite."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

import k3
from k3.benchmark import suite
from k3.benchmark.report import markdown_table, write_outputs
from k3.benchmark.result import figure, goal_met, load_result, write_result
from k3.benchmark.suite import Bench, find_bench_dir, run_bench, select
from k3.cli import main

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--json")
a, rest = p.parse_known_args()
figs = [
    dict(figure="speedup", value=2.0, unit="s", peer="slow thing", peer_value=10.0, ratio=5.0, goal=3),
    dict(figure="missed", value=1.0, peer="limit", peer_value=2.0, goal=0.9),
    dict(figure="memory", value=105.0, unit="MiB", peer="analytic", peer_value=100.0, goal=0.1, goal_op="~"),
    dict(figure="plain", value=1234.5, unit="tok/s"),
]
series = [dict(label="measured", x=[1, 2, 4], y=[1, 2, 4]), dict(label="bound", x=[1, 4], y=[1, 4])]
plots = [dict(name="curve", xlabel="T", ylabel="MiB", logx=True, series=series)]
params = dict(args=rest, omp=os.environ.get("OMP_NUM_THREADS"))
json.dump(dict(bench="NAME", figures=figs, plots=plots, params=params), open(a.json, "w"))
print("args", rest)
"""
FAIL = "import sys\nprint('working...')\nprint('RuntimeError: out of cheese', file=sys.stderr)\nsys.exit(3)\n"
NO_JSON = "print('done, but forgot the file')\n"
SLOW = "import time\nprint('step 1 of 9', flush=True)\ntime.sleep(30)\n"


def write_benches(tmp_path: Path, scripts: dict[str, str]) -> Path:
    d = tmp_path / "bench"
    d.mkdir()
    for name, src in scripts.items():
        (d / f"{name}.py").write_text(textwrap.dedent(src).replace("NAME", name))
    return d


def test_cli_writes_json_markdown_plots_and_reports_a_failure(tmp_path, capsys):
    d = write_benches(tmp_path, {"training": GOOD, "prefix_cache": FAIL, "kda": GOOD})
    out = tmp_path / "out"
    code = main(["bench", "--bench-dir", str(d), "--only", "prefix_cache,training,kda", "--quick",
                 "--out", str(out)])  # fmt: skip
    assert code == 1  # one bench failed
    printed = capsys.readouterr()
    assert "[1/3] kda" in printed.out and "FAILED" in printed.out and "prefix_cache" in printed.err
    doc = json.loads((out / "bench.json").read_text())
    assert [b["name"] for b in doc["benches"]] == ["kda", "training", "prefix_cache"]  # suite order
    assert doc["ok"] is False and doc["quick"] is True
    for key in ("cpu", "logical_cores", "torch_threads", "torch", "date"):
        assert doc["machine"][key], key
    kda, training, pc = doc["benches"]
    assert kda["ok"] and training["ok"] and not pc["ok"]
    assert "exit code 3" in pc["error"] and "out of cheese" in pc["error"]
    assert kda["result"]["params"]["args"] == [
        "--T",
        "1024",
        "--reps",
        "3",
        "--hf-reps",
        "1",
    ]  # its quick args
    assert training["result"]["params"]["args"] == ["--quick"]
    met = {f["figure"]: f["goal_met"] for f in training["result"]["figures"]}
    assert met == {"speedup": True, "missed": False, "memory": True, "plain": None}
    md = (out / "bench.md").read_text()
    assert "| bench | figure | value | peer / limit | ratio | goal | met |" in md
    assert "| training | speedup | 2 s | slow thing: 10 s | 5 | >= 3 | yes |" in md
    assert "| training | missed | 1 | limit: 2 | 0.5 | >= 0.9 | **no** |" in md
    assert "| training | memory | 105 MiB | analytic: 100 MiB | 1.05 | within 10 % of 1 | yes |" in md
    assert "| training | plain | 1,234 tok/s |" in md
    assert "| prefix_cache | **FAILED** (exit code 3" in md
    assert "FAILED: prefix_cache" in md and "Goals not met: kda: missed; training: missed" in md
    for png in ("ratios.png", "kda_curve.png", "training_curve.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "out of cheese" in (out / "logs" / "prefix_cache.log").read_text()


def test_all_ok_is_exit_0_and_threads_reach_the_benches(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    d = write_benches(tmp_path, {"training": GOOD})
    out = tmp_path / "o"
    assert (
        main(["bench", "--bench-dir", str(d), "--only", "training", "--threads", "1", "--out", str(out)]) == 0
    )
    doc = json.loads((out / "bench.json").read_text())
    assert doc["ok"] and doc["benches"][0]["result"]["params"] == {"args": [], "omp": "1"}  # no --quick
    assert doc["machine"]["omp_num_threads"] == "1" and doc["machine"]["torch_threads"] == 1
    assert "--threads 1" in doc["command"]


def test_missing_json_missing_script_and_timeout_are_failures(tmp_path, monkeypatch):
    d = write_benches(tmp_path, {"a": NO_JSON, "slow": SLOW})
    monkeypatch.setattr(suite, "HEARTBEAT_S", 0.2)
    beats = []
    runs = [
        run_bench(Bench("a", ""), d, tmp_path / "o"),
        run_bench(Bench("absent", ""), d, tmp_path / "o"),
        run_bench(
            Bench("slow", ""), d, tmp_path / "o", timeout=1.5, heartbeat=lambda s, ln: beats.append(ln)
        ),
    ]
    assert beats and beats[-1] == "step 1 of 9"  # progress while it runs: its last output line
    assert [r.ok for r in runs] == [False, False, False]
    assert "no readable result JSON" in runs[0].error
    assert "no script" in runs[1].error
    assert "timed out" in runs[2].error and runs[2].seconds < 10
    table = markdown_table(runs)
    assert table.count("**FAILED**") == 3
    machine = {"cpu": "x", "logical_cores": 1, "torch_threads": 1, "torch": "t", "python": "p", "date": "d"}
    written = write_outputs(runs, machine, "k3 bench", False, tmp_path / "o")
    assert {p.name for p in written} == {"bench.json", "bench.md"}  # no ratios -> no plot


def test_result_format_roundtrip_and_fallback(tmp_path):
    figs = [figure("t", 2.0, "s", peer="p", peer_value=4.0, goal=0.4), figure("n", float("nan"))]
    write_result(tmp_path / "r.json", "x", figs, {"a": 1})
    r = load_result(tmp_path / "r.json", "x")
    assert r["figures"][0]["ratio"] == 0.5 and r["figures"][0]["goal_met"] is True
    assert r["figures"][1]["value"] is None  # NaN -> null (valid JSON)
    (tmp_path / "old.json").write_text(
        json.dumps({"tok_s": 5.0, "ok": True, "params": {"T": 8}, "m": {"x": 1}})
    )
    old = load_result(tmp_path / "old.json", "old")
    assert [(f["figure"], f["value"]) for f in old["figures"]] == [("tok_s", 5.0), ("m.x", 1)]
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an object"):
        load_result(tmp_path / "bad.json", "bad")
    assert goal_met({"ratio": 1.2, "goal": 0.1, "goal_op": "~"}) is False
    assert goal_met({"ratio": 0.5, "goal": 1, "goal_op": "<="}) is True
    with pytest.raises(ValueError, match="goal_op"):
        figure("x", 1.0, goal_op="=")


def test_select_and_bench_dir(tmp_path, monkeypatch):
    assert [b.name for b in select("long_context,kda")] == ["kda", "long_context"]
    with pytest.raises(ValueError, match="--only.*'nope'"):
        select("kda,nope")
    assert (find_bench_dir() / "training.py").is_file() and find_bench_dir() == ROOT / "bench"
    with pytest.raises(ValueError, match="--bench-dir"):
        find_bench_dir(tmp_path / "missing")
    monkeypatch.setattr(k3, "__file__", str(tmp_path / "site-packages" / "k3" / "__init__.py"))
    with pytest.raises(ValueError, match="pip install -e"):
        find_bench_dir()


def test_missing_matplotlib_fails_before_any_bench(tmp_path, monkeypatch, capsys):
    d = write_benches(tmp_path, {"training": GOOD})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(["bench", "--bench-dir", str(d), "--only", "training", "--out", str(tmp_path / "o")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bad_option_is_a_user_error(capsys):
    assert main(["bench", "--only", "nope"]) == 2
    assert "k3: error: --only" in capsys.readouterr().err
    assert main(["bench", "--list"]) == 0
    assert "prefix_cache" in capsys.readouterr().out
