"""Batching: examples -> right-padded, length-bucketed batches in a seeded, resumable order."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .encode import Dataset, Example, lengths_of


@dataclass
class Batch:
    """Examples as [B, L] arrays, right-padded; packed rows carry segment ids."""

    tokens: np.ndarray
    """[B, L] int32 token ids, right-padded."""
    mask: np.ndarray
    """[B, L] 1 where the token is a loss target."""
    n_targets: int
    lengths: tuple[int, ...]
    """Each row's length before padding (a packed row: its tokens, all segments together)."""
    segments: np.ndarray | None = None
    """[B, L] packed rows: 1, 2, ... for each example in the row, 0 for padding."""
    images: tuple[tuple[str, ...], ...] | None = field(default=None, kw_only=True)
    """Each row's image files, in the order of their tokens (a vision model's batch), or None
    when no row has any."""

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def examples(self) -> int:
        """Examples in the batch: one a row, or a packed row's segments (numbered 1..k)."""
        return len(self.tokens) if self.segments is None else int(self.segments.max(axis=1).sum())


def split_batch(b: Batch, parts: int) -> list[Batch]:
    """``b`` as up to ``parts`` micro-batches of consecutive rows (same padding width): their
    summed, token-weighted gradients are the batch's."""
    rows = len(b.tokens)
    if parts <= 1 or rows <= 1:
        return [b]
    size = math.ceil(rows / parts)
    out = []
    for s in range(0, rows, size):
        seg = None if b.segments is None else b.segments[s : s + size]
        out.append(
            Batch(
                b.tokens[s : s + size],
                b.mask[s : s + size],
                int(b.mask[s : s + size, 1:].sum()),
                b.lengths[s : s + size],
                seg,
                images=None if b.images is None else b.images[s : s + size],
            )
        )
    return out


def read_positions(longest: int, multiple: int) -> int:
    """Positions the model reads in a batch whose longest example has ``longest`` tokens: L-1,
    rounded up to a multiple so that few shapes are compiled."""
    return -(-(longest - 1) // multiple) * multiple


def make_batch(examples: list[Example], pad_id: int, multiple: int) -> Batch:
    """One example a row, right-padded with ``pad_id`` to ``read_positions`` + 1 tokens."""
    length = read_positions(max(len(e.ids) for e in examples), multiple) + 1
    tokens = np.full((len(examples), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(examples), length), dtype=np.int32)
    for i, e in enumerate(examples):
        tokens[i, : len(e.ids)] = e.ids
        mask[i, : len(e.mask)] = e.mask
    images = None
    if any(getattr(e, "images", None) for e in examples):
        images = tuple(tuple(e.images or ()) for e in examples)
    return Batch(
        tokens, mask, int(mask[:, 1:].sum()), tuple(len(e.ids) for e in examples), images=images
    )


def batch_order(
    lengths: list[int],
    batch_size: int,
    epoch: int,
    seed: int,
    bucket_size: int,
    key: list[int] | None = None,
) -> list[list[int]]:
    """Batches of example indices for one epoch: shuffled from (seed, epoch), sorted by length
    within buckets of bucket_size batches so padding stays small, batch order shuffled again.
    A last partial batch is kept. ``key``: the draws come from it instead (a streamed window's
    seed, epoch and number)."""
    rng = np.random.default_rng(key if key is not None else [seed, epoch])
    order = rng.permutation(len(lengths))
    batches = []
    span = batch_size * bucket_size
    for start in range(0, len(order), span):
        chunk = order[start : start + span]
        if bucket_size > 1:
            chunk = sorted(chunk, key=lambda i: lengths[i])
        batches += [list(chunk[i : i + batch_size]) for i in range(0, len(chunk), batch_size)]
    perm = rng.permutation(len(batches))
    return [batches[i] for i in perm]


def iterate_batches(
    ds: Dataset,
    batch_size: int,
    pad_id: int,
    multiple: int,
    seed: int,
    bucket_size: int,
    start_epoch: int = 0,
    skip: int = 0,
):
    """Endless (epoch, batch) stream over the training set, from batch ``skip`` of epoch
    ``start_epoch`` (each epoch's order depends only on the seed and the epoch: a resumed run
    sees the batches an uninterrupted one would)."""
    lengths = lengths_of(ds.examples)
    epoch = start_epoch
    while True:
        order = batch_order(lengths, batch_size, epoch, seed, bucket_size)
        for idx in order[skip if epoch == start_epoch else 0 :]:
            yield epoch, make_batch([ds.examples[i] for i in idx], pad_id, multiple)
        epoch += 1


def eval_order(lengths: list[int], batch_size: int, max_batches: int | None = None) -> list[list]:
    """The fixed, length-sorted batches (example indices) evaluation runs over: the whole split,
    or a fixed random subset of ``max_batches`` batches (not the shortest examples)."""
    order = range(len(lengths))
    if max_batches and max_batches * batch_size < len(lengths):
        order = np.random.default_rng(0).choice(
            len(lengths), max_batches * batch_size, replace=False
        )
    order = sorted(order, key=lambda i: lengths[i])
    out = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    return out[:max_batches] if max_batches else out


def eval_batches(
    ds: Dataset, batch_size: int, pad_id: int, multiple: int, max_batches: int | None = None
):
    """Fixed, length-sorted batches over a whole split (deterministic)."""
    lengths = lengths_of(ds.examples)
    return [
        make_batch([ds.examples[i] for i in idx], pad_id, multiple)
        for idx in eval_order(lengths, batch_size, max_batches)
    ]
