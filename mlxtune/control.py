"""Requests to a running trainer through RUN_DIR/control/: one empty file per request.

The dashboard (or anyone: ``touch RUN_DIR/control/save``) writes a request; the trainer reads
the folder once per step, on its own thread, and deletes each request file when it has read it.
So an attached dashboard and an in-process one steer the run the same way, and the trainer never
depends on the dashboard.
"""

from __future__ import annotations

import os
from pathlib import Path

REQUESTS = ("save", "eval", "sample", "pause", "resume", "stop")


def request(run_dir: str | Path, what: str) -> Path:
    """Ask the trainer of ``run_dir`` to do ``what`` (one of REQUESTS) after its current step."""
    if what not in REQUESTS:
        raise ValueError(f"unknown request {what!r}; one of {', '.join(REQUESTS)}")
    folder = Path(run_dir) / "control"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / what
    tmp = folder / f".{what}.tmp"
    tmp.write_text("")
    os.replace(tmp, path)
    return path


def take_requests(run_dir: str | Path) -> set[str]:
    """The pending requests, removed from the folder (so each is acted on once)."""
    folder = Path(run_dir) / "control"
    try:
        present = set(os.listdir(folder)) & set(REQUESTS)  # one look per step, usually empty
    except FileNotFoundError:
        return set()
    taken = set()
    for what in present:
        p = folder / what
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        taken.add(what)
    return taken
