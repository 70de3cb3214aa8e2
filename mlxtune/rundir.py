"""The run directory: everything a run produces, in fixed places.

RUN_DIR/recipe.yaml  config_resolved.json  metrics.jsonl  samples.jsonl  log.txt
RUN_DIR/checkpoints/step-000200/  best/  final/     RUN_DIR/export/   RUN_DIR/control/
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserInputError


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


def default_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "run"
    return Path("runs") / f"{safe}-{stamp}"


class RunDir:
    """One run's directory. Paths inside it are checked never to escape it."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        if create:
            if self.path.exists() and not self.path.is_dir():
                raise UserInputError("the run directory is a file", str(self.path))
            if self.path.exists() and (self.path / "metrics.jsonl").exists():
                raise UserInputError(
                    "this run directory already holds a run; choose another --run-dir",
                    str(self.path),
                )
            self.path.mkdir(parents=True, exist_ok=True)
            for sub in ("checkpoints", "control"):
                (self.path / sub).mkdir(exist_ok=True)

    def inside(self, *parts: str) -> Path:
        """A path under the run directory; refuses names that would escape it."""
        root = self.path.resolve()
        p = (self.path.joinpath(*parts)).resolve()
        if p != root and root not in p.parents:
            raise UserInputError(
                f"{'/'.join(parts)!r} would be outside the run directory", str(self.path)
            )
        return p

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_text(self, name: str, text: str):
        p = self.inside(name)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)

    def write_json(self, name: str, obj):
        self.write_text(name, json.dumps(obj, indent=2, default=_json_default) + "\n")

    def append_jsonl(self, name: str, row: dict):
        row = {k: _clean(v) for k, v in row.items()}
        line = json.dumps(row, default=_json_default)
        with open(self.inside(name), "a", encoding="utf-8") as f:
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
        """Write a folder under the run directory all at once: yields an empty temporary folder;
        when the block ends without error it replaces the folder at ``parts``. The old folder is
        moved aside before the new one is renamed in, so a crash never leaves neither: a folder
        left aside by a crash between the two renames is put back the next time. Files are
        flushed to disk before the rename."""
        final = self.inside(*parts)
        tmp = final.with_name(f".{final.name}.tmp")
        old = final.with_name(f".{final.name}.old")
        if old.exists() and not final.exists():
            old.rename(final)  # a crash between the renames: the old folder is the good one
        for p in (tmp, old):
            if p.exists():
                shutil.rmtree(p)
        tmp.mkdir(parents=True)
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
