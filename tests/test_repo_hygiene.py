"""Repository-wide checks: ruff is clean, the package dependency direction holds, the package imports
light, and the tracked text reads as a product: no history narration (issue numbers, working sessions,
"stop N", a "was ..." aside), no absolute machine paths, no docs page over 300 lines, no link to a
missing docs page. History belongs in git log and CHANGELOG.md; a comment gives the reason, not the ticket.
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_DOC_LINES = 300

# History words: an issue or ticket number, a working session named by an ordinal or a deictic word
# ("the fifth ...", "this ...'s", a numbered one), a numbered stop, a "was ..." aside in brackets. The samples
# below show what is caught and what is not (pytest's session scope, an agent's chat session). They are
# assembled from fragments so that this file passes its own scan.
ORDINAL = r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)"
HISTORY = re.compile(
    r"\bissues? #?\d+"
    rf"|\b(?:{ORDINAL}|this|that|previous|next|last|later|earlier)[ -]sessions?\b"
    r"|\bsessions? \d+"
    r"|\bstop \d+\b"
    r"|\((?:was|formerly|previously)\b",
    re.IGNORECASE,
)
# Absolute paths of someone's machine: under work, root, home/<user> or Users at the file-system root (a
# path that follows a word character, a dot, ~ or another slash is relative or a URL; ~/.cache is a user
# path).
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|root|Users|home/[^/\s]+)/")
# Talk about the writer's own machine or day in the docs ("on this machine", "today's", "so far"): a page
# names the machine of a figure and states what the code does, not when.
MACHINE_TALK = re.compile(r"\bthis (?:machine|VM|host)\b|\btoday'?s?\b|\bso far\b", re.IGNORECASE)
DOC_LINK = re.compile(r"\bdocs/([\w-]+\.md)\b")

ENGINE_CORE = ("k3.infer.model_runner", "k3.infer.scheduler", "k3.infer.engine", "k3.infer.async_engine")
# module prefix -> k3 subpackages it must never import
# Floors, bottom up: config, ops, optim; vision (image inputs: vision config, decoding, pre-processing, media
# placeholders, the synthetic task); model; checkpoint (the official layout, incl. VL checkpoints); quant;
# parallel; export; infer; train and serve on top. A package imports only floors below its own.
UPPER = ("k3.export", "k3.infer", "k3.train", "k3.serve")
FORBIDDEN = {
    "k3.config": ("k3.ops", "k3.vision", "k3.model", "k3.checkpoint", "k3.quant", "k3.parallel", *UPPER),
    "k3.ops": ("k3.vision", "k3.model", "k3.checkpoint", "k3.quant", "k3.parallel", "k3.optim", *UPPER),
    "k3.vision": ("k3.model", "k3.checkpoint", "k3.quant", "k3.parallel", *UPPER),
    "k3.model": ("k3.checkpoint", "k3.quant", "k3.parallel", "k3.optim", "torch.distributed", *UPPER),
    "k3.checkpoint": ("k3.quant", "k3.parallel", *UPPER),
    "k3.quant": ("k3.parallel", *UPPER),
    "k3.parallel": UPPER,
    "k3.optim": ("k3.model", "k3.train", "k3.infer", "k3.serve"),
    "k3.serve": ("k3.model",),
    # the engine's rooms, bottom up: memory, cache (pools, prefix cache, paged MLA), decode (the torch and
    # native steps), then the engine core (runner, scheduler, engine, async engine) over them
    "k3.infer.memory": ("k3.infer.cache", "k3.infer.decode", *ENGINE_CORE),
    "k3.infer.cache": ("k3.infer.decode", *ENGINE_CORE),
    "k3.infer.decode": ENGINE_CORE,
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; `pip install -e '.[test]'` installs it")
    result = subprocess.run([ruff, "check", "k3", "tests", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_direction():
    bad = []
    for path in sorted((ROOT / "k3").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for prefix, forbidden in FORBIDDEN.items():
            if module == prefix or module.startswith(prefix + "."):
                bad += [
                    f"{module} imports {name}"
                    for name in _imports(path)
                    if any(name == f or name.startswith(f + ".") for f in forbidden)
                ]
    assert not bad, "\n".join(bad)


def _is_type_checking(node: ast.If) -> bool:
    return (
        getattr(node.test, "id", None) == "TYPE_CHECKING" or getattr(node.test, "attr", "") == "TYPE_CHECKING"
    )


def _runtime_imports(nodes) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level and inside functions (a lazy import is still a
    dependency), but not under `if TYPE_CHECKING:` (annotations only)."""
    found = []
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node):
            found += _runtime_imports(node.orelse)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        else:
            found += _runtime_imports(ast.iter_child_nodes(node))
    return found


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{k3 module: the k3 modules it imports} (a package is its __init__; `from k3.a import b` names the
    module k3.a.b when there is one)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts): p for p in (root / "k3").rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in files.items()}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    floor = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(floor(module), set()).update(
            floor(t) for t in targets if floor(t) != floor(module)
        )
    return packages


