"""Encoding a split in several processes, and reporting how encoding goes."""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing
import os
import sys
import types
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserInputError
from .formats import only_built_in_formats

_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("data_progress", default=None)


@contextlib.contextmanager
def reporting(progress):
    """Within it, encoding a split reports ``progress(label, rows done, rows)`` as it goes (a
    console's progress bar); None reports nothing."""
    token = _PROGRESS.set(progress)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def tracked(rows: list, label: str):
    """``rows``, reporting the progress of a loop over them (about 200 times, and at the end)."""
    progress = _PROGRESS.get()
    if progress is None:
        yield from rows
        return
    n = len(rows)
    every = max(1, n // 200)
    for i, row in enumerate(rows):
        if i % every == 0:
            progress(label, i, n)
        yield row
    progress(label, n, n)


PARALLEL_ROWS = 20_000
"""Rows from which a split is encoded by several processes (``data.num_proc: auto``)."""
_CHUNK_ROWS = 2_000

_WORKER: dict = {}


def workers_for(rows: int, num_proc: int | str) -> int:
    """Processes to encode ``rows`` rows with: ``num_proc``, or (auto) every core up to 8 from
    PARALLEL_ROWS rows on (one below). Data in a format a program registered is encoded here
    (another process does not know the format)."""
    if not only_built_in_formats():
        return 1
    if num_proc == "auto":
        return min(os.cpu_count() or 1, 8) if rows >= PARALLEL_ROWS else 1
    return max(1, int(num_proc))


def _start_worker(encoder) -> None:
    _WORKER["encoder"] = encoder  # the parent's own Encoder, as multiprocessing hands it over


@dataclass(frozen=True)
class _Failed:
    """A row's UserInputError, as a worker sends it back."""

    message: str
    where: str | None


def _encode_rows(job):
    """In a worker: each row encoded, or the error it gave (``_Failed``)."""
    fmt, path, rows = job
    encoder = _WORKER["encoder"]
    out = []
    for n, obj in rows:
        try:
            out.append(encoder.encode(obj, fmt, f"{path}:{n}"))
        except UserInputError as e:
            out.append(_Failed(e.message, e.where))
    return out


@contextlib.contextmanager
def _bare_main():
    """A spawned process rebuilds the program's ``__main__`` by running its file again: a
    script that trains at its top level, with no ``if __name__ == "__main__":`` guard, would
    start training again in every worker (and its first worker would never start). The workers
    need nothing of it, so while they start, ``__main__`` is an empty module."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def encoder_pool(encoder, workers: int) -> ProcessPoolExecutor:
    """``workers`` processes (spawned, as macOS needs) that encode with ``encoder``: started as
    the first jobs are handed out (``encoded``), ended by ``shutdown()``."""
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)
    )


def encoded(encoder, rows: list, fmt: str, path, workers: int = 1, pool=None):
    """(row number, what ``encoder.encode(row, fmt, where)`` gave: an Example, or the
    UserInputError it raised), in file order: encoded here, or
    by ``workers`` processes (``encoder_pool``, or ``pool`` when given: kept for the next call),
    each given chunks of rows."""
    label = f"encoding {Path(path).name}"
    if workers <= 1 and pool is None:
        for n, obj in tracked(rows, label):
            try:
                yield n, encoder.encode(obj, fmt, f"{path}:{n}")
            except UserInputError as e:
                yield n, e
        return
    chunks = [rows[i : i + _CHUNK_ROWS] for i in range(0, len(rows), _CHUNK_ROWS)]
    jobs = [(fmt, str(path), chunk) for chunk in chunks]
    progress = _PROGRESS.get() or (lambda *_: None)
    progress(label, 0, len(rows))
    done = 0
    with (
        contextlib.nullcontext(pool) if pool is not None else encoder_pool(encoder, workers) as pool
    ):
        with _bare_main():  # the workers start as the jobs are handed out
            futures = [pool.submit(_encode_rows, job) for job in jobs]
        for i, chunk in enumerate(chunks):
            results = futures[i].result()
            futures[i] = None  # a chunk's examples live no longer than the caller keeps them
            for (n, _), result in zip(chunk, results, strict=True):
                if isinstance(result, _Failed):
                    result = UserInputError(result.message, result.where)
                yield n, result
            done += len(chunk)
            progress(label, done, len(rows))
