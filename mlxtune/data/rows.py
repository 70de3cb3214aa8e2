"""Reading a data source into rows: JSONL (one object a line), a JSON array of objects (.json,
as Alpaca's data is shipped; a .json file of lines is read as JSONL), CSV and TSV (a header, then
one row a line), plain text (.txt: each paragraph, blank-line separated, one ``{"text": ...}``
row), Parquet and Arrow files (how datasets are published: a row is named by its file and its
index from 1), a glob of such files, or a folder a ``datasets`` ``save_to_disk`` wrote (a
``DatasetDict``'s split chosen with ``#split``: ``my_data#train``); columns renamed as the
recipe maps them; and what happens to a bad row (``BadRows``).
"""

from __future__ import annotations

import codecs
import csv
import glob
import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserInputError

SHOWN = 5
"""Bad rows named one by one in the log (the rest are counted)."""
BINARY = (".xlsx", ".xls", ".gz", ".zip", ".pkl", ".pickle")
"""Suffixes of files that are not text rows: refused with a way to convert them."""
TABLES = (".parquet", ".arrow", ".feather")
"""Columnar files, read with pyarrow: a row a record."""


@dataclass
class BadRows:
    """``data.bad_rows``: a bad row (not JSON, a missing or wrong field, ...) is an error
    (``skip`` false), or is skipped and remembered; more than ``max_fraction`` of a file's rows
    skipped is an error all the same."""

    skip: bool = False
    max_fraction: float = 0.05
    seen: list[tuple[str, str]] = field(default_factory=list)
    """(where, why) of each row skipped."""
    rows: int = 0
    """Rows of the file ``read`` read, bad ones included."""

    @contextmanager
    def row(self):
        """Around the reading of one row: its UserInputError skips it (``skip``) or goes on."""
        try:
            yield
        except UserInputError as e:
            if not self.skip:
                raise
            self.seen.append((e.where or "", e.message))

    def read(self, path: Path, columns: dict[str, str] | None = None) -> list[tuple[int, dict]]:
        """``read_rows`` of ``path`` through these rules, counting the file's rows."""
        rows = read_rows(path, columns, self)
        self.rows = len(rows) + len(self.seen)
        return rows

    def finish(self, stats, path) -> None:
        """After a file's rows were read and encoded: too many bad is an error; else the
        split's ``stats`` count and name the skipped ones."""
        self.check(self.rows, path)
        stats.skipped, stats.skipped_rows = len(self.seen), self.report()

    def check(self, rows: int, path) -> None:
        """After a file: too many of its ``rows`` skipped is an error naming the first."""
        if self.seen and len(self.seen) > self.max_fraction * rows:
            where, why = self.seen[0]
            raise UserInputError(
                f"{len(self.seen)} of {rows} rows are bad, more than data.max_bad_fraction "
                f"({self.max_fraction:g}); the first, {where}: {why}",
                str(path),
            )

    def report(self) -> list[str]:
        """Log lines: the skipped rows counted by reason, and the first few by line."""
        if not self.seen:
            return []
        reasons = Counter(why for _, why in self.seen)
        out = [
            f"skipped {len(self.seen)} bad rows (data.bad_rows: skip): "
            + "; ".join(f"{n} x {why}" for why, n in reasons.most_common())
        ]
        out += [f"  skipped {where}: {why}" for where, why in self.seen[:SHOWN]]
        return out


def read_rows(
    path: Path, columns: dict[str, str] | None = None, bad: BadRows | None = None
) -> list[tuple[int, dict]]:
    """(line number, row) for each row of ``path``, by its suffix: .csv and .tsv (the header
    names the fields), .txt (a paragraph a row, as text), else JSONL. ``columns`` maps the
    names a row uses to the ones its format needs (``{"prompt": "question"}``: the file's
    question is the prompt). A bad line is an error naming it, or skipped (``bad``)."""
    bad = bad or BadRows()
    hub = str(path).startswith("hf:")  # a Hub dataset's rows, not files
    sources = None if hub else _sources(path)
    if hub:
        rows = _hub_rows(str(path))
    elif sources is not None:  # several files, or a dataset folder: each row named by its file
        rows = []
        for label, source in sources:
            rows += [(f"{label}:{n}", obj) for n, obj in _read_one(source, bad)]
    else:
        rows = _read_one(path, bad)
    if columns:
        rows = [(n, _renamed(obj, columns, f"{path}:{n}")) for n, obj in rows]
    if not rows:
        raise UserInputError("the data file has no examples", str(path))
    return rows


