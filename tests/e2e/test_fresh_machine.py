"""Nothing in the library may depend on the repository layout: configs ship as package data, and the fresh-machine
check (`.ci/fresh_machine.sh`: non-editable install into a new venv, `dgemma demo` / `dgemma plan` from elsewhere)."""

import subprocess
from pathlib import Path

import pytest

from dgemma.config import CONFIGS_DIR, load_config, resolve_config_path

REPO = Path(__file__).resolve().parents[2]


def test_shipped_configs_load_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not Path("configs").exists()
    assert resolve_config_path("configs/stage1/tiny.yaml") == CONFIGS_DIR / "stage1/tiny.yaml"
    assert load_config("configs/stage1/tiny.yaml", env={}).run.name == "stage1_tiny"
    # a local file of the same name wins; anything else is left alone (and fails to load as before)
    (tmp_path / "configs/stage1").mkdir(parents=True)
    (tmp_path / "configs/stage1/tiny.yaml").write_text("run: {name: local}\n")
    assert load_config("configs/stage1/tiny.yaml", env={}).run.name == "local"
    assert resolve_config_path("configs/nope.yaml") == Path("configs/nope.yaml")


def test_configs_are_package_data():
    assert (REPO / "dgemma/configs").resolve() == (REPO / "configs").resolve()
    assert '"configs/**/*.yaml"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.slow
def test_fresh_machine_check(tmp_path):
    proc = subprocess.run(["bash", str(REPO / ".ci/fresh_machine.sh"), str(tmp_path / "fresh")], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "fresh_machine: OK" in proc.stdout
