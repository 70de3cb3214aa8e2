"""Encoded data sets kept on disk, so that a second run and every resume skip tokenization.

A split is stored under a key made of everything its examples depend on: the content of the data
files (their bytes, hashed), the tokenizer (its vocabulary, merges, special tokens and chat
template), the settings that shape encoding (format, lengths, masking, template arguments, bad-row
policy, column names), and the source of mlxtune's data package itself, so that a changed encoder
never reads an old entry. A changed file, tokenizer or setting is a miss, never a wrong hit.

Entries live in ``$MLXTUNE_CACHE/data`` (default ``~/.cache/mlxtune/data``), one folder per key:
``tokens.safetensors`` holds every integer-list field of the examples as one flat int32 array with
offsets, ``meta.json`` the other fields and the split's stats. No pickle: reading an entry runs no
code. A folder appears whole (written aside, then renamed), so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import distributed
from .encode import Dataset, Example, ExampleTable, SplitStats
from .formats import only_built_in_formats

FORMAT = 1  # the layout of an entry

_CHUNK = 1 << 20


def cache_root() -> Path:
    """Where entries live: ``$MLXTUNE_CACHE/data``, else ``~/.cache/mlxtune/data`` (XDG's
    cache folder where ``XDG_CACHE_HOME`` is set)."""
    if os.environ.get("MLXTUNE_CACHE"):
        return Path(os.environ["MLXTUNE_CACHE"]) / "data"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxtune" / "data"


def _hash_file(h, path: Path) -> None:
    h.update(str(path.name).encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def source_files(source: str) -> list[Path] | None:
    """The files a data source reads, in order, or None where that cannot be told without
    reading it (a hub dataset not yet in the local cache)."""
    if source.startswith("hf:"):
        return _hub_files(source)
    path, _, _ = source.partition("#")
    if any(c in path for c in "*?["):
        return [Path(p) for p in sorted(glob.glob(path))]
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    return [p] if p.exists() else None


def _hub_files(source: str) -> list[Path] | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    spec = source.removeprefix("hf:").partition("#")[0].partition("?")[0].partition(":")[0]
    repo, _, revision = spec.partition("@")
    try:  # the local copy only: no network here, a miss just skips the cache
        folder = snapshot_download(
            repo, repo_type="dataset", revision=revision or None, local_files_only=True
        )
    except Exception:  # not in the local cache (or no such repository)
        return None
    return sorted(f for f in Path(folder).rglob("*") if f.is_file())


def content_hash(source: str) -> str | None:
    """A hash of the bytes of every file ``source`` reads (with the source's own spelling:
    its split, slice and options), or None where the files cannot be told."""
    files = source_files(source)
    if not files:
        return None
    h = hashlib.blake2b(digest_size=20)
    h.update(source.partition("#")[2].encode() + b"\0")
    for f in files:
        _hash_file(h, f)
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """A hash of what a tokenizer encodes with: its vocabulary and rules (the fast tokenizer's
    whole state, else its vocabulary), its special tokens and its chat template."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    h = hashlib.blake2b(digest_size=20)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(hf.get_vocab().items())).encode())
    h.update(json.dumps(getattr(hf, "chat_template", None)).encode())
    special = {k: str(v) for k, v in sorted((hf.special_tokens_map or {}).items())}
    h.update(json.dumps(special).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()


def _code_hash() -> str:
    """A hash of the data package's own source: a changed encoder reads no old entry."""
    h = hashlib.blake2b(digest_size=20)
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def settings_of(encoder) -> dict:
    """An encoder's settings (its plain attributes, an inner encoder's too): part of a key."""
    out = {"class": _name(type(encoder))}
    for k, v in vars(encoder).items():
        if k.startswith("_"):
            continue
        if isinstance(v, (bool, int, float, str, list, dict, type(None))):
            out[k] = v
        elif hasattr(v, "__dict__") and not callable(v) and k != "tok":
            out[k] = settings_of(v)
    return out


def entry_key(source: str, tokenizer, settings: dict) -> str | None:
    """The key of a split's entry, or None when the source's files cannot be told (no cache)."""
    data = content_hash(source)
    if data is None:
        return None
    h = hashlib.blake2b(digest_size=20)
    parts = {
        "format": FORMAT,
        "data": data,
        "tokenizer": tokenizer_hash(tokenizer),
        "code": _code_hash(),
        "settings": settings,
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------ entries


def _int_lists(examples: list, name: str) -> bool:
    """Whether field ``name`` holds a list of ints (or None) in every example."""
    for e in examples:
        v = getattr(e, name)
        if v is None:
            continue
        if not isinstance(v, list) or (v and (type(v[0]) is not int)):
            return False
    return True


def save(folder: Path, ds: Dataset) -> None:
    """Write ``ds`` as an entry at ``folder`` (whole or not at all)."""
    from safetensors.numpy import save_file

    examples = ds.examples
    kind = type(examples[0]) if len(examples) else None
    names = [f.name for f in dataclasses.fields(kind)] if kind else []
    arrays: dict[str, np.ndarray] = {}
    other: dict[str, list] = {}
    if isinstance(examples, ExampleTable):  # its columns as they are
        ints, other = examples.flat()
        for name, (values, lengths) in ints.items():
            arrays[f"{name}.values"] = np.ascontiguousarray(values, dtype=np.int32)
            arrays[f"{name}.lengths"] = np.ascontiguousarray(lengths, dtype=np.int64)
        names = []
    for name in names:
        if _int_lists(examples, name):
            values = [getattr(e, name) for e in examples]
            lengths = np.array([-1 if v is None else len(v) for v in values], dtype=np.int64)
            flat = [x for v in values if v for x in v]
            arrays[f"{name}.values"] = np.asarray(flat, dtype=np.int32)
            arrays[f"{name}.lengths"] = lengths
        else:
            other[name] = [getattr(e, name) for e in examples]
    meta = {
        "format": FORMAT,
        "class": _name(kind) if kind else None,
        "path": ds.path,
        "stats": dataclasses.asdict(ds.stats),
        "fields": other,
        "arrays": sorted({k.rsplit(".", 1)[0] for k in arrays}),
    }
    try:
        text = json.dumps(meta)
    except (TypeError, ValueError):  # a field JSON cannot hold (a row's date, say): no entry
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder.parent))
    try:
        save_file(arrays, str(tmp / "tokens.safetensors"))
        (tmp / "meta.json").write_text(text)
        os.replace(tmp, folder)  # whole, or (another wrote it first) not at all
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def load(folder: Path, kinds: tuple[type, ...]) -> Dataset | None:
    """The entry at ``folder``, or None when there is none (or it is not one this code wrote).
    ``kinds``: the example classes the entry may hold."""
    from safetensors.numpy import load_file

    classes = {_name(k): k for k in kinds}
    try:
        meta = json.loads((folder / "meta.json").read_text())
        arrays = load_file(str(folder / "tokens.safetensors"))
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT or meta["class"] not in classes:
        return None
    kind = classes[meta["class"]]
    n = meta["stats"]["kept"]
    columns: dict[str, list] = dict(meta["fields"])
    spans = {}
    for name in meta["arrays"]:
        values, lengths = arrays[f"{name}.values"], arrays[f"{name}.lengths"]
        ends = np.cumsum(np.maximum(lengths, 0))
        spans[name] = (values, ends - np.maximum(lengths, 0), lengths)
    if kind is Example and "ids" in spans and "mask" in spans:
        # kept as columns: an example is built when a batch reads it
        examples = ExampleTable(kind, columns, spans)
    else:
        examples = list(ExampleTable(kind, columns, spans))
    if len(examples) != n:
        return None
    return Dataset(examples, SplitStats(**{**meta["stats"], "cached": True}), meta["path"])


