"""Packing: several examples to a row, with segment ids that keep them apart in attention.

``pack`` fits whole examples into rows (best-fit decreasing); ``stream`` cuts one token stream
into rows, a document running on into the next row.
"""

from __future__ import annotations

import bisect

import numpy as np

from .batching import Batch
from .encode import Dataset, Example, lengths_of


def pack_rows(lengths: list[int], capacity: int, order: np.ndarray) -> list[list[int]]:
    """Best-fit decreasing: example indices grouped into rows of at most ``capacity`` tokens.
    ``order`` (a permutation) breaks ties between equal lengths, so each epoch packs anew."""
    items = sorted(order.tolist(), key=lambda i: -lengths[i])  # stable: ties keep ``order``
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row) sorted
    for i in items:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
            rows[r].append(i)
            if room - n > 0:
                bisect.insort(free, (room - n, r))
        else:
            rows.append([i])
            if capacity - n > 0:
                bisect.insort(free, (capacity - n, len(rows) - 1))
    return rows


def make_packed_batch(
    rows: list[list[Example]], pad_id: int, capacity: int, mask_boundary: bool = True
) -> Batch:
    """Rows of several examples each, ``capacity`` tokens long, with segment ids. A segment's
    first token is a target only without ``mask_boundary`` (and never at a row's start)."""
    tokens = np.full((len(rows), capacity), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), capacity), dtype=np.int32)
    seg = np.zeros((len(rows), capacity), dtype=np.int32)
    lengths = []
    for r, exs in enumerate(rows):
        at = 0
        for k, e in enumerate(exs, 1):
            n = len(e.ids)
            tokens[r, at : at + n] = e.ids
            mask[r, at : at + n] = e.mask
            # a segment's first token, predicted from the one before it (another document)
            mask[r, at] = 0 if mask_boundary or at == 0 else 1
            seg[r, at : at + n] = k
            at += n
        lengths.append(at)
    images = None  # a vision model's: each row's images, its examples' in order
    if any(getattr(e, "images", None) for exs in rows for e in exs):
        images = tuple(tuple(p for e in exs for p in (e.images or ())) for exs in rows)
    return Batch(tokens, mask, int(mask[:, 1:].sum()), tuple(lengths), seg, images=images)


def stream_rows(examples: list[Example], capacity: int, order: np.ndarray) -> list[list[Example]]:
    """The examples, in ``order``, as one token stream cut into rows of ``capacity`` tokens: a
    document runs on into the next row (its pieces are examples of their own)."""
    rows: list[list[Example]] = []
    row: list[Example] = []
    room = capacity
    for i in order.tolist():
        e = examples[i]
        ids, mask = e.ids, e.mask
        while ids:
            take = min(room, len(ids))
            row.append(Example(ids[:take], mask[:take]))
            ids, mask = ids[take:], mask[take:]
            room -= take
            if room == 0:
                rows.append(row)
                row, room = [], capacity
    if row:
        rows.append(row)
    return rows


def packed_epoch(
    ds: Dataset,
    mode: str,
    capacity: int,
    seed: int,
    epoch: int,
    sizes: list[int] | None = None,
    key: list[int] | None = None,
) -> list[list[Example]]:
    """One epoch's packed rows (shuffled from the seed and epoch, or from ``key``); ``sizes``:
    the room each example takes in a row (default its tokens)."""
    rng = np.random.default_rng(key if key is not None else [seed, epoch, 1])
    order = rng.permutation(len(ds.examples))
    if mode == "stream":
        rows = stream_rows(ds.examples, capacity, order)
    else:
        lengths = sizes if sizes is not None else lengths_of(ds.examples)
        rows = [[ds.examples[i] for i in r] for r in pack_rows(lengths, capacity, order)]
    return [rows[i] for i in rng.permutation(len(rows))]


def iterate_packed(
    ds: Dataset,
    batch_size: int,
    pad_id: int,
    mode: str,
    capacity: int,
    seed: int,
    mask_boundary: bool = True,
    start_epoch: int = 0,
    skip: int = 0,
):
    """Endless (epoch, batch) stream of packed rows, resumable like ``iterate_batches``."""
    epoch = start_epoch
    while True:
        rows = packed_epoch(ds, mode, capacity, seed, epoch)
        starts = range(0, len(rows), batch_size)
        for s in list(starts)[skip if epoch == start_epoch else 0 :]:
            yield (
                epoch,
                make_packed_batch(rows[s : s + batch_size], pad_id, capacity, mask_boundary),
            )
        epoch += 1
