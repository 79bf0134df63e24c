"""Repository-wide checks: ruff is clean and the package dependency direction holds (STYLE §2, §20)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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
