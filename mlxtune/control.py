"""Steering a running trainer: requests through RUN_DIR/control/, and SIGINT/SIGTERM.

Requests are one empty file each.

The dashboard (or anyone: ``touch RUN_DIR/control/save``) writes a request; the trainer reads
the folder once per step, on its own thread, and deletes each request file when it has read it.
So an attached dashboard and an in-process one steer the run the same way, and the trainer never
depends on the dashboard.
"""

from __future__ import annotations

import os
import signal
import threading
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


class Signals:
    """SIGINT and SIGTERM caught while a run trains (in the main thread only): the first sets
    ``caught`` to the signal's name and calls ``on_first(name)``, so the run can finish its
    step and save; a second one stops at once (``KeyboardInterrupt``). A context manager that
    puts the previous handlers back."""

    def __init__(self, on_first, enabled: bool = True):
        self.caught: str | None = None
        self._on_first = on_first
        self._enabled = enabled
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.caught is not None:  # the second one: stop now
            self._restore()
            raise KeyboardInterrupt
        self.caught = signal.Signals(signum).name
        self._on_first(self.caught)

    def _restore(self):
        for s, h in self._previous.items():
            signal.signal(s, h)

    def __enter__(self) -> Signals:
        self.caught = None
        if self._enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            for s in self._previous:
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        self._restore()
        self._previous = {}
