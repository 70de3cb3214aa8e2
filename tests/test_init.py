"""`mlxtune init`: a shipped recipe copied out with the files it names, ready to validate and run
from anywhere; refusals write nothing."""

from __future__ import annotations

import filecmp

import pytest
import yaml

from conftest import REPO
from mlxtune.cli import main

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def _names(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in _names(v)]
    if isinstance(node, list):
        return [s for v in node for s in _names(v)]
    return [node] if isinstance(node, str) else []


def test_init_without_arguments_lists_every_shipped_recipe(capsys):
    assert main(["init"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line and not line.startswith("mlx")]
    assert sorted(listed) == sorted(p.stem for p in SHIPPED)
    assert "The default recipe: train a small llama from scratch to reverse words" in out


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.stem)
def test_each_shipped_recipe_inits_and_validates_from_another_folder(
    recipe, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(["init", recipe.stem, "mine"]) == 0
    out = capsys.readouterr().out
    assert f"mlxtune run mine/{recipe.name}" in out
    copied = tmp_path / "mine" / recipe.name
    assert copied.read_bytes() == recipe.read_bytes()
    # every file the recipe names beside it is there, byte for byte
    for name in _names(yaml.safe_load(recipe.read_text())):
        if ".py:" in name:  # FILE.py:NAME: a tool, an environment, a reward function
            name = name.rpartition(":")[0]
        shipped = REPO / "recipes" / name
        if ":" in name or not shipped.exists() or shipped == REPO / "recipes":
            continue
        mine = tmp_path / "mine" / name
        if shipped.is_file():
            assert filecmp.cmp(shipped, mine, shallow=False), name
        else:
            assert not filecmp.dircmp(shipped, mine).diff_files, name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["validate", str(copied)]) == 0
    assert "ok" in capsys.readouterr().out


def test_init_copies_only_what_the_recipe_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "quickstart-dpo.yaml"]) == 0  # the default folder: ./NAME
    dest = tmp_path / "quickstart-dpo"
    got = {p.relative_to(dest).as_posix() for p in dest.rglob("*")}
    tops = {p for p in got if p.count("/") <= 1}
    assert tops == {
        "quickstart-dpo.yaml",
        "data",
        "data/prefs",
        "models",
        "models/reverse-tiny",
        "models/reverse-tiny-mixed",
    }


def test_init_into_an_empty_folder_fills_it(tmp_path, capsys):
    dest = tmp_path / "empty"
    dest.mkdir()
    assert main(["init", "quickstart", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["data", "quickstart.yaml"]
    assert sorted(p.name for p in (dest / "data" / "reverse").iterdir()) == [
        "test.jsonl",
        "train.jsonl",
        "valid.jsonl",
    ]


def test_init_fills_the_current_folder_and_an_empty_folder_behind_a_link(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["init", "quickstart", "."]) == 0
    assert sorted(p.name for p in here.iterdir()) == ["data", "quickstart.yaml"]
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert main(["init", "quickstart", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink()  # still the user's link, to the same folder
    assert sorted(p.name for p in target.iterdir()) == ["data", "quickstart.yaml"]


def test_a_new_folder_gets_the_mode_mkdir_gives(tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        assert main(["init", "quickstart", str(tmp_path / "new")]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755


def test_a_failed_copy_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    import shutil

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", failing)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["init", "quickstart", str(empty)]) == 2
    assert list(empty.iterdir()) == []  # the recipe file copied before the failure is gone
    assert main(["init", "quickstart", str(tmp_path / "new")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no staging folder left
    assert "No space left on device" in capsys.readouterr().err


def test_init_refuses_a_folder_that_is_not_empty_and_changes_nothing(tmp_path, capsys):
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "quickstart.yaml").write_text("mine\n")
    assert main(["init", "quickstart", str(dest)]) == 2
    err = capsys.readouterr().err
    assert str(dest) in err and "not an empty folder" in err and "Traceback" not in err
    assert [p.name for p in dest.iterdir()] == ["quickstart.yaml"]
    assert (dest / "quickstart.yaml").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no staging folder left
    # a file where the folder would go
    (tmp_path / "afile").write_text("x")
    assert main(["init", "quickstart", str(tmp_path / "afile")]) == 2
    assert (tmp_path / "afile").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "taken"]


def test_init_refuses_an_unknown_recipe_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "quickstart-sft", "x"]) == 2
    err = capsys.readouterr().err
    assert "no shipped recipe 'quickstart-sft'" in err and "quickstart-lora" in err
    assert list(tmp_path.iterdir()) == []


def test_python_dash_m_mlxtune_is_the_command(capsys):
    import subprocess
    import sys

    import mlxtune

    done = subprocess.run(
        [sys.executable, "-m", "mlxtune", "init", "nope"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "no shipped recipe 'nope'" in done.stderr
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mlxtune, version {mlxtune.__version__}"
