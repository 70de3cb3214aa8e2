"""The README's promises: its library example runs, its commands match CI, the shipped recipes
learn, and `doctor` reports the backend and BLAS."""

import re
import subprocess
import sys

import pytest

from conftest import REPO
from mlxtune import _blas
from mlxtune.cli import main

README = (REPO / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_test_one():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    run_cmd, test_cmd = blocks[0].strip(), blocks[1].strip()
    assert run_cmd.endswith("mlxtune run recipes/quickstart.yaml") and run_cmd.startswith(
        "python3 -m venv .venv"
    )
    assert "pytest" in test_cmd and test_cmd.startswith("python3 -m venv .venv")
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ci[-1] == test_cmd


def test_readme_library_example_runs(tmp_path, monkeypatch):
    code = (
        README.split("<!-- library-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    )
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    summary = scope["summary"]
    assert summary["steps"] <= 60
    assert summary["final_loss"] < 2.0 or summary["steps"] == 60
    ckpts = {p.name for p in (tmp_path / "runs" / "library-demo" / "checkpoints").iterdir()}
    assert "final" in ckpts and (summary["steps"] < 20 or "step-000020" in ckpts)


def test_doctor_reports_backend_blas_and_versions(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in ("backend", "BLAS", "matmul", "mlx-lm", "to fix"):
        assert word in out
    assert _blas.STATUS.name in out


def test_doctor_after_a_fresh_install_says_the_next_command_uses_it(capsys, monkeypatch):
    from mlxtune import cli

    monkeypatch.setattr(cli, "_install_blas", lambda: (True, "installed libopenblas0-pthread"))
    slow = _blas.BlasStatus("bundled reference BLAS", None, "no OpenBLAS found; install it")
    monkeypatch.setattr(_blas, "STATUS", slow)
    assert main(["doctor", "--install-blas"]) == 0
    out = capsys.readouterr().out
    assert "OpenBLAS: installed" in out
    assert "from the next one on" in out
    assert "to fix    nothing" in out


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS loading is for Linux")
def test_openblas_is_used_when_installed_and_bundled_opts_out():
    found = _blas._find_openblas()
    code = "import mlxtune, mlxtune._blas as b; print(b.STATUS.name)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ("OpenBLAS" if found else "bundled reference BLAS")
    env = {"MLXTUNE_BLAS": "bundled", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()
    assert out == "bundled reference BLAS"
    late = "import mlx.core, mlxtune._blas as b; b.STATUS = None; print(b.setup_blas().note)"
    out = subprocess.run(
        [sys.executable, "-c", late], capture_output=True, text=True, check=True
    ).stdout
    assert ("too late" in out) if found else ("no OpenBLAS" in out)


def test_ruff_is_clean():
    ruff = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(REPO)], capture_output=True, text=True
    )
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr


def _run(recipe, tmp_path, *overrides):
    from mlxtune import Trainer, load_recipe
    from mlxtune.console import Console

    r = load_recipe(REPO / "recipes" / recipe, list(overrides))
    tr = Trainer(r, run_dir=tmp_path / "run", console=Console(quiet=True))
    summary = tr.run()
    rows = [row for row in tr.run_dir.read_jsonl("metrics.jsonl") if "loss" in row]
    return summary, rows


def test_quickstart_recipe_learns_quickly(tmp_path):
    """A short cut of the default recipe: the loss falls by more than half in 150 steps."""
    summary, rows = _run(
        "quickstart.yaml",
        tmp_path,
        "train.max_steps=150",
        "eval.exact_match=0",
        "eval.every=null",
        "samples.every=null",
        "export.formats=[]",
    )
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.model").exists()


def test_quickstart_lora_recipe_learns_quickly(tmp_path):
    summary, rows = _run(
        "quickstart-lora.yaml",
        tmp_path,
        "train.max_steps=100",
        "eval.exact_match=0",
        "eval.every=null",
        "samples.every=null",
    )
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert (tmp_path / "run" / "export" / "mlx-lm" / "adapters.safetensors").exists()


@pytest.mark.slow
def test_quickstart_full_run_reaches_its_targets(tmp_path):
    summary, rows = _run("quickstart.yaml", tmp_path)
    assert summary["exact_match_before"] <= 0.05 and summary["exact_match_after"] >= 0.9
    assert summary["final_loss"] < 0.5 * rows[0]["loss"]
    assert summary["train_time_s"] < 300


@pytest.mark.slow
def test_quickstart_lora_full_run_reaches_its_targets(tmp_path):
    summary, rows = _run("quickstart-lora.yaml", tmp_path)
    assert summary["exact_match_before"] <= 0.05 and summary["exact_match_after"] >= 0.9
    assert summary["train_time_s"] < 120
