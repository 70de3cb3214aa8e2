"""The recipes shipped inside mlxtune (the package ``mlxtune.recipes``: the repository's recipes/
folder), and what ``mlxtune init`` does with them: one recipe copied into a folder of the user's
with the data and models it names, ready for ``mlxtune run``."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import UserInputError


def recipes_folder() -> Path:
    """Where the shipped recipes are: inside the installed package, or the checkout's recipes/."""
    return Path(importlib.import_module("mlxtune.recipes").__file__).resolve().parent


@dataclass(frozen=True)
class ShippedRecipe:
    name: str
    path: Path
    summary: str
    """The first sentence of the recipe's header comment."""


def _summary(text: str) -> str:
    words: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#") or not line.strip("# "):
            break
        words.append(line.lstrip("#").strip())
    joined = " ".join(words)
    end = joined.find(". ")
    return joined if end < 0 else joined[: end + 1]


def shipped_recipes() -> list[ShippedRecipe]:
    """Every shipped recipe, by name."""
    return [
        ShippedRecipe(f.stem, f, _summary(f.read_text(encoding="utf-8")))
        for f in sorted(recipes_folder().glob("*.yaml"), key=lambda f: f.stem)
    ]


def _strings(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def recipe_files(recipe: Path) -> list[Path]:
    """What a shipped recipe names beside it, relative to its folder: for a file (a data set's
    split), the folder that holds it, since its rows may name files beside it (images); for a
    folder (a model, an adapter, a tokenizer), the folder."""
    root = recipe.parent.resolve()
    needed: set[Path] = set()
    for s in _strings(yaml.safe_load(recipe.read_text(encoding="utf-8"))):
        file, sep, name = s.rpartition(":")
        if sep and file.endswith(".py") and name.isidentifier():
            s = file  # FILE.py:NAME (a tool, an environment, a reward function)
        if ":" in s or "\n" in s or Path(s).is_absolute():
            continue
        target = (root / s).resolve()
        if not target.exists() or not target.is_relative_to(root) or target == root:
            continue
        if target.is_file():
            target = target.parent
        if target != root:
            needed.add(target.relative_to(root))
    # a folder inside another one already copied comes with it
    return sorted(p for p in needed if not any(q != p and q in p.parents for q in needed))


def find_recipe(name: str) -> ShippedRecipe:
    stem = name.removesuffix(".yaml")
    recipes = shipped_recipes()
    for r in recipes:
        if r.name == stem:
            return r
    raise UserInputError(
        f"no shipped recipe {name!r}; the recipes are: {', '.join(r.name for r in recipes)} "
        "(mlxtune init lists them)",
        "RECIPE",
    )


def init_recipe(name: str, directory: str | os.PathLike | None = None) -> Path:
    """Copy the shipped recipe ``name`` into ``directory`` (default: ./NAME) with the data and
    models it names; returns the recipe's path there. A directory that exists must be empty:
    nothing is ever overwritten. A new folder is made beside its place and renamed into it; an
    empty one (``.`` too) is filled in place. Either way a failed copy leaves nothing behind."""
    recipe = find_recipe(name)
    dest = Path(directory if directory is not None else recipe.name)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserInputError(
            "exists and is not an empty folder; mlxtune init writes only into a new or empty "
            "folder (nothing was written)",
            str(dest),
        )
    if dest.is_dir():  # empty: filled where it is, keeping its own mode and owner
        try:
            _copy_recipe(recipe, dest)
        except BaseException:
            for p in list(dest.iterdir()):  # it was empty: what is there now is ours
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            raise
        return dest / recipe.path.name
    parent = dest.absolute().parent
    if not parent.is_dir():
        raise UserInputError("no such folder to create the recipe's folder in", str(parent))
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # as a folder made with mkdir would be (mkdtemp's is 0700)
        _copy_recipe(recipe, staging)
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest / recipe.path.name


def _copy_recipe(recipe: ShippedRecipe, into: Path) -> None:
    shutil.copy2(recipe.path, into / recipe.path.name)
    for rel in recipe_files(recipe.path):
        shutil.copytree(
            recipe.path.parent / rel,
            into / rel,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )


__all__ = [
    "ShippedRecipe",
    "find_recipe",
    "init_recipe",
    "recipe_files",
    "recipes_folder",
    "shipped_recipes",
]
