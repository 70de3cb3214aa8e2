"""Exact resume: what a checkpoint holds beyond the weights, how it is checked, and which recipe
changes a resumed run can honour.

A checkpoint folder holds ``adapters.safetensors`` (the trainable weights), ``optimizer.safetensors``
(the optimizer's whole state: moments, step count, learning rate), ``trainer_state.json`` (with a
``resume`` section: step, position in the data order, random state, tokens and examples seen,
best eval loss, the metrics window in progress) and ``checksums.json`` (SHA-256 of every other
file), written last, so a checkpoint without it is incomplete.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import UserInputError

CHECKSUMS = "checksums.json"

# Recipe keys a resumed run may change: how long to train and what to log, evaluate, sample,
# save and export. Anything else (model, data, adapter, optimizer, batch, seed, ...) would make
# the continued run a different run.
MAY_CHANGE = (
    "name",
    "run_dir",
    "train.max_steps",
    "train.epochs",
    "train.log_every",
    "train.progress",
    "eval.",
    "samples.",
    "checkpoints.",
    "export.",
    "kernels.",
    "precision.nonfinite",
    "precision.max_skipped",
    "memory.",
    "train.grad_checkpointing",  # the same gradients (dropout masks are drawn differently)
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the SHA-256 of every file in ``folder`` (call it last)."""
    sums = {
        p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS
    }
    (folder / CHECKSUMS).write_text(json.dumps(sums, indent=2))


def verify(folder: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    sums_path = folder / CHECKSUMS
    if not sums_path.exists():
        return "no checksums.json (an incomplete write)"
    try:
        sums = json.loads(sums_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "checksums.json is damaged"
    for name in ("trainer_state.json", "adapters.safetensors", "optimizer.safetensors"):
        if name not in sums:
            return f"{name} is missing (not a resumable checkpoint)"
    for name, digest in sums.items():
        p = folder / name
        if not p.exists():
            return f"{name} is missing"
        if _sha256(p) != digest:
            return f"{name} does not match its checksum (corrupt or truncated)"
    return None


def candidates(run_dir: Path) -> list[Path]:
    """A run's checkpoints that could resume it, newest step first."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = []
    for c in folder.iterdir():
        if c.name.startswith(".") or not (c / "trainer_state.json").exists():
            continue
        try:
            step = json.loads((c / "trainer_state.json").read_text()).get("step", -1)
        except (json.JSONDecodeError, UnicodeDecodeError):
            step = -1
        found.append((step, c.name == "final", c))
    return [c for _, _, c in sorted(found, key=lambda x: (x[0], x[1]), reverse=True)]


def named(run_dir: Path, which: str) -> Path:
    """The checkpoint folder ``which`` names: a name in RUN_DIR/checkpoints, or a path to one of
    them; anything else (``../x``, another run's checkpoint) is refused."""
    folder = Path(run_dir) / "checkpoints"
    p = folder / which  # a name; an absolute path stays as it is
    if not p.exists() and Path(which).exists():
        p = Path(which)  # a path from the current directory
    try:
        ours = p.resolve().parent == folder.resolve()
    except (OSError, ValueError):  # a NUL byte, a symlink loop
        ours = False
    if not ours:
        raise UserInputError(
            f"not one of this run's checkpoints: name one in {folder} (for example "
            "step-000300), or give --resume alone for the newest",
            f"--resume {which}",
        )
    return p


def pick(run_dir: Path, which: str, warn) -> Path:
    """The checkpoint to resume from: ``which`` is "latest" (the newest intact one; damaged ones
    are skipped with a warning) or one of the run's checkpoint folders, by name or path (which
    must be intact)."""
    if which != "latest":
        p = named(run_dir, which)
        if not (p / "trainer_state.json").exists():
            raise UserInputError("not a checkpoint (no trainer_state.json)", str(p))
        why = verify(p)
        if why:
            raise UserInputError(f"cannot resume from it: {why}", str(p))
        return p
    found = candidates(run_dir)
    if not found:
        raise UserInputError("no checkpoint to resume from", str(run_dir / "checkpoints"))
    for c in found:
        why = verify(c)
        if why is None:
            return c
        warn(f"skipping checkpoint {c.name}: {why}")
    raise UserInputError("no intact checkpoint to resume from", str(run_dir / "checkpoints"))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(changes a resumed run honours, changes it cannot), as 'key: old -> new' lines."""
    a, b = _flat(saved), _flat(now)
    ok, refused = [], []
    for key in sorted(set(a) | set(b)):
        if key == "source" or a.get(key) == b.get(key):
            continue
        line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        allowed = any(key == m or (m.endswith(".") and key.startswith(m)) for m in MAY_CHANGE)
        (ok if allowed else refused).append(line)
    return ok, refused
