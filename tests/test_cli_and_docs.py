"""The README's promises: its library example runs, its commands match CI, the shipped recipes
learn, and `doctor` reports the backend and BLAS."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlxtune
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
    # every step's loss in metrics.jsonl (the recipe logs every 50, after the run has stopped);
    # logging does not change what the run computes
    load_recipe = mlxtune.load_recipe
    monkeypatch.setattr(
        mlxtune, "load_recipe", lambda path, over: load_recipe(path, [*over, "train.log_every=1"])
    )
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    summary = scope["summary"]
    assert summary["steps"] <= 60
    rows = [json.loads(x) for x in (tmp_path / summary["run_dir"] / "metrics.jsonl").open()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == summary["steps"] and losses[-1] == summary["final_loss"]
    # it learned: measured over train.seed 0-4, the last loss is 0.53-0.56 of the first (about
    # 3.5, near ln 40 for the 40-token vocabulary), reached at steps 39-47; a run that learns
    # nothing stays near 1
    assert losses[-1] < 0.65 * losses[0], losses
    ckpts = {p.name for p in (tmp_path / "runs" / "library-demo" / "checkpoints").iterdir()}
    assert "final" in ckpts and (summary["steps"] < 20 or "step-000020" in ckpts)


def test_doctor_reports_backend_blas_and_versions(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in ("backend", "BLAS", "matmul", "mlx-lm", "to fix"):
        assert word in out
    assert _blas.STATUS.name in out
    import mlx.core as mx

    ring = "ring" if mx.distributed.is_available("ring") else "none"
    assert f"parallel  mx.distributed backends: {ring}" in out


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


def _installed_openblas() -> set[str]:
    """The OpenBLAS libraries installed here (resolved paths), from the dynamic linker's cache
    and the usual Debian and Fedora places: a search of its own, not mlxtune's."""
    found = set()
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if ldconfig:
        cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
        for line in cache.splitlines():
            name, _, path = line.strip().partition(" => ")
            if name.startswith("libopenblas.so"):
                found.add(path)
    for pattern in (
        "/usr/lib/*-linux-gnu/openblas-*/libopenblas.so.0",
        "/usr/lib/*-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas*.so.0",
        "/usr/lib/libopenblas.so.0",
    ):
        found.update(glob.glob(pattern))
    return {os.path.realpath(p) for p in found if os.path.exists(p)}


# What BLAS mlxtune reports, and every OpenBLAS library the process has mapped after MLX has
# run a matmul (os.path.realpath: /proc/self/maps names the files, links resolved).
PROBE = """
import json, os, re, sys
if sys.argv[1] == "mlxtune-first":
    import mlxtune, mlx.core as mx
else:
    import mlx.core as mx, mlxtune
import mlxtune._blas as b
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
mapped = sorted(p for p in maps if re.fullmatch(r"libopenblas[^/]*\\.so[^/]*", os.path.basename(p)))
print(json.dumps({"name": b.STATUS.name, "path": b.STATUS.path, "note": b.STATUS.note,
                  "mapped": mapped}))
"""


def _probe(order: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, order], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS loading is for Linux")
def test_openblas_is_used_when_installed_and_bundled_opts_out():
    installed = _installed_openblas()
    env = {k: v for k, v in os.environ.items() if k != "MLXTUNE_BLAS"}
    got = _probe("mlxtune-first", env)
    if installed:
        assert got["name"] == "OpenBLAS", got
        path = got["path"]
        assert os.path.isfile(path) and re.fullmatch(r"libopenblas.*\.so.*", Path(path).name)
        # the library it names is one installed here, and the one the process really loaded
        assert os.path.realpath(path) in installed, (path, installed)
        assert os.path.realpath(path) in got["mapped"], got
    else:
        assert got["name"] == "bundled reference BLAS" and not got["mapped"], got
    bundled = _probe("mlxtune-first", {"MLXTUNE_BLAS": "bundled", "PATH": "/usr/bin:/bin"})
    assert bundled["name"] == "bundled reference BLAS" and not bundled["mapped"], bundled
    late = _probe("mlx-first", env)
    assert late["name"] == "bundled reference BLAS" and not late["mapped"], late
    assert ("too late" in late["note"]) if installed else ("no OpenBLAS" in late["note"])


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, optimizer",
    [
        (
            "quickstart.yaml",
            ["optimizer.name=lion", "optimizer.lr=2e-4", "optimizer.weight_decay=0.1"],
        ),
        (
            "quickstart.yaml",
            ["optimizer.name=adafactor", "optimizer.lr=2e-3", "optimizer.weight_decay=0"],
        ),
        ("quickstart.yaml", ["optimizer.name=muon", "optimizer.lr=2e-3"]),
        ("quickstart.yaml", ["optimizer.name=sophia", "optimizer.lr=3e-4"]),
        ("quickstart.yaml", ["optimizer.name=adamw8bit", "optimizer.lr=2e-3"]),
        ("quickstart-lora.yaml", ["optimizer.name=lion", "optimizer.lr=6e-4"]),
        ("quickstart-lora.yaml", ["optimizer.name=adafactor", "optimizer.lr=2e-3"]),
        ("quickstart-lora.yaml", ["optimizer.name=muon", "optimizer.lr=2e-3"]),
        ("quickstart-lora.yaml", ["optimizer.name=sophia", "optimizer.lr=6e-4"]),
        ("quickstart-lora.yaml", ["adapter.lora_plus_ratio=4"]),
    ],
    ids=[
        "quickstart-lion",
        "quickstart-adafactor",
        "quickstart-muon",
        "quickstart-sophia",
        "quickstart-adamw8bit",
        "lora-lion",
        "lora-adafactor",
        "lora-muon",
        "lora-sophia",
        "lora-plus",
    ],
)
def test_each_optimizer_reaches_the_quickstart_target(tmp_path, recipe, optimizer):
    """The README's optimizer table: each optimizer at its stated learning rate reaches the
    quickstart's 90% held-out exact match from 0%."""
    summary, _ = _run(recipe, tmp_path, *optimizer, "export.formats=[]")
    assert summary["exact_match_before"] <= 0.05 and summary["exact_match_after"] >= 0.9