def test_no_module_import_circle():
    found = circles(module_graph())
    assert not found, "k3 modules that import each other (move the shared part down):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_package_import_circle():
    """Packages (k3.<name>, or a top-level module) import each other one way only: with the rules in
    FORBIDDEN this keeps every arrow pointing down a floor."""
    found = circles(package_graph(module_graph()))
    assert not found, "k3 packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    "graph, bad",
    [
        ({"k3.a": {"k3.b"}, "k3.b": {"k3.a"}}, [["k3.a", "k3.b"]]),
        (
            {"k3.a": {"k3.b"}, "k3.b": {"k3.c"}, "k3.c": {"k3.a"}, "k3.d": {"k3.a"}},
            [["k3.a", "k3.b", "k3.c"]],
        ),
        ({"k3.a": {"k3.b"}, "k3.b": {"k3.c"}, "k3.c": set()}, []),
    ],
)
def test_circles_are_found(graph, bad):
    assert circles(graph) == bad


def test_lazy_and_type_checking_imports(tmp_path):
    """A function-level import counts (it still runs); one under `if TYPE_CHECKING:` does not."""
    (tmp_path / "k3").mkdir()
    (tmp_path / "k3" / "a.py").write_text("def f():\n    from k3.b import g\n")
    (tmp_path / "k3" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import k3.a\n"
    )
    assert module_graph(tmp_path) == {"k3.a": {"k3.b"}, "k3.b": set()}
    (tmp_path / "k3" / "b.py").write_text("import k3.a\n")
    assert circles(module_graph(tmp_path)) == [["k3.a", "k3.b"]]


def test_package_import_is_light():
    code = "import sys, k3, k3.config; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def history_words(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


def machine_paths(text: str) -> list[str]:
    return [m.group(0) for m in MACHINE_PATH.finditer(text)]


def machine_talk(text: str) -> list[str]:
    return [m.group(0) for m in MACHINE_TALK.finditer(text)]


