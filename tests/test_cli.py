"""The `k3` command line: lazy command registry, `k3 params`, error handling."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def test_params_full_json(capsys):
    assert main(["params", "k3-full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 2_779_484_476_000
    assert out["active_excl_embedding"] == 104_189_612_640
    assert out["active_incl_embedding"] == 105_364_017_760
    assert out["components"]["routed_experts"]["total"] == 2_722_740_830_208
    assert out["inference_state"]["mla_latent_elements_per_token"] == 13_824


def test_params_table_and_config_path(capsys, tmp_path):
    from k3.config import preset

    preset("k3-nano").save(tmp_path / "config.json")
    assert main(["params", str(tmp_path / "config.json")]) == 0
    table = capsys.readouterr().out
    assert main(["params", str(tmp_path)]) == 0  # a checkpoint directory works too
    assert capsys.readouterr().out.splitlines()[1:] == table.splitlines()[1:]
    assert "354,350" in table and "routed_experts" in table


def test_bad_preset_is_exit_2_with_message(capsys):
    assert main(["params", "k3-huge"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3: error: ") and "'k3-huge'" in err and "Traceback" not in err


def test_console_entry_point_exit_code():
    r = subprocess.run(
        [sys.executable, "-m", "k3.cli", "params", "k3-huge"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 2
    assert r.stderr.startswith("k3: error: ") and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [[], ["nosuchcommand"], ["params"], ["params", "k3-nano", "--bogus"]])
def test_usage_errors_are_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_help(capsys):
    assert main(["--help"]) == 0
    assert "params" in capsys.readouterr().out
    assert main(["params", "--help"]) == 0
    assert "NAME_OR_CONFIG_JSON" in capsys.readouterr().out


def test_cli_import_and_help_do_not_import_torch():
    code = "import sys, k3.cli; rc = k3.cli.main(['--help']); sys.exit(10 if 'torch' in sys.modules else rc)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_registry_modules_provide_the_command_interface():
    assert len({c.name for c in COMMANDS}) == len(COMMANDS)
    for cmd in COMMANDS:
        module = importlib.import_module(cmd.module)
        assert callable(module.add_arguments) and callable(module.run), cmd.name
