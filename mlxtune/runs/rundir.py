"""The run directory: everything a run produces, in fixed places.

RUN_DIR/recipe.yaml  config_resolved.json  metrics.jsonl  samples.jsonl  log.txt
RUN_DIR/checkpoints/step-000200/  best/  final/     RUN_DIR/export/   RUN_DIR/control/
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserInputError
from ..safety import NOT_PLAIN, is_plain_name


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _clean(v):
    """JSON has no NaN/inf: write them as null (the dashboard shows them as such)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def check_run_name(name: str, where: str = "name"):
    if not is_plain_name(name):
        raise UserInputError(f"{name!r} {NOT_PLAIN}", where)


def default_run_dir(name: str) -> Path:
    check_run_name(name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "run"
    base = Path("runs") / f"{safe}-{stamp}"
    path, n = base, 1
    while path.exists():  # another run of this recipe started in the same second
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


@contextmanager
def staged_folder(final: Path) -> Iterator[Path]:
    """Write the folder ``final`` all at once: yields a new, empty temporary folder beside it;
    when the block ends without error its files are flushed to disk and it replaces ``final``.
    The old folder is moved aside before the new one is renamed in, so a crash never leaves
    neither: a folder left aside by a crash between the two renames is put back the next time."""
    final = Path(final)
    old = final.with_name(f".{final.name}.old")
    if old.exists() and not final.exists():
        old.rename(final)  # a crash between the renames: the old folder is the good one
    if old.exists():
        shutil.rmtree(old)
    final.parent.mkdir(parents=True, exist_ok=True)
    # a name no other folder has: a user's own .NAME.tmp is never touched
    tmp = final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def run_dir_for(recipe, given: str | Path | None = None) -> Path:
    """Where a run of ``recipe`` writes: ``given`` (--run-dir: any folder the user names), else
    the recipe's ``run_dir`` (checked with the recipe: under the current directory), else
    runs/NAME-TIMESTAMP."""
    if given:
        return Path(given)
    if recipe.run_dir:
        return Path(recipe.run_dir)
    return default_run_dir(recipe.name)


# What a run writes at the top of its directory; a folder holding any of them holds a run.
_RUN_FILES = (
    "recipe.yaml",
    "config_resolved.json",
    "metrics.jsonl",
    "samples.jsonl",
    "summary.json",
    "exact_match_untrained.json",
    "exact_match_trained.json",
)
_RUN_FOLDERS = ("checkpoints", "export", "tokenizer")


def holds_a_run(path: Path) -> bool:
    """Whether ``path`` holds (part of) a run: a new run there would overwrite it."""
    if any((path / name).exists() for name in _RUN_FILES):
        return True
    return any((path / name).is_dir() and any((path / name).iterdir()) for name in _RUN_FOLDERS)


def _which_run(path: Path) -> str:
    try:
        cfg = json.loads((path / "config_resolved.json").read_text(encoding="utf-8"))
        name, source = cfg["recipe"]["name"], cfg.get("recipe_file")
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" (recipe {name!r}" + (f" from {source})" if source else ")")


@contextmanager
def removed_if_refused(path: str | Path | None) -> Iterator[None]:
    """Around building a run that may create ``path`` before it finds bad input: on a
    UserInputError whatever the block created there (the folder, or new entries in a folder
    that existed) is removed again, so refused input leaves nothing behind. Nothing that
    existed before is touched."""
    if path is None:
        yield
        return
    path = Path(path)
    top = None  # the highest folder on the way to ``path`` that does not exist yet
    p = path
    while not p.exists() and p != p.parent:
        top, p = p, p.parent
    before = set(os.listdir(path)) if top is None and path.is_dir() else None
    try:
        yield
    except UserInputError:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        elif before is not None and path.is_dir():
            for name in set(os.listdir(path)) - before:
                q = path / name
                if q.is_dir() and not q.is_symlink():
                    shutil.rmtree(q, ignore_errors=True)
                else:
                    q.unlink(missing_ok=True)
        raise


class RunDir:
    """One run's directory. Paths inside it are checked never to escape it."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        if create:
            if self.path.exists() and not self.path.is_dir():
                raise UserInputError("the run directory is a file", str(self.path))
            if self.path.is_dir() and holds_a_run(self.path):
                raise UserInputError(
                    f"this run directory already holds a run{_which_run(self.path)}; continue "
                    "it with --resume (same recipe), or choose a new --run-dir",
                    str(self.path),
                )
            self.path.mkdir(parents=True, exist_ok=True)
            for sub in ("checkpoints", "control"):
                (self.path / sub).mkdir(exist_ok=True)

    def inside(self, *parts: str) -> Path:
        """A path under the run directory; refuses names that would escape it."""
        root = self.path.resolve()
        try:
            p = (self.path.joinpath(*parts)).resolve()
        except (ValueError, OSError) as e:  # a NUL byte, a symlink loop
            raise UserInputError(
                f"{'/'.join(parts)!r} is not a usable path: {e}", str(self.path)
            ) from None
        if p != root and root not in p.parents:
            raise UserInputError(
                f"{'/'.join(parts)!r} would be outside the run directory", str(self.path)
            )
        return p

    def below(self, *parts: str) -> Path:
        """A path strictly under the run directory (a file or folder to write, never the run
        directory itself)."""
        p = self.inside(*parts)
        if p == self.path.resolve():
            raise UserInputError(
                f"{'/'.join(parts)!r} names the run directory itself, not a path in it",
                str(self.path),
            )
        return p

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_text(self, name: str, text: str):
        p = self.below(name)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)

    def write_json(self, name: str, obj):
        self.write_text(name, json.dumps(obj, indent=2, default=_json_default) + "\n")

    def append_jsonl(self, name: str, row: dict):
        row = {k: _clean(v) for k, v in row.items()}
        line = json.dumps(row, default=_json_default)
        with open(self.below(name), "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()

    def log(self, message: str):
        with open(self.inside("log.txt"), "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    def read_jsonl(self, name: str) -> list[dict]:
        p = self.inside(name)
        if not p.exists():
            return []
        rows = []
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    @contextmanager
    def staged(self, *parts: str) -> Iterator[Path]:
        """``staged_folder`` for the folder at ``parts`` under the run directory."""
        with staged_folder(self.below(*parts)) as tmp:
            yield tmp