def tracked_text_files() -> dict[str, str]:
    """{path: text} of every tracked file that is text (UTF-8 without NUL bytes); binaries are left out."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = {}
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def _offences(find) -> list[str]:
    return [
        f"{name}:{i}: {hit!r}"
        for name, text in tracked_text_files().items()
        for i, line in enumerate(text.splitlines(), 1)
        for hit in find(line)
    ]


def test_no_history_words():
    bad = _offences(history_words)
    assert not bad, (
        "history narration belongs in git log / CHANGELOG.md; say the reason instead:\n" + "\n".join(bad)
    )


def test_no_machine_paths():
    bad = _offences(machine_paths)
    assert not bad, "absolute machine paths (use a relative or a documented user path):\n" + "\n".join(bad)


def test_no_machine_talk_in_docs():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    bad = [
        f"{p.relative_to(ROOT)}:{i}: {hit!r}"
        for p in pages
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for hit in machine_talk(line)
    ]
    assert not bad, "name the machine and state the fact instead:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "text, bad",
    [
        ("5 minutes on this machine's 2 cores", True),
        ("the CPU faults on AMX (this VM)", True),
        ("at today's defaults", True),
        ("in every run so far", True),
        ("on a 2-core Intel Xeon (Sapphire Rapids)", False),
        ("the conversation until now", False),
    ],
)
def test_machine_talk_is_caught(text, bad):
    assert bool(machine_talk(text)) == bad


MAX_SOURCE_LINES = 450  # a k3 source file longer than this says why on its first line


def long_files_without_reason(root: Path = ROOT) -> list[str]:
    """k3 source files (Python, C, headers) over MAX_SOURCE_LINES whose first line is not a comment
    starting `Long file:` with the reason."""
    bad = []
    for path in sorted((root / "k3").rglob("*")):
        if path.suffix not in (".py", ".c", ".h"):
            continue
        lines = path.read_text().splitlines()
        first = lines[0].lstrip("#/* ") if lines else ""
        if len(lines) > MAX_SOURCE_LINES and not first.startswith("Long file: "):
            bad.append(f"{path.relative_to(root)}: {len(lines)} lines")
    return bad


def test_long_source_files_say_why():
    bad = long_files_without_reason()
    assert not bad, (
        f"k3 files over {MAX_SOURCE_LINES} lines without a `Long file: <reason>` first line:\n"
        + ("\n".join(bad))
    )


def test_long_file_rule_is_checked(tmp_path):
    (tmp_path / "k3").mkdir()
    (tmp_path / "k3/big.py").write_text("x = 1\n" * (MAX_SOURCE_LINES + 1))
    (tmp_path / "k3/big.c").write_text("/* Long file: one table. */\n" + "int x;\n" * MAX_SOURCE_LINES)
    (tmp_path / "k3/small.py").write_text("x = 1\n" * MAX_SOURCE_LINES)
    assert long_files_without_reason(tmp_path) == [f"k3/big.py: {MAX_SOURCE_LINES + 1} lines"]


def test_docs_pages_are_short():
    long = {
        p.name: n
        for p in (ROOT / "docs").glob("**/*.md")
        if (n := len(p.read_text().splitlines())) > MAX_DOC_LINES
    }
    assert not long, f"docs pages over {MAX_DOC_LINES} lines (split by concern): {long}"


def test_doc_links_resolve():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    bad = [
        f"{name}: docs/{page}"
        for name, text in tracked_text_files().items()
        if name != "CHANGELOG.md"  # it records removed pages by name
        for page in DOC_LINK.findall(text)
        if page not in pages
    ]
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", page.read_text()):
            if target not in pages:
                bad.append(f"docs/{page.name}: ({target})")
    assert not bad, "links to docs pages that do not exist:\n" + "\n".join(bad)


# A citation names a markdown file of the repository and a section: `docs/spec.md#kda`,
# `CONTRIBUTING.md#one-init`, or in a docs page a relative link such as `(#choices)`. The file is taken
# relative to the citing file, then to the repository root; the anchor is a heading's GitHub slug.
CITATION = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)#([\w-]+)")
SAME_PAGE_LINK = re.compile(r"\]\(#([\w-]+)\)")
# Citations of documents that are not in the repository (the specification and style notes it grew from).
OUTSIDE_CITATION = re.compile(r"\b(?:SPEC|STYLE) (?:§|sections? \d|conventions? \d)")


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ...); headings inside fenced code do not count."""
    anchors, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def citation_problems(name: str, text: str, files: dict[str, str]) -> list[str]:
    """Why the citations in `text` (the file `name`, relative to the root) do not resolve; `files` maps
    the repository's paths to their text."""
    problems = [
        f"{name}: {m.group(0)!r} cites a document outside the repository"
        for m in OUTSIDE_CITATION.finditer(text)
    ]
    here = str(Path(name).parent)
    cited = [(m.group(1), m.group(2)) for m in CITATION.finditer(text)]
    if name.endswith(".md"):
        cited += [(Path(name).name, anchor) for anchor in SAME_PAGE_LINK.findall(text)]
    for path, anchor in cited:
        found = next((p for p in (str(Path(here) / path), path) if p in files), None)
        if found is None:
            problems.append(f"{name}: {path}#{anchor}: no such file")
        elif anchor not in heading_anchors(files[found]):
            problems.append(f"{name}: {path}#{anchor}: no such section in {found}")
    return problems


def test_citations_resolve():
    files = tracked_text_files()
    bad = [
        p
        for name, text in files.items()
        if name != "CHANGELOG.md"
        for p in citation_problems(name, text, files)
    ]
    assert not bad, "citations that do not resolve inside the repository:\n" + "\n".join(bad)


# ---- the checkers on sample text: each rule fails where it should and only there -------------------------
ISSUE, SESSION, STOP, WAS = "issue", "session", "stop", "was"


@pytest.mark.parametrize(
    "text",
    [
        f"measured after the refactor ({ISSUE} 4)",
        f"see {ISSUE} 12 for the goal",
        f"the fifth {SESSION}'s final k3 bench",
        f"in this {SESSION}'s runs",
        f"a later {SESSION} measured it",
        f"{STOP} 25: the engine bench",
        f"{SESSION}s 3-5 tried it",
        f"RECURRENT_MAX_T is 16 ({WAS} 64)",
    ],
)
def test_history_words_are_caught(text):
    assert history_words(text)


@pytest.mark.parametrize(
    "text",
    [
        f'@pytest.fixture(scope="{SESSION}")',
        f"replay a multi-turn agent {SESSION} and measure reuse",
        f"{SESSION}_turns = 12",
        f"cached prompt tokens (whole {SESSION})",
        f"a chat {SESSION}'s history is the prompt",
        f"{STOP} strings and {STOP} token ids",
        f"the next token {WAS} sampled",
    ],
)
def test_legitimate_words_pass(text):
    assert not history_words(text)