def _sources(path: Path) -> list[tuple[str, Path]] | None:
    """(label, file) of each file a glob, or a folder ``save_to_disk`` wrote, stands for (None:
    ``path`` is one file)."""
    text = str(path)
    if not path.exists() and any(c in text for c in "*?["):
        files = sorted(glob.glob(text))
        if not files:
            raise UserInputError("no file matches this pattern", text)
        return [(Path(f).name, Path(f)) for f in files]
    folder, split = path, None
    if not path.exists() and "#" in path.name:  # a DatasetDict folder's split
        name, split = path.name.rsplit("#", 1)
        folder = path.with_name(name)
    if not folder.exists():
        raise UserInputError("data file not found", text)
    if not folder.is_dir():
        return None
    return _saved_dataset(folder, split)


def _hub_rows(source: str) -> list[tuple[str, dict]]:
    """The rows of a Hub dataset (``hub_dataset``), each numbered from 1 (a null field left
    out)."""
    return [
        (str(n), {k: v for k, v in record.items() if v is not None})
        for n, record in enumerate(hub_dataset(source).to_list(), 1)
    ]


def hub_dataset(source: str, streaming: bool = False):
    """``hf:ORG/NAME[@REVISION][:SUBSET][?data_files=GLOB[,GLOB...]][#SPLIT]``: a dataset
    repository of the Hugging Face Hub, from the local cache (downloaded first where the network
    and HF_HUB_OFFLINE allow; with data_files, only those files), its split (train by default; a
    slice as datasets writes it, ``train[:1000]``) read by ``datasets`` (``streaming``: as an
    ``IterableDataset``, read as it is iterated). data_files picks the repository's files to
    read, as ``datasets.load_dataset(data_files=...)`` does (they make the train split)."""
    import datasets
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    spec, _, split = source.removeprefix("hf:").partition("#")
    spec, _, query = spec.partition("?")
    files = None
    if query:
        key, _, value = query.partition("=")
        if key != "data_files" or not value:
            raise UserInputError(
                f"'?{query}': the one option of a hub dataset is ?data_files=GLOB[,GLOB...]",
                source,
            )
        files = [f for f in value.split(",") if f]
    spec, _, subset = spec.partition(":")
    repo, _, revision = spec.partition("@")
    try:
        folder = snapshot_download(
            repo,
            repo_type="dataset",
            revision=revision or None,
            allow_patterns=[*files, "*.md", "*.json", "*.yaml"] if files else None,
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise UserInputError(
            f"the dataset {repo!r} is neither in the local Hugging Face cache nor reachable "
            f"({type(e).__name__})",
            source,
        ) from None
    if files and not any(glob.glob(str(Path(folder) / f), recursive=True) for f in files):
        raise UserInputError(f"no file of the dataset matches data_files {','.join(files)}", source)
    try:
        return datasets.load_dataset(
            folder, subset or None, data_files=files, split=split or "train", streaming=streaming
        )
    except (ValueError, FileNotFoundError) as e:
        raise UserInputError(f"cannot read the dataset: {e}", source) from None


def _saved_dataset(folder: Path, split: str | None) -> list[tuple[str, Path]]:
    """The Arrow files of a folder ``datasets``' ``save_to_disk`` wrote, in order."""
    where = str(folder)
    splits = folder / "dataset_dict.json"
    if splits.exists():
        names = json.loads(splits.read_text()).get("splits", [])
        if split is None or split not in names:
            raise UserInputError(
                f"this folder holds the splits {', '.join(names)}; name one after a '#' "
                f"({folder.name}#{names[0] if names else 'train'})",
                where,
            )
        folder = folder / split
    elif split is not None:
        raise UserInputError(f"'#{split}' names a split, and this folder holds one dataset", where)
    state = folder / "state.json"
    if not state.exists():
        raise UserInputError(
            "expected a data file, or a folder a datasets save_to_disk wrote (it has no "
            "state.json)",
            str(folder),
        )
    files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not files:
        raise UserInputError("the saved dataset lists no data files (state.json)", str(folder))
    return [(name, folder / name) for name in files]


def _read_one(path: Path, bad: BadRows) -> list[tuple[int, dict]]:
    """(line or row number, row) of one data file, by its suffix."""
    if not path.exists():
        raise UserInputError("data file not found", str(path))
    if path.is_dir():
        raise UserInputError("expected a data file, got a directory", str(path))
    suffix = path.suffix.lower()
    if suffix in BINARY:
        raise UserInputError(
            f"{suffix} files are not read; write the rows as JSONL (one JSON object a line), "
            "JSON, CSV, TSV, text or Parquet (e.g. pandas: df.to_parquet(path))",
            str(path),
        )
    if suffix in TABLES:
        return _columnar(path)
    if suffix in (".csv", ".tsv"):
        return _table(path, "\t" if suffix == ".tsv" else ",")
    if suffix == ".txt":
        return _paragraphs(path)
    if suffix == ".json" and _text_of(path).lstrip().startswith("["):
        return _json_array(path, bad)
    return _jsonl(path, bad)


def _columnar(path: Path) -> list[tuple[int, dict]]:
    """A Parquet or Arrow (IPC file or stream, as ``datasets`` caches and saves them) file's
    records, numbered from 1; a null field is left out, as a JSON row without it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            table = pq.read_table(path)
        else:
            try:
                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:  # not the file format: the stream format
                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as e:
        raise UserInputError(f"not a readable {path.suffix} file ({e})", str(path)) from None
    return [
        (n, {k: v for k, v in record.items() if v is not None})
        for n, record in enumerate(table.to_pylist(), 1)
    ]


def _renamed(obj: dict, columns: dict[str, str], where: str) -> dict:
    """``obj`` with each ``columns`` value's field under its key's name."""
    out = dict(obj)
    for want, have in columns.items():
        if have not in obj:
            raise UserInputError(
                f"no column {have!r} (data.columns maps it to {want!r}); the row has "
                f"{', '.join(map(str, obj)) or 'none'}",
                where,
            )
        out[want] = out.pop(have)
    return out


def _text_of(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark (Excel's) is not text
    except UnicodeDecodeError as e:
        raise UserInputError(f"not UTF-8 ({e.reason} at byte {e.start})", str(path)) from None


def _table(path: Path, delimiter: str) -> list[tuple[int, dict]]:
    """A CSV/TSV file's rows as dicts by its header, each with the line it starts on."""
    lines = _text_of(path).splitlines(keepends=True)
    reader = csv.DictReader(lines, delimiter=delimiter)
    if not reader.fieldnames:
        raise UserInputError("no header line naming the columns", str(path))
    twice = next((c for i, c in enumerate(reader.fieldnames) if c in reader.fieldnames[:i]), None)
    if twice is not None:  # DictReader would keep the last of its cells
        raise UserInputError(f"the header names the column {twice!r} twice", f"{path}:1")
    rows, start = [], 2
    for row in reader:
        if None in row:  # more cells than the header has names
            raise UserInputError(
                f"{len(reader.fieldnames) + len(row[None])} cells, the header names "
                f"{len(reader.fieldnames)}",
                f"{path}:{start}",
            )
        if any(v not in (None, "") for v in row.values()):
            rows.append((start, {k: v for k, v in row.items() if v is not None}))
        start = reader.line_num + 1
    return rows


def _paragraphs(path: Path) -> list[tuple[int, dict]]:
    """Plain text: each run of non-blank lines a ``{"text": ...}`` row, at its first line."""
    rows, lines, first = [], [], 0
    for n, line in enumerate(_text_of(path).splitlines(), 1):
        if line.strip():
            if not lines:
                first = n
            lines.append(line)
        elif lines:
            rows.append((first, {"text": "\n".join(lines)}))
            lines = []
    if lines:
        rows.append((first, {"text": "\n".join(lines)}))
    return rows


def _jsonl(path: Path, bad: BadRows) -> list[tuple[int, dict]]:
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            with bad.row():
                raw = raw.removeprefix(codecs.BOM_UTF8) if n == 1 else raw
                rows.append((n, _json_line(raw, f"{path}:{n}")))
    rows = [r for r in rows if r[1] is not None]
    bad.check(len(rows) + len(bad.seen), path)
    return rows


def _json_array(path: Path, bad: BadRows) -> list[tuple[int, dict]]:
    """A JSON array's objects, each with the line it starts on."""
    text, dec = _text_of(path), json.JSONDecoder()
    line, at = 1, 0  # the line of position ``at``

    def skip(i: int) -> int:  # past whitespace
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(i: int) -> int:
        nonlocal line, at
        line, at = line + text.count("\n", at, i), i
        return line

    rows, i = [], skip(0) + 1  # past the "["
    while True:
        i = skip(i)
        if i < len(text) and text[i] == "]" and not rows:
            break
        where = f"{path}:{line_of(min(i, len(text)))}"
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise UserInputError(f"not valid JSON ({e.msg})", f"{path}:{e.lineno}") from None
        with bad.row():
            if not isinstance(obj, dict):
                raise UserInputError(
                    f"each item of the array must be a JSON object, got {type(obj).__name__}",
                    where,
                )
            rows.append((line, obj))
        i = skip(i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] == "]":
            break
        else:
            raise UserInputError("not valid JSON (expected ',' or ']')", f"{path}:{line_of(i)}")
    if text[skip(i + 1) :]:
        raise UserInputError("not valid JSON (text after the array)", f"{path}:{line_of(i)}")
    bad.check(len(rows) + len(bad.seen), path)
    return rows


def _json_line(raw: bytes, where: str) -> dict | None:
    """One JSONL line's object (None for a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserInputError(f"not UTF-8 ({e.reason} at byte {e.start})", where) from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserInputError(f"not valid JSON ({e.msg} at column {e.colno})", where) from None
    if not isinstance(obj, dict):
        raise UserInputError(f"each line must be a JSON object, got {type(obj).__name__}", where)
    return obj
