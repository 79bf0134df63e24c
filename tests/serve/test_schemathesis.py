"""Property-based fuzzing of a live `k3 serve` with schemathesis (a tool nobody here wrote): every
operation of /openapi.json, all its default checks (no 5xx, response schemas, status codes, content
types, headers, positive data accepted, negative data rejected, auth, unsupported methods) over
positive and negative data. A bounded run (a fixed seed, 15 examples per operation and phase); the
longer run is the command in docs/serving.md."""

import re
import subprocess
import sys

API_KEY = "sk-test"

# A context with room for what the fuzzer generates and a small output cap, so the run stays short.
FUZZ_SERVER = ("--api-key", API_KEY, "--max-model-len", "8192", "--max-output-tokens", "32", "--page-size",
               "16", "--max-num-seqs", "8", "--max-pending", "64")  # fmt: skip


def test_schemathesis_finds_nothing(checkpoint, launch, tmp_path):
    s = launch(checkpoint, *FUZZ_SERVER)
    try:
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", s.url + "/openapi.json",
               "-H", f"Authorization: Bearer {API_KEY}", "--mode", "all", "--max-examples", "15",
               "--seed", "1", "--workers", "1", "--request-timeout", "60", "--report", "junit",
               "--report-junit-path", str(tmp_path / "junit.xml")]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        s.stop()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert m and int(m.group(1)) == int(m.group(2)) >= 300, out[-2000:]
    assert "Selected: 5/5" in out and "Tested: 5" in out