def cached(
    source: str,
    tokenizer,
    settings: dict,
    build: Callable[[], Dataset],
    kinds: tuple[type, ...],
    enabled: bool = True,
    world=None,
) -> Dataset:
    """The split ``build()`` encodes, from its entry when there is one, else built and stored.
    With several ranks (``world``), rank 0 builds and stores it while the others wait, then
    read it (ranks that cannot see rank 0's disk build their own)."""
    key = entry_key(source, tokenizer, settings) if enabled else None
    if key is None:
        return build()
    folder = cache_root() / key
    main = world is None or world.main
    if main:
        ds = load(folder, kinds)
        if ds is None:
            ds = build()
            if len(ds.examples):
                save(folder, ds)
    if world is not None and world.size > 1:
        world.barrier()  # rank 0 has stored it (a rank 0 that failed ends the run)
    if not main:
        ds = load(folder, kinds)
        if ds is None:  # not on this rank's disk
            ds = build()
    return ds


def reads_images(encoder, depth: int = 3) -> bool:
    """Whether an encoder (or one it holds: a pair encoder's, a row reader's) reads images."""
    if getattr(encoder, "images", None) is not None:
        return True
    inner = getattr(encoder, "encoder", None)
    return depth > 0 and inner is not None and reads_images(inner, depth - 1)


def cached_split(
    path, data, tokenizer, encoder, build: Callable[[], Dataset], kinds: tuple[type, ...], **more
) -> Dataset:
    """``cached`` for one split of a recipe's data section (``data``): the key holds the
    encoder's settings, the section's reading settings and ``more`` (lengths)."""
    settings = {
        "encoder": settings_of(encoder),
        "format": data.format,
        "overlong": data.overlong,
        "min_length": data.min_length,
        "columns": data.columns,
        "bad_rows": [data.bad_rows, data.max_bad_fraction],
        **more,
    }
    # a vision model's examples hang on its image files too (their sizes set the tokens):
    # encoded afresh each run, never cached
    enabled = data.cache and only_built_in_formats() and not reads_images(encoder)
    return cached(str(path), tokenizer, settings, build, kinds, enabled, distributed.current())


__all__ = [
    "cache_root",
    "cached",
    "cached_split",
    "content_hash",
    "entry_key",
    "settings_of",
    "tokenizer_hash",
]
