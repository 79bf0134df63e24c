"""The docs cannot drift from the code: every ```python block of README.md, CONTRIBUTING.md and docs/*.md
runs, and every `k3 ...` command line in them parses with the CLI's own parser (`k3.cli.parse`).

Python blocks of one file run in order in one namespace (a later block may use an earlier one's names),
in a fresh working directory, with the k3 caches in a temporary folder; they must take seconds on a CPU.
Command lines come from fenced blocks (other than python / json) and from inline code spans. A fenced
line is parsed in full, unless it is a usage synopsis (brackets, `|`, `...`): then, as for inline spans,
the command must exist and every `--flag` it names must be one of its options. `python bench/NAME.py`
and `python -m k3.MODULE` lines get the same flag check against the options their source declares.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from k3 import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    p for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")] if p.exists()
)
NOT_SHELL = {"python", "py", "json", "yaml", "toml"}  # fence languages whose lines are never command lines
SYNOPSIS = re.compile(r"[\[\]|]|\.\.\.|…")
INLINE = re.compile(r"(?<!`)`(k3 [^`\n]+)`(?!`)")


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the block's first line, body) of every ``` block in a markdown text."""
    blocks, lang, start, body = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, start, body = line.strip()[3:].strip().lower(), i + 1, []
            else:
                blocks.append((lang, start, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _logical_lines(body: str, start: int) -> list[tuple[int, str]]:
    """Lines of a shell block with backslash continuations joined, each with its first line number."""
    out, pending, first = [], "", start
    for i, line in enumerate(body.splitlines(), start):
        if not pending:
            first = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    return out


def _segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ||, ;, |), without env assignments or taskset."""
    line = line.strip().removeprefix("$ ")
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    segments, current = [], []
    for tok in tokens + [";"]:
        if tok in ("&&", "||", ";", "|"):
            while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                current = current[1:]
            if current[:1] == ["taskset"] and len(current) > 2:
                current = current[3:]
            if current:
                segments.append(current)
            current = []
        else:
            current.append(tok)
    return segments


def command_lines(text: str) -> list[tuple[int, list[str], bool]]:
    """(line number, argv after the program name... with the program first, full parse?) of a markdown text.

    Fenced shell lines parse in full unless they are synopses; inline spans are always synopsis-checked.
    """
    found = []
    for lang, start, body in fenced_blocks(text):
        if lang in NOT_SHELL:
            continue
        for lineno, line in _logical_lines(body, start):
            full = not SYNOPSIS.search(line.split("#")[0])
            for seg in _segments(line):
                if seg[0] in ("k3", "python"):
                    found.append((lineno, seg, full))
    outside = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for i, line in enumerate(outside.splitlines(), 1):
        for m in INLINE.finditer(line):
            for seg in _segments(m.group(1)):
                found.append((i, seg, False))
    return found


def _options(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _declared_flags(source: Path) -> set[str] | None:
    """Every string constant starting with `--` in a Python file (its argparse options), or None."""
    flags = {
        node.value
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--")
    }
    return flags or None


def _script_source(argv: list[str]) -> Path | None:
    """The source file of `python bench/X.py ...` or `python -m k3.mod ...` (None for anything else)."""
    if len(argv) > 1 and argv[1].endswith(".py"):
        return ROOT / argv[1]
    if len(argv) > 2 and argv[1] == "-m" and argv[2].startswith("k3."):
        spec = importlib.util.find_spec(argv[2])
        return Path(spec.origin) if spec is not None and spec.origin else None
    return None


def check_command(argv: list[str], full: bool) -> str | None:
    """None if the command line fits the code, else why not."""
    flags = re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", " ".join(argv))  # also inside [--flag X]
    if argv[0] == "python":
        source = _script_source(argv)
        if source is None:
            return None  # `python -c ...`, `python -m pytest`, ...: not ours to check
        if not source.exists():
            return f"{source.relative_to(ROOT)} does not exist"
        known = _declared_flags(source)
        known = None if known is None else known | {"--help"}
        unknown = [f for f in flags if known is not None and f not in known]
        return f"unknown options {unknown} for {source.name}" if unknown else None
    if argv[1:] in (["..."], ["…"]):
        return None  # `k3 ...`: any command, named in prose
    if len(argv) < 2 or argv[1].startswith("-"):
        return None if argv[1:] in (["--help"], ["--version"]) else "no command"
    try:
        parser = cli.command_parser(argv[1])
    except ValueError as e:
        return str(e)
    if not full:
        unknown = [f for f in flags if f not in _options(parser)]
        return f"unknown options {unknown}" if unknown else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.parse(argv[1:])
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- the docs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_command_lines_parse(path):
    text = path.read_text()
    bad = [
        f"{_rel(path)}:{lineno}: `{shlex.join(argv)}`: {why}"
        for lineno, argv, full in command_lines(text)
        if (why := check_command(argv, full)) is not None
    ]
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def docs_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("k3-cache")


PYTHON_DOCS = [p for p in DOCS if any(lang == "python" for lang, _, _ in fenced_blocks(p.read_text()))]


@pytest.mark.parametrize("path", PYTHON_DOCS, ids=_rel)
def test_python_blocks_run(path, tmp_path, monkeypatch, docs_cache):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("K3_CACHE_DIR", str(docs_cache))
    namespace = {"__name__": "__docs__"}
    for lang, start, body in fenced_blocks(path.read_text()):
        if lang == "python":  # leading newlines: a traceback names the markdown file's own line
            exec(compile("\n" * (start - 1) + body, str(path), "exec"), namespace)


def test_the_readme_has_code_to_run():
    assert ROOT / "README.md" in PYTHON_DOCS
    assert any(
        argv[:2] == ["k3", "serve"] and full
        for _, argv, full in command_lines((ROOT / "README.md").read_text())
    )


# ---- the checker itself --------------------------------------------------------------------------------
SAMPLE = """Run `k3 serve DIR --port 8000` or `k3 serve DIR --no-such-flag`.

```bash
pip install -e . && k3 train --steps 5   # a comment --ignored
K3_NATIVE=0 taskset -c 1 k3 bench --quick \\
    --only kda
k3 plan k3-full --gpus G
k3 train [--preset P] [--bogus]
python bench/kda.py --threads 1 --nope
```

```python
x = "k3 train --not-a-command-line"
```
"""


def test_extraction_finds_fenced_and_inline_commands():
    got = [(n, argv, full) for n, argv, full in command_lines(SAMPLE)]
    assert (1, ["k3", "serve", "DIR", "--port", "8000"], False) in got
    assert (4, ["k3", "train", "--steps", "5"], True) in got
    assert (5, ["k3", "bench", "--quick", "--only", "kda"], True) in got
    assert (8, ["k3", "train", "[--preset", "P]", "[--bogus]"], False) in got
    assert not any("--not-a-command-line" in argv for _, argv, _ in got)


@pytest.mark.parametrize(
    "line, ok",
    [
        ("k3 train --steps 5", True),
        ("k3 serve DIR --port 8000", True),
        ("k3 serve DIR --no-such-flag", False),  # unknown option
        ("k3 plan k3-full --gpus G", False),  # --gpus takes an int
        ("k3 serve", False),  # the checkpoint is required
        ("k3 nosuchcommand", False),
        ("python bench/kda.py --threads 1", True),
        ("python bench/kda.py --help", True),
        ("k3 ...", True),  # prose for "any command"
        ("python bench/kda.py --nope", False),
        ("python bench/no_such_script.py", False),
    ],
)
def test_check_command(line, ok):
    assert (check_command(shlex.split(line), full=True) is None) == ok


def test_synopsis_checks_flags_only():
    assert check_command(shlex.split("k3 train [--preset P] [--steps N]"), full=False) is None
    assert check_command(shlex.split("k3 train [--preset P] [--bogus]"), full=False) is not None


# ---- measured figures come from docs/results ---------------------------------------------------------------
# Pages whose every measured figure must sit in a marked span (a figure: a number with a unit of speed, a
# ratio, a share or a compression rate); the rest of docs/ may quote figures in marked spans too.
FIGURE_PAGES = [ROOT / "README.md"]
MEASURED = re.compile(r"\d[\d,.]*\s?(?:x\b|tok/s|ms\b|GB/s|GFLOP/s|%|bits per byte)")


def test_figures_match_their_results_files():
    from k3.benchmark.docs_figures import pages, render

    stale = [str(p.relative_to(ROOT)) for p in pages(ROOT) if render(p.read_text()) != p.read_text()]
    assert not stale, f"figures differ from docs/results (python -m k3.benchmark.docs_figures): {stale}"


@pytest.mark.parametrize("path", FIGURE_PAGES, ids=_rel)
def test_measured_figures_have_a_results_file(path):
    from k3.benchmark.docs_figures import unmarked

    hits = [
        f"{path.name}:{i}: {m.group(0)!r}"
        for i, line in enumerate(unmarked(path.read_text()).splitlines(), 1)
        for m in MEASURED.finditer(line)
    ]
    assert not hits, "measured figures outside a <!-- fig --> / <!-- table --> span:\n" + "\n".join(hits)


def test_results_files_say_where_they_came_from():
    from k3.benchmark.docs_figures import REQUIRED, RESULTS

    files = sorted(RESULTS.glob("*.json"))
    assert files
    for f in files:
        data = json.loads(f.read_text())
        assert all(data.get(k) for k in REQUIRED), f"{f.name}: needs {REQUIRED}"


def test_a_hand_edited_figure_is_caught(tmp_path):
    from k3.benchmark.docs_figures import load, render

    (tmp_path / "r.json").write_text(
        json.dumps({"command": "c", "commit": "abc", "machine": "m", "date": "d",
                    "figures": {"speed": {"value": 2.5, "fmt": "{:.2f}x"}},
                    "tables": {"t": {"header": ["a", "b"], "rows": [["x", "{speed}"]]}}})
    )  # fmt: skip
    load.cache_clear()
    good = (
        "k3 is <!-- fig r:speed -->2.50x<!-- /fig --> faster.\n"
        "<!-- table r:t -->\n| a | b |\n|---|---|\n| x | 2.50x |\n<!-- /table -->"
    )
    assert render(good, tmp_path) == good
    for edited in (good.replace(">2.50x<", ">2.60x<"), good.replace("| x | 2.50x |", "| x | 9.99x |")):
        assert render(edited, tmp_path) == good != edited
    with pytest.raises(ValueError, match="no figure 'nope'"):
        render("<!-- fig r:nope -->1<!-- /fig -->", tmp_path)
    assert MEASURED.search("decodes at 45.3 tok/s") and not MEASURED.search("<!-- fig r:speed -->")


def test_a_bench_run_becomes_a_results_file(tmp_path):
    from k3.benchmark.docs_figures import from_bench, load, render

    run = {
        "command": "k3 bench --only engine",
        "machine": {"cpu": "Test CPU", "logical_cores": 2, "torch_threads": 1, "torch": "2.13",
                    "python": "3.11", "date": "2026-01-01 00:00 UTC", "git_commit": "abc1234"},
        "benches": [{"name": "engine", "result": {"figures": [
            {"figure": "decode tok/s, batch 1", "value": 141.2, "unit": "tok/s", "peer": "HF",
             "peer_value": 34.3, "ratio": 4.1166, "goal": 3, "goal_op": ">=", "goal_met": True}]}}],
    }  # fmt: skip
    results = from_bench(run)
    assert results["commit"] == "abc1234" and "Test CPU" in results["machine"]
    (tmp_path / "suite.json").write_text(json.dumps(results))
    load.cache_clear()
    text = (
        "decode <!-- fig suite:engine.decode_tok_s_batch_1.ratio -->?<!-- /fig -->\n"
        "<!-- table suite:suite -->\n<!-- /table -->"
    )
    out = render(text, tmp_path)
    assert "-->4.12<!--" in out
    assert "| engine | decode tok/s, batch 1 | 141 tok/s | HF: 34.3 tok/s | 4.12 | >= 3 | yes |" in out