@pytest.mark.parametrize(
    "text, bad",
    [
        ("/" + "work/main/bench/kda.py", True),
        ("spec: `/" + "work/shared/k3/SPEC.md`", True),
        ('open("/' + 'root/.cache/k3/x")', True),
        ("/" + "home/alice/k3/runs", True),
        ("/" + "Users/bob/k3", True),
        ("~/.cache/k3/native", False),
        ("runs/work/x and bench/peers/llamacpp.sh", False),
        ("https://example.org/work/x", False),
        ("--out /shared/runs/x", False),
    ],
)
def test_machine_paths_are_caught(text, bad):
    assert bool(machine_paths(text)) == bad


MD = ".md"  # the samples below are assembled so that this file passes its own citation scan
SPEC_PAGES = {
    "docs/spec.md": "# Spec\n## Config\n### KDA\n```\n## Not a heading\n```\n",
    "docs/serving.md": "# Serving\n## How it works: the cache\n## Notes\n## Notes\n",
    "CONTRIBUTING.md": "## Layout rules\n### One init\n",
}


@pytest.mark.parametrize(
    "name, text, ok",
    [
        ("k3/model/kda.py", "KDA (docs/spec" + MD + "#kda): the mixer", True),
        ("k3/model/init.py", "in one place (CONTRIBUTING" + MD + "#one-init)", True),
        ("docs/serving.md", "see [spec: kda](spec" + MD + "#kda) and [notes](#notes-1)", True),
        ("docs/serving.md", "[how](#how-it-works-the-cache)", True),
        ("k3/x.py", "https://github.com/o/r/blob/main/README" + MD + "#install", True),
        ("k3/model/kda.py", "KDA (docs/spec" + MD + "#mla)", False),  # no such section
        ("k3/model/kda.py", "KDA (docs/spec_kda" + MD + "#kda)", False),  # no such file
        (
            "k3/model/kda.py",
            "KDA (spec" + MD + "#kda)",
            False,
        ),  # resolves neither beside k3/model nor at the root
        ("docs/serving.md", "[x](#not-a-heading)", False),  # headings in fenced code do not count
        ("docs/serving.md", "[x](#notes-2)", False),
        ("k3/model/kda.py", "KDA (" + "SPEC" + " §3.4)", False),  # a document outside the repository
        ("k3/optim/muon.py", "Layout (" + "STYLE" + " convention 12)", False),
        ("k3/optim/qk_clip.py", "QK-Clip (" + "SPEC" + " section 4.3)", False),
    ],
)
def test_citation_checker(name, text, ok):
    assert (not citation_problems(name, text, SPEC_PAGES)) == ok


def test_heading_anchors():
    text = "# Spec: the K3 model\n## Per-Head Muon\n### SiTU-GLU\n## `k3` and `torch`\n## Notes\n## Notes\n"
    assert heading_anchors(text) == {
        "spec-the-k3-model", "per-head-muon", "situ-glu", "k3-and-torch", "notes", "notes-1",
    }  # fmt: skip


# A repository path in tracked text: k3/..., tests/... or bench/... ending in a source or docs suffix. A
# segment in capitals (`bench/NAME.py`) is a placeholder, not a path.
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:k3|tests|bench)/[\w/.-]*\w\.(?:py|c|h|jinja|json|md))\b")


def missing_paths(files: dict[str, str], exists) -> list[str]:
    return [
        f"{name}: {path}"
        for name, text in files.items()
        if name != "CHANGELOG.md"  # it records moved and removed files by name
        for path in SOURCE_PATH.findall(text)
        if not any(part.isupper() for part in re.split(r"[/.]", path)) and not exists(path)
    ]


def test_source_paths_resolve():
    samples = ("tests/test_repo_hygiene.py", "tests/test_docs.py")  # their checkers' made-up paths
    files = {n: t for n, t in tracked_text_files().items() if n not in samples}
    bad = missing_paths(files, lambda p: (ROOT / p).exists())
    assert not bad, "paths to files that do not exist (moved? renamed?):\n" + "\n".join(bad)


def test_missing_paths_are_caught():
    text = "see k3/infer/old_room.py, k3/infer/engine.py and bench/NAME.py"
    assert missing_paths({"README.md": text}, {"k3/infer/engine.py"}.__contains__) == [
        "README.md: k3/infer/old_room.py"
    ]
