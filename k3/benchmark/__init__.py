"""`k3 bench`: the benchmark suite runner (bench/*.py as subprocesses) and the result format they share.

    result.py   the JSON every bench script writes with --json (figures: value, peer, ratio, goal)
    suite.py    the registry of benches, locating bench/, running each as `python bench/X.py --json F`
    report.py   bench.json (results + machine), bench.md (the table) and the plots
    cli.py      the `k3 bench` command

The bench scripts live in the repository's bench/ folder, not in the package: `k3 bench` needs a source
(editable) install. See docs/benchmarks.md.
"""
