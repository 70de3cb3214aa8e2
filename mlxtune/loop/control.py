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


HARD_STOP_GRACE_S = 2.0
"""After a second signal, how long the main thread has to stop by itself (``KeyboardInterrupt``)
before the process is ended from the side."""


class Signals:
    """SIGINT and SIGTERM caught while a run trains (in the main thread only): the first sets
    ``caught`` to the signal's name and calls ``on_first(name)``, so the run can finish its
    step and save; a second one stops at once (``KeyboardInterrupt``). A context manager that
    puts the previous handlers back.

    Python runs a signal's handler in the main thread between two of its instructions, so a
    main thread inside one long MLX evaluation (a slow step, an evaluation pass) would hear the
    second signal only when it returns. The signals also reach a watcher thread (through
    ``signal.set_wakeup_fd``, written by the interpreter's C handler at once, whatever the main
    thread is doing): after a second one, if the main thread has not stopped within
    ``HARD_STOP_GRACE_S``, the watcher writes ``on_hard_stop()`` (what was lost, how to resume)
    to stderr and ends the process with exit code 130. Checkpoints are written aside and renamed
    whole, so the last one stays valid."""

    def __init__(self, on_first, enabled: bool = True, on_hard_stop=None):
        self.caught: str | None = None
        self._on_first = on_first
        self._on_hard_stop = on_hard_stop
        self._enabled = enabled
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None
        self._previous_fd = -1
        self._seen = 0  # SIGINT/SIGTERM the watcher heard
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _handler(self, signum, frame):
        if self.caught is not None:  # the second one: stop now
            self._restore()
            raise KeyboardInterrupt
        self.caught = signal.Signals(signum).name
        self._on_first(self.caught)

    def _restore(self):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        if self._wakeup is not None:
            try:
                signal.set_wakeup_fd(self._previous_fd)
            except ValueError:  # not the main thread any more: nothing was set there
                pass
            (r, w), self._wakeup = self._wakeup, None
            self._done.set()
            try:
                os.write(w, b"\0")  # wakes the watcher from its read
            except OSError:
                pass
            if self._thread is not None:
                self._thread.join(timeout=5)
                self._thread = None
            for fd in (r, w):
                os.close(fd)

    def _watch(self, r: int) -> None:
        """The watcher thread: counts the signals; after a second one, ends the process unless
        the main thread stops first."""
        while not self._done.is_set():
            try:
                got = os.read(r, 64)
            except OSError:
                return
            self._seen += sum(b in (signal.SIGINT, signal.SIGTERM) for b in got)
            if self._seen >= 2 and not self._done.wait(HARD_STOP_GRACE_S):
                self._hard_stop()

    def _hard_stop(self) -> None:
        message = "stopped at once (a second signal)"
        if self._on_hard_stop is not None:
            try:
                message = self._on_hard_stop()
            except Exception:  # noqa: BLE001 - the process ends whatever the message does
                pass
        try:
            os.write(2, f"\nmlxtune: {message}\n".encode())
        finally:
            os._exit(130)

    def __enter__(self) -> Signals:
        self.caught = None
        self._seen = 0
        if self._enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            for s in self._previous:
                signal.signal(s, self._handler)
            r, w = os.pipe()
            os.set_blocking(w, False)
            try:
                self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            except ValueError:
                os.close(r)
                os.close(w)
                return self
            self._done = threading.Event()
            self._wakeup = (r, w)
            self._thread = threading.Thread(
                target=self._watch, args=(r,), name="mlxtune-signals", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._restore()


def agree_after_step(world, asked: set[str], save: bool, stop: bool, interrupted: str | None):
    """What every rank of a data-parallel run does after a step: rank 0's control requests
    (``asked``), and the save, stop and signal of any rank, in one small all-reduce:
    ``(asked, save, stop, interrupted)``."""
    flags = (
        "eval" in asked,
        "sample" in asked,
        save,
        stop,
        interrupted == "SIGINT",
        interrupted not in (None, "SIGINT"),
    )
    got = [v > 0 for v in world.agree([float(f) for f in flags])]
    asked = {k for k, on in zip(("eval", "sample"), got[:2], strict=True) if on}
    return asked, got[2], got[3], "SIGINT" if got[4] else "SIGTERM" if got[5] else None
