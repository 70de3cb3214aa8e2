"""Streaming (``data.streaming``): a training set larger than memory, read, encoded and batched
a window of rows at a time.

The stream is the source's rows in order (a glob's files in name order, a saved dataset's in its
own). It is cut into windows of ``data.stream_window`` rows. Each window's examples are shuffled
(from the seed, the epoch and the window's number) and batched as a whole data set would be
(length buckets, or packed rows); only that window, and the next one being encoded beside the
training, are in memory. When the source ends, the next epoch starts again at its beginning.

Where the loop is in the stream is a ``StreamState``: the epoch, the window's number, where the
window starts in the source (a ``Cursor``: the file, the byte or row offset in it, the line that
names the row) and how many of its batches were taken. A checkpoint keeps it; a resumed run seeks
straight to the window's start (no earlier row is read again), encodes that window again and
skips the batches taken, so it trains on the batches an uninterrupted run would have.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserInputError
from .batching import batch_order, make_batch
from .encode import Dataset, Encoder, SplitStats, encode_rows
from .formats import detect_format
from .packing import make_packed_batch, packed_epoch
from .parallel import encoder_pool, workers_for
from .rows import BINARY, TABLES, BadRows, _json_line, _renamed, _sources, hub_dataset


@dataclass(frozen=True)
class Cursor:
    """A place in the stream: the next row to read."""

    file: int = 0
    """The source file (an index into the stream's files)."""
    offset: int = 0
    """Bytes into a text file (JSONL, CSV/TSV, text), or rows into a table (Parquet, Arrow, a
    Hub dataset)."""
    line: int = 1
    """The line (a table: the row, from 1) the row starts on, which names it in messages."""


@dataclass(frozen=True)
class StreamState:
    """Where training is in the stream: enough to go on from there exactly."""

    epoch: int = 0
    window: int = 0
    """The window's number within the epoch."""
    cursor: Cursor = Cursor()
    """Where the window starts."""
    taken: int = 0
    """Batches of the window already trained on."""

    def to_json(self) -> dict:
        c = self.cursor
        return {
            "epoch": self.epoch,
            "window": self.window,
            "cursor": [c.file, c.offset, c.line],
            "taken": self.taken,
        }

    @classmethod
    def from_json(cls, d: dict) -> StreamState:
        f, o, n = d["cursor"]
        return cls(int(d["epoch"]), int(d["window"]), Cursor(int(f), int(o), int(n)), d["taken"])


# ------------------------------------------------------------------------------- reading
def stream_files(source: str) -> list[tuple[str | None, Path]] | None:
    """(label, file) of each file the stream reads in order (label None: the only one), or None
    for a Hub dataset (read through ``datasets``). A file that cannot be read row by row (a
    JSON array, a binary format) is refused."""
    if source.startswith("hf:"):
        return None
    path = Path(source)
    files = _sources(path)
    files = [(None, path)] if files is None else [(label, f) for label, f in files]
    for _, f in files:
        suffix = f.suffix.lower()
        if suffix in BINARY:
            raise UserInputError(
                f"{suffix} files are not read; write the rows as JSONL or Parquet", str(f)
            )
        if not f.is_file():
            raise UserInputError("data file not found", str(f))
        if suffix == ".json" and _first_byte(f) == b"[":
            raise UserInputError(
                "a JSON array is read whole, not streamed; write one object a line (JSONL) to "
                "stream it",
                str(f),
            )
    return files


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    return head[:1]


def _text_rows(path: Path, c: Cursor) -> Iterator[tuple[int, object, int, int]]:
    """(line, row or the UserInputError it gave, offset after, line after) of a JSONL file."""
    with open(path, "rb") as f:
        f.seek(c.offset)
        at, line = c.offset, c.line
        for raw in f:
            start, at, line = line, at + len(raw), line + 1
            if start == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                obj = _json_line(raw, f"{path}:{start}")
            except UserInputError as e:
                obj = e
            if obj is not None:
                yield start, obj, at, line


def _paragraph_rows(path: Path, c: Cursor) -> Iterator[tuple[int, object, int, int]]:
    """Plain text: each run of non-blank lines a ``{"text": ...}`` row, named by its first line;
    the row ends after the blank line that follows it."""
    with open(path, "rb") as f:
        f.seek(c.offset)
        at, line, lines, first = c.offset, c.line, [], 0
        for raw in f:
            n, at, line = line, at + len(raw), line + 1
            if n == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                lines, bad = [], UserInputError(f"not UTF-8 ({e.reason})", f"{path}:{n}")
                yield n, bad, at, line
                continue
            if text.strip():
                first = first if lines else n
                lines.append(text)
            elif lines:
                yield first, {"text": "\n".join(lines)}, at, line
                lines = []
        if lines:
            yield first, {"text": "\n".join(lines)}, at, line


def _csv_rows(path: Path, c: Cursor, delimiter: str) -> Iterator[tuple[int, object, int, int]]:
    """A CSV/TSV file's rows by its header, each named by the line it starts on."""
    with open(path, "rb") as f:
        at = 0

        def lines():
            nonlocal at
            for raw in f:
                at += len(raw)
                try:
                    yield raw.decode("utf-8-sig" if at == len(raw) else "utf-8")
                except UnicodeDecodeError as e:
                    raise UserInputError(f"not UTF-8 ({e.reason})", str(path)) from None

        reader = csv.reader(lines(), delimiter=delimiter)
        header = next(reader, None)
        if not header:
            raise UserInputError("no header line naming the columns", str(path))
        if at < c.offset:
            f.seek(c.offset)
            at = c.offset
            reader = csv.reader(lines(), delimiter=delimiter)
        base, start = reader.line_num, max(c.line, 2)
        for cells in reader:
            where = f"{path}:{start}"
            nxt = start + reader.line_num - base
            base = reader.line_num
            if len(cells) > len(header):
                obj = UserInputError(f"{len(cells)} cells, the header names {len(header)}", where)
            else:
                obj = {k: v for k, v in zip(header, cells, strict=False)}
            if isinstance(obj, UserInputError) or any(v != "" for v in obj.values()):
                yield start, obj, at, nxt
            start = nxt


def _table_rows(path: Path, c: Cursor) -> Iterator[tuple[int, object, int, int]]:
    """A Parquet or Arrow file's records from row ``c.offset`` on, read a batch at a time (row
    groups and record batches before it are not read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def batches():
        if path.suffix.lower() == ".parquet":
            pf = pq.ParquetFile(path)
            first, start = 0, 0
            while first < pf.num_row_groups:
                n = pf.metadata.row_group(first).num_rows
                if start + n > c.offset:
                    break
                first, start = first + 1, start + n
            groups = list(range(first, pf.num_row_groups))
            yield start, None
            if groups:
                yield from ((None, b) for b in pf.iter_batches(1024, row_groups=groups))
            return
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_file(source)
            yield 0, None
            for i in range(reader.num_record_batches):
                yield None, reader.get_batch(i)
        except pa.ArrowInvalid:  # not the file format: the stream format
            yield 0, None
            yield from ((None, b) for b in pa.ipc.open_stream(source))

    try:
        at = 0
        for start, batch in batches():
            if batch is None:
                at = start
                continue
            if at + batch.num_rows <= c.offset:
                at += batch.num_rows
                continue
            for i, record in enumerate(batch.to_pylist()):
                if at + i >= c.offset:
                    row = {k: v for k, v in record.items() if v is not None}
                    yield at + i + 1, row, at + i + 1, at + i + 2
            at += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise UserInputError(f"not a readable {path.suffix} file ({e})", str(path)) from None


def _file_rows(path: Path, c: Cursor):
    suffix = path.suffix.lower()
    if suffix in TABLES:
        return _table_rows(path, c)
    if suffix in (".csv", ".tsv"):
        return _csv_rows(path, c, "\t" if suffix == ".tsv" else ",")
    if suffix == ".txt":
        return _paragraph_rows(path, c)
    return _text_rows(path, c)


def _hub_rows(source: str, c: Cursor):
    ds = hub_dataset(source, streaming=True)
    for k, record in enumerate(ds.skip(c.offset) if c.offset else ds, c.offset):
        yield k + 1, {key: v for key, v in record.items() if v is not None}, k + 1, k + 2


def read_stream(
    source: str, files, start: Cursor, columns: dict[str, str] | None = None
) -> Iterator[tuple[str, object, Cursor]]:
    """(row name, row or the UserInputError it gave, the cursor after it) of each row of the
    stream from ``start`` on; ``files`` is ``stream_files(source)``, ``columns`` renames as
    ``data.columns`` does."""
    if files is None:
        parts = [(None, None)]
    else:
        parts = files
    for i in range(start.file, len(parts)):
        label, path = parts[i]
        c = start if i == start.file else Cursor(i)
        rows = _hub_rows(source, c) if path is None else _file_rows(path, c)
        for n, obj, offset, line in rows:
            name = f"{label}:{n}" if label is not None else str(n)
            if columns and isinstance(obj, dict):
                try:
                    obj = _renamed(obj, columns, f"{source}:{name}")
                except UserInputError as e:
                    obj = e
            yield name, obj, Cursor(i, offset, line)


def read_fraction(files, c: Cursor) -> float | None:
    """How much of the stream lies before ``c`` (0 to 1), by bytes (a table file: rows); None
    for a Hub dataset."""
    if not files:
        return None
    if c.file >= len(files):
        return 1.0
    path = files[c.file][1]
    if path.suffix.lower() in TABLES:
        total = _table_length(path)
    else:
        total = path.stat().st_size
    return (c.file + min(1.0, c.offset / max(total, 1))) / len(files)


@functools.lru_cache(maxsize=64)
def _table_length(path: Path) -> int:
    """A table file's rows (read once: the fraction is asked for at every step)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix.lower() == ".parquet":
        return pq.ParquetFile(path).metadata.num_rows
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_file(source).read_all().num_rows
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all().num_rows


# ------------------------------------------------------------------------------- the set
@dataclass
class _Window:
    examples: list
    end: Cursor
    last: bool
    """The source ended within it (or right after it)."""
    stats: SplitStats


class StreamedSet:
    """The training set of ``data.streaming``: read, encoded and batched a window of rows at a
    time (see the module). ``examples`` and ``stats`` are the first window's (the look at the
    data that the header and the memory plan take); ``state`` is where the next batch comes
    from."""

    streamed = True

    def __init__(
        self,
        source: str,
        encoder: Encoder,
        fmt: str,
        limits: tuple[int, str, int],
        columns: dict[str, str] | None,
        bad: tuple[bool, float],
        num_proc: int | str,
        window: int,
    ):
        self.path = source
        self.files = stream_files(source)
        self.encoder, self.fmt, self.limits, self.columns = encoder, fmt, limits, columns
        self.bad, self.num_proc, self.size = bad, num_proc, window
        self.start = Cursor()
        """Where training rows begin (after any held out)."""
        self.state = StreamState()
        """Where the next batch comes from."""
        self._pool = None
        self._thread = None
        self._next = None  # (cursor, future) of the window encoded ahead
        self._first: tuple[Cursor, _Window] | None = None
        self._stats: SplitStats | None = None

    def __len__(self):
        raise TypeError("a streamed training set has no length until it is read")

    def __bool__(self) -> bool:
        return True

    # ---------------------------------------------------------------- held out, first look
    def hold_out(self, counts: list[int]) -> list[list[tuple[str, dict]]]:
        """The stream's first rows, ``counts[0]`` of them, then ``counts[1]``, ...: held out
        (validation, test), and training starts after them. Fewer rows than that, and one to
        train on, is an error."""
        want = sum(counts)
        rows, end = [], Cursor()
        bad = BadRows(*self.bad)
        for name, obj, after in read_stream(self.path, self.files, Cursor(), self.columns):
            with bad.row():
                if isinstance(obj, UserInputError):
                    raise obj
                rows.append((name, obj))
            end = after
            if len(rows) == want:
                break
        if (
            len(rows) < want
            or next(read_stream(self.path, self.files, end, self.columns), None) is None
        ):
            raise UserInputError(
                f"the stream has {len(rows)} rows to hold out {want} "
                "(data.valid_size, data.test_size) and keep one to train on",
                self.path,
            )
        self.start, self.state, self._stats = end, StreamState(cursor=end), None
        out, at = [], 0
        for n in counts:
            out.append(rows[at : at + n])
            at += n
        return out

    @property
    def first(self) -> _Window:
        """The first training window, encoded once (its errors come before the model loads)."""
        if self._first is None or self._first[0] != self.start:
            self._first = (self.start, self._encode(self.start, first=True))
        return self._first[1]

    def read_first(self) -> SplitStats:
        """Encode the first training window now (unless done): its stats."""
        return self.stats

    @property
    def examples(self) -> list:
        return self.first.examples

    @property
    def stats(self) -> SplitStats:
        if self._stats is None:
            self._stats = self.first.stats
        return self._stats

    def resume(self, state: dict | None) -> None:
        """Go on from ``state`` (``StreamState.to_json``), as a checkpoint kept it."""
        if state is not None:
            self.state = StreamState.from_json(state)

    def fraction(self) -> float | None:
        """How much of the stream the current epoch has read (None where unknown)."""
        return read_fraction(self.files, self.state.cursor)

    # ---------------------------------------------------------------- windows
    def _encode(self, cursor: Cursor, first: bool = False) -> _Window:
        """The window of rows from ``cursor``: its examples (fitted to the limits), where it
        ends, whether the source ended in it."""
        rows, end, last = [], cursor, True
        bad = BadRows(*self.bad)  # the share of bad rows is checked window by window
        for name, obj, after in read_stream(self.path, self.files, cursor, self.columns):
            end = after
            with bad.row():
                if isinstance(obj, UserInputError):
                    raise obj
                rows.append((name, obj))
            if len(rows) + len(bad.seen) == self.size:
                last = False
                break
        bad.rows = len(rows) + len(bad.seen)
        stats = SplitStats(window=self.size)
        if not rows:
            bad.check(bad.rows, self.path)
            if first:
                raise UserInputError("the stream has no rows to train on", self.path)
            return _Window([], end, True, stats)
        if self.fmt == "auto":
            self.fmt = detect_format(rows[0][1], f"{self.path}:{rows[0][0]}")
        workers = workers_for(len(rows), self.num_proc)
        if workers > 1 and self._pool is None:
            self._pool = encoder_pool(self.encoder, workers)
        ds = encode_rows(
            rows,
            self.path,
            self.encoder,
            self.fmt,
            self.limits,
            bad,
            workers,
            self._pool,
            allow_empty=not first,
        )
        ds.stats.window = self.size
        return _Window(ds.examples, end, last, ds.stats)

    def _window(self, cursor: Cursor) -> _Window:
        """The window from ``cursor``: encoded ahead, or now; the next one starts encoding."""
        if self._first is not None and self._first[0] == cursor:
            w = self._first[1]
            self._first = None  # kept no longer than the first pass over it
        elif self._next is not None and self._next[0] == cursor:
            w = self._next[1].result()
        else:
            w = self._encode(cursor)
        self._next = None
        if not w.last:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="mlxtune-stream")
            self._next = (w.end, self._thread.submit(self._encode, w.end))
        return w

    def batches(
        self,
        batch_size: int,
        pad_id: int,
        multiple: int,
        seed: int,
        bucket_size: int,
        packing: str = "off",
        capacity: int = 0,
        mask_boundary: bool = True,
    ):
        """The endless (epoch, batch) stream from ``state`` on; ``state`` always says where the
        batch after the one just given comes from."""
        st = self.state
        clean, given = st.window == 0 and st.taken == 0, 0  # an epoch read from its start
        while True:
            w = self._window(st.cursor)
            key = [seed, st.epoch, st.window]
            if packing != "off":
                ds = Dataset(w.examples)
                rows = (
                    packed_epoch(ds, packing, capacity, seed, st.epoch, key=key)
                    if w.examples
                    else []
                )
                groups = [rows[s : s + batch_size] for s in range(0, len(rows), batch_size)]

                def make(g):
                    return make_packed_batch(g, pad_id, capacity, mask_boundary)
            else:
                lengths = [len(e.ids) for e in w.examples]
                order = batch_order(lengths, batch_size, st.epoch, seed, bucket_size, key=key)
                groups = [[w.examples[i] for i in idx] for idx in order]

                def make(g):
                    return make_batch(g, pad_id, multiple)

            if w.last:
                after = StreamState(st.epoch + 1, 0, self.start, 0)
            else:
                after = StreamState(st.epoch, st.window + 1, w.end, 0)
            for i in range(st.taken, len(groups)):
                self.state = dataclasses.replace(st, taken=i + 1) if i + 1 < len(groups) else after
                given += 1
                yield st.epoch, make(groups[i])
            if w.last:
                if clean and given == 0:  # a whole epoch, and no batch: no end to the search
                    raise UserInputError(
                        "no row of the stream is left to train on (too long, too short or "
                        "untrained): check data.max_length, data.min_length and the prompt "
                        "masking",
                        self.path,
                    )
                clean, given = True, 0
            st = self.state = after

    def close(self) -> None:
        """End the helper thread and processes."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __repr__(self):
        return f"StreamedSet({self.path!r}, window={self.size})"


__all__ = ["Cursor", "StreamState", "StreamedSet", "read_stream", "stream_files"]
