"""Repository-wide checks: ruff is clean, the package dependency direction holds, the package imports
light, and the tracked text reads as a product: no history narration (issue numbers, working sessions,
"stop N", a "was ..." aside), no absolute machine paths, no docs page over 400 lines, no link to a
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
MAX_DOC_LINES = 400

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

# module prefix -> k3 subpackages it must never import
FORBIDDEN = {
    "k3.config": ("k3.ops", "k3.model", "k3.train", "k3.infer", "k3.serve", "k3.parallel"),
    "k3.ops": ("k3.model", "k3.train", "k3.infer", "k3.serve", "k3.parallel", "k3.optim"),
    "k3.model": ("k3.train", "k3.infer", "k3.serve", "k3.parallel", "k3.optim", "torch.distributed"),
    "k3.optim": ("k3.model", "k3.train", "k3.infer", "k3.serve"),
    "k3.serve": ("k3.model",),
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
