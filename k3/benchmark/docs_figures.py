"""Measured figures in the docs, generated from committed results files so that none is typed by hand.

A results file is `docs/results/NAME.json`: where the figures came from, and the figures themselves:

    {"command": "k3 train --seed 0", "commit": "1a2b3c4", "machine": "2-core Intel Xeon ...",
     "date": "2026-11-30",
     "figures": {"bpb_seed0": {"value": 1.469, "fmt": "{:.3f}"}, ...},
     "tables": {"main": {"header": ["a", "b"], "rows": [["x", "{bpb_seed0}"]]}}}

A page quotes a figure between two HTML comments (invisible once rendered), and a table likewise:

    reaches <!-- fig demo:bpb_seed0 -->1.469<!-- /fig --> bits per byte
    <!-- table demo:main -->
    | a | b |
    ...
    <!-- /table -->

`render(text)` rewrites every marked span from the results files; `python -m k3.benchmark.docs_figures`
rewrites README.md and docs/*.md in place (`--check`: exit 1 and list the spans that differ;
`--import-bench RUN/bench.json NAME` first turns a `k3 bench` run into docs/results/NAME.json). Table
cells may name figures as `{key}`, formatted the same way. Unknown files or keys raise ValueError.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
FIG = re.compile(r"<!-- fig (?P<ref>[\w.-]+:[\w.-]+) -->(?P<body>.*?)<!-- /fig -->")
TABLE = re.compile(r"<!-- table (?P<ref>[\w.-]+:[\w.-]+) -->\n(?P<body>.*?)<!-- /table -->", re.DOTALL)
CELL_REF = re.compile(r"\{([\w.-]+)\}")
REQUIRED = ("command", "commit", "machine", "date")


@cache
def load(name: str, results_dir: Path = RESULTS) -> dict:
    """The results file `name` (without .json), checked to say where its figures came from."""
    path = results_dir / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no results file {path.name} in {results_dir}")
    data = json.loads(path.read_text())
    missing = [k for k in REQUIRED if not data.get(k)]
    if missing:
        raise ValueError(f"{path.name}: missing provenance field(s) {missing}")
    return data


def figure(name: str, key: str, results_dir: Path = RESULTS) -> str:
    """One figure of a results file as the docs print it (its `fmt`, default `{}`)."""
    figs = load(name, results_dir).get("figures", {})
    if key not in figs:
        raise ValueError(f"results file {name}.json has no figure {key!r}")
    f = figs[key]
    return f.get("fmt", "{}").format(f["value"]) if isinstance(f, dict) else str(f)


def table(name: str, key: str, results_dir: Path = RESULTS) -> str:
    """A markdown table of a results file; `{figure}` in a cell is that figure, formatted."""
    tables = load(name, results_dir).get("tables", {})
    if key not in tables:
        raise ValueError(f"results file {name}.json has no table {key!r}")
    t = tables[key]

    def cell(c) -> str:
        return CELL_REF.sub(lambda m: figure(name, m.group(1), results_dir), str(c))

    lines = ["| " + " | ".join(t["header"]) + " |", "|" + "---|" * len(t["header"])]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in t["rows"]]
    return "\n".join(lines) + "\n"


def render(text: str, results_dir: Path = RESULTS) -> str:
    """`text` with every marked figure and table regenerated from the results files."""

    def fig(m: re.Match) -> str:
        name, key = m.group("ref").split(":")
        return f"<!-- fig {m.group('ref')} -->{figure(name, key, results_dir)}<!-- /fig -->"

    def tab(m: re.Match) -> str:
        name, key = m.group("ref").split(":")
        return f"<!-- table {m.group('ref')} -->\n{table(name, key, results_dir)}<!-- /table -->"

    return TABLE.sub(tab, FIG.sub(fig, text))


def unmarked(text: str) -> str:
    """`text` with the marked spans and fenced code blocks removed: what is left must hold no figure."""
    text = TABLE.sub("", FIG.sub("", text))
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(text: str) -> str:
    """A figure's name as a results key: lower case, words joined by `_`."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60]


def from_bench(bench_json: dict) -> dict:
    """A results file from `k3 bench`'s bench.json: its table, and every figure's ratio and value under
    `BENCH.SLUG.ratio` / `BENCH.SLUG.value` (the same formatting as bench.md)."""
    from k3.benchmark.report import COLUMNS, describe_machine, figure_row, fmt_number

    m = bench_json["machine"]
    rows, figs = [], {}
    for b in bench_json["benches"]:
        for f in (b.get("result") or {}).get("figures", []):
            rows.append(figure_row(b["name"], f))
            key = f"{b['name']}.{slug(str(f['figure']))}"
            if f.get("ratio") is not None:
                figs[f"{key}.ratio"] = {"value": f["ratio"], "fmt": "{:.3g}"}
            if f.get("value") is not None:
                figs[f"{key}.value"] = {"value": fmt_number(f["value"]), "fmt": "{}"}
    return {
        "command": bench_json["command"],
        "commit": m.get("git_commit") or "unknown",
        "machine": describe_machine(m),
        "date": m["date"],
        "figures": figs,
        "tables": {"suite": {"header": list(COLUMNS), "rows": rows}},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Regenerate the measured figures in README.md and docs/*.md.")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a figure differs")
    p.add_argument("--import-bench", nargs=2, metavar=("BENCH_JSON", "NAME"),
                   help="first write docs/results/NAME.json from a `k3 bench` run's bench.json")  # fmt: skip
    args = p.parse_args(argv)
    if args.import_bench:
        src, name = args.import_bench
        out = RESULTS / f"{name}.json"
        out.write_text(json.dumps(from_bench(json.loads(Path(src).read_text())), indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    verb = "differ from docs/results" if args.check else "rewritten"
    print("\n".join(f"{p}: {verb}" for p in stale) or "every figure matches docs/results")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
