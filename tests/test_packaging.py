"""What users install is what the tests ran: a wheel built from the tracked tree holds every module,
kernel source and shipped recipe file (and nothing else), the sdist builds the same wheel, and
the wheel installed on its own imports every module and copies a recipe out with `mlxtune init`."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mlxtune
from conftest import REPO

# the repository's folders that install inside mlxtune (setup.py's MAPPED), and mlxtune itself
INSTALLED_AS = {
    "mlxtune": "mlxtune",
    "tui": "mlxtune/tui",
    "metal_kernels": "mlxtune/metal_kernels",
    "recipes": "mlxtune/recipes",
}


def _tracked() -> list[str]:
    """The repository's files as a clean clone has them."""
    if (REPO / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout
        return sorted(p for p in out.decode().split("\0") if p and (REPO / p).is_file())
    skip = {"__pycache__", ".git", ".venv", "build", "dist", "runs"}
    return sorted(
        str(p.relative_to(REPO))
        for p in REPO.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(REPO).parts) and p.suffix != ".pyc"
    )


def _expected_wheel_files(tracked: list[str]) -> set[str]:
    """Every tracked file of the installed folders, at its place in the wheel: all of mlxtune/'s
    and tui/'s Python files, every kernel source, every recipe with its data and models."""
    expected = set()
    for path in tracked:
        top, _, rest = path.partition("/")
        if top in INSTALLED_AS and rest:
            if top in ("mlxtune", "tui") and not rest.endswith(".py"):
                continue
            expected.add(f"{INSTALLED_AS[top]}/{rest}")
    return expected


def _build(hook: str, source: Path, out: Path, *args: str) -> Path:
    """Run one PEP 517 hook of the project's backend (setuptools) in ``source``; no network."""
    out.mkdir(parents=True, exist_ok=True)
    code = f"import sys; from setuptools import build_meta as b; print(b.{hook}(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out), *args],
        cwd=source,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def _digests(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as z:
        return {
            n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist() if ".dist-info/" not in n
        }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A wheel built from a copy of the tracked tree (as from a clean clone), its sdist, and the
    wheel built from that sdist."""
    root = tmp_path_factory.mktemp("packaging")
    tracked = _tracked()
    clone = root / "clone"
    for path in tracked:
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, clone / path)
    wheel = _build("build_wheel", clone, root / "dist")
    sdist = _build("build_sdist", clone, root / "dist")
    shutil.unpack_archive(sdist, root / "unpacked")
    (unpacked,) = (root / "unpacked").iterdir()
    again = _build("build_wheel", unpacked, root / "from-sdist")
    return {"tracked": tracked, "wheel": wheel, "sdist": sdist, "from_sdist": again}


def test_the_wheel_holds_every_module_kernel_source_and_recipe_file(built):
    expected = _expected_wheel_files(built["tracked"])
    got = set(_digests(built["wheel"]))
    assert expected - got == set(), "left out of the wheel"
    assert got - expected == set(), "in the wheel but not in the tree"
    # the pieces that were once left out, by name
    for needed in (
        "mlxtune/loop/__init__.py",
        "mlxtune/export/__init__.py",
        "mlxtune/gguf/__init__.py",
        "mlxtune/metal_kernels/attn_forward.body",
        "mlxtune/metal_kernels/prelude_metal.h",
        "mlxtune/recipes/quickstart.yaml",
        "mlxtune/recipes/data/reverse/train.jsonl",
    ):
        assert needed in got


def test_the_wheel_names_the_version_and_the_command(built):
    with zipfile.ZipFile(built["wheel"]) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        entry = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert f"\nVersion: {mlxtune.__version__}\n" in metadata
    assert built["wheel"].name == f"mlxtune-{mlxtune.__version__}-py3-none-any.whl"
    assert "mlxtune = mlxtune.cli:main" in entry
    assert "Classifier: Operating System :: MacOS" in metadata


def test_the_sdist_builds_the_same_wheel(built):
    assert _digests(built["from_sdist"]) == _digests(built["wheel"])


def test_the_installed_wheel_alone_imports_every_module_and_inits_a_recipe(built, tmp_path):
    """The wheel unpacked into a folder of its own, run from an empty folder: each module comes
    from there (not from the checkout), and the recipe `mlxtune init` writes validates."""
    site = tmp_path / "site"
    with zipfile.ZipFile(built["wheel"]) as z:
        z.extractall(site)
    work = tmp_path / "empty"
    work.mkdir()
    script = r"""
import importlib, pkgutil, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
import mlxtune
assert Path(mlxtune.__file__).resolve().is_relative_to(site), mlxtune.__file__
names = ["mlxtune"] + [m.name for m in pkgutil.walk_packages(mlxtune.__path__, "mlxtune.")]
names.remove("mlxtune.__main__")
for name in names:
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(site), module.__file__
print(len(names))
from mlxtune.cli import main
assert main(["init", "quickstart-lora", "q"]) == 0
assert main(["validate", "q/quickstart-lora.yaml"]) == 0
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(site)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = int(done.stdout.split()[0])
    modules = [
        p
        for p in built["tracked"]
        if p.endswith(".py")
        and (p.split("/")[0] in ("mlxtune", "tui", "metal_kernels") or p == "recipes/__init__.py")
    ]
    # every module but __main__ (running it is the command itself); the scripts that made the
    # recipes' data and models ship as files of theirs, not as modules
    assert imported == len(modules) - 1
    assert (work / "q" / "models" / "reverse-tiny" / "model.safetensors").exists()
