"""Preference pairs: JSONL rows of a prompt with a chosen and a rejected completion -> two
token sequences per pair -> batches that keep each pair whole.

A pair becomes a ``PairExample``: ``ids``/``mask`` are the chosen sequence (prompt + chosen
completion, the completion's tokens the targets), which is what samples, exact match and the
split statistics read; ``rejected_ids``/``rejected_mask`` the rejected one. Only completion
tokens are targets: the prompt and the padding never enter a log-prob.

A ``PairBatch`` holds P pairs as rows [chosen_0, rejected_0, chosen_1, rejected_1, ...], or
(packing) several whole pairs to a row, each sequence a segment of its own. ``seq`` says which
sequence each token belongs to, so the objective sums log-probs per sequence the same way for
both layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserInputError
from .batching import Batch, batch_order, eval_order, read_positions
from .encode import Dataset, Encoder, Example, SplitStats, finished_split
from .formats import Chat, Pair, PromptAnswer, detect_format, get_format
from .packing import packed_epoch
from .parallel import encoded, workers_for
from .rows import BadRows

NO_SEQUENCE = -1

# packed batches round their pair slots up to a multiple of this, so that few shapes compile
PAIR_QUANTUM = 4


@dataclass
class PairExample(Example):
    """A preference pair. ``ids``/``mask``/``answer``: the chosen sequence and completion;
    ``rejected_ids``/``rejected_mask``: the rejected sequence; ``index``: the pair's place in
    its split (the row of its precomputed reference log-probs)."""

    rejected_ids: list[int] = field(default_factory=list)
    rejected_mask: list[int] = field(default_factory=list)
    index: int = 0

    @property
    def rejected_targets(self) -> int:
        return int(sum(self.rejected_mask[1:]))

    @property
    def longest(self) -> int:
        return max(len(self.ids), len(self.rejected_ids))

    @property
    def size(self) -> int:
        """Both sequences' tokens (the room a pair takes in a packed row)."""
        return len(self.ids) + len(self.rejected_ids)


class PairEncoder:
    """Turns one preference row into a ``PairExample``: each completion after its prompt, the
    completion's tokens (and EOS for text, by the data's EOS rules) the targets."""

    def __init__(
        self,
        tokenizer,
        add_eos: bool = True,
        train_on_eos: bool = True,
        template_kwargs: dict | None = None,
        train_on_reasoning: bool = True,
        images=None,
    ):
        self.encoder = Encoder(
            tokenizer, True, add_eos, train_on_eos, template_kwargs, train_on_reasoning, images
        )

    def _sequence(self, prompt, completion, key: str, where: str, tools=None, images=()) -> Example:
        if isinstance(completion, str):
            if not completion.strip():
                raise UserInputError(f"the {key!r} completion is empty", where)
            return self.encoder.encode_piece(PromptAnswer(prompt, completion), where)
        if not any(
            isinstance(m, dict)
            and m.get("role") == "assistant"
            and str(m.get("content") or "").strip()
            for m in completion
        ):
            raise UserInputError(
                f"the {key!r} completion has no non-empty assistant message", where
            )
        return self.encoder.encode_piece(
            Chat(list(prompt) + list(completion), len(prompt), tools, images), where
        )

    def encode(self, pair: Pair, where: str, kind: type = PairExample, **extra) -> PairExample:
        """The pair's two sequences as a ``kind`` (``PairExample`` or a subclass of it, given
        its own fields in ``extra``)."""
        c = self._sequence(pair.prompt, pair.chosen, "chosen", where, pair.tools, pair.images)
        r = self._sequence(pair.prompt, pair.rejected, "rejected", where, pair.tools, pair.images)
        for key, ex in (("chosen", c), ("rejected", r)):
            if ex.n_targets == 0:
                raise UserInputError(f"the {key!r} completion has no tokens to score", where)
        return kind(
            c.ids,
            c.mask,
            prompt=c.prompt,
            answer=c.answer,
            prompt_ids=c.prompt_ids,
            display=c.display,
            images=c.images,
            rejected_ids=r.ids,
            rejected_mask=r.mask,
            **extra,
        )


def prompt_length(mask: list[int]) -> int:
    """Tokens before the first target."""
    return next((i for i, m in enumerate(mask) if m), len(mask))


@dataclass
class PairRows:
    """Encodes one preference row to its ``PairExample``, here or in an encoding process
    (``parallel.encoded`` hands it to each)."""

    encoder: PairEncoder

    def encode(self, obj: dict, fmt: str, where: str) -> PairExample:
        piece = get_format(fmt).pieces(obj, where)
        if not isinstance(piece, Pair):
            raise UserInputError(
                f'preference objectives train on pairs ({{"prompt", "chosen", "rejected"}}); '
                f"this row is {fmt!r} data",
                where,
            )
        return self.encoder.encode(piece, where)


def fit_to_length(ex: PairExample, max_length: int, drop: bool, where: str, stats) -> bool:
    """A pair whose longer sequence is over ``max_length``: False when ``drop`` (counted), else
    both cut at the end (their completions'); a prompt that leaves no room is an error."""
    if ex.longest <= max_length:
        return True
    prompt = max(prompt_length(ex.mask), prompt_length(ex.rejected_mask))
    if prompt >= max_length:
        raise UserInputError(
            f"the prompt alone is {prompt} tokens, and data.max_length ({max_length}) "
            "leaves no room for a completion",
            where,
        )
    if drop:
        stats.dropped_too_long += 1
        return False
    ex.ids, ex.mask = ex.ids[:max_length], ex.mask[:max_length]
    ex.rejected_ids = ex.rejected_ids[:max_length]
    ex.rejected_mask = ex.rejected_mask[:max_length]
    stats.truncated += 1
    return True


def keep(ex: PairExample, out: list, stats, long_enough: bool) -> None:
    """``ex`` numbered and kept in ``out`` with its tokens counted, unless too short."""
    if not long_enough:
        stats.dropped_too_short += 1
        return
    ex.index = len(out)
    out.append(ex)
    stats.tokens += ex.size
    stats.target_tokens += ex.n_targets + ex.rejected_targets


def load_pairs(
    path,
    encoder: PairEncoder,
    fmt: str,
    limits: tuple,
    columns: dict[str, str] | None = None,
    bad: BadRows | None = None,
    num_proc: int | str = 1,
) -> Dataset:
    """A JSONL file's preference pairs; ``limits`` is (max_length, overlong, min_length), as
    ``encode_rows`` takes them. A sequence longer than ``max_length`` has its completion cut at
    the end (``overlong: truncate``) or its pair dropped (``drop``); a prompt that leaves no room
    for a completion token is an error naming the line. ``num_proc`` processes encode it
    (``workers_for``)."""
    max_length, overlong, min_length = limits
    bad = bad or BadRows()
    rows = bad.read(path, columns)
    if fmt == "auto":
        fmt = detect_format(rows[0][1], f"{path}:{rows[0][0]}")
    stats = SplitStats(examples=len(rows))
    out: list[PairExample] = []
    workers = workers_for(len(rows), num_proc)
    for n, ex in encoded(PairRows(encoder), rows, fmt, path, workers):
        with bad.row():
            where = f"{path}:{n}"
            if isinstance(ex, UserInputError):
                raise ex
            if fit_to_length(ex, max_length, overlong == "drop", where, stats):
                keep(ex, out, stats, min(len(ex.ids), len(ex.rejected_ids)) >= min_length)
    return finished_split(out, stats, bad, path, "pair")


def renumbered(ds: Dataset) -> Dataset:
    """``ds`` with each pair's ``index`` its place in the split (after a split is held out)."""
    for i, e in enumerate(ds.examples):
        e.index = i
    return ds


# ------------------------------------------------------------------------------------ batches


@dataclass
class PairBatch(Batch):
    """Pairs as rows: ``seq`` [R, L] numbers each token's sequence (2 p for pair slot p's
    chosen, 2 p + 1 its rejected, ``NO_SEQUENCE`` for padding); ``pairs`` [S] each slot's
    pair index in ``split`` (-1: an empty slot, whose loss is 0); ``packed``: several pairs to
    a row."""

    seq: np.ndarray | None = None
    pairs: np.ndarray | None = None
    split: str = "train"
    packed: bool = False

    @property
    def n_pairs(self) -> int:
        return int((self.pairs >= 0).sum())

    @property
    def examples(self) -> int:
        return self.n_pairs


def make_pair_batch(
    pairs: list[PairExample], pad_id: int, multiple: int, split: str = "train"
) -> PairBatch:
    """One sequence a row, a pair's two in consecutive rows, right-padded to
    ``read_positions`` + 1 tokens."""
    length = read_positions(max(p.longest for p in pairs), multiple) + 1
    rows = 2 * len(pairs)
    tokens = np.full((rows, length), pad_id, dtype=np.int32)
    mask = np.zeros((rows, length), dtype=np.int32)
    seq = np.full((rows, length), NO_SEQUENCE, dtype=np.int32)
    lengths = []
    for i, p in enumerate(pairs):
        for j, (ids, m) in enumerate(((p.ids, p.mask), (p.rejected_ids, p.rejected_mask))):
            r = 2 * i + j
            tokens[r, : len(ids)] = ids
            mask[r, : len(m)] = m
            seq[r, : len(ids)] = r
            lengths.append(len(ids))
    index = np.array([p.index for p in pairs], dtype=np.int32)
    images = pair_images([[p] for p in pairs], rows_a_pair=2)
    return PairBatch(
        tokens, mask, int(mask[:, 1:].sum()), tuple(lengths), None, seq, index, split, False,
        images=images,
    )  # fmt: skip


def pair_images(rows: list[list[PairExample]], rows_a_pair: int = 1) -> tuple | None:
    """Each row's image files (a vision model's pairs): a row of pairs shows each pair's images
    for its chosen and again for its rejected sequence; with ``rows_a_pair`` 2 each pair is two
    rows (its chosen, its rejected), each showing the pair's images once. None without images."""
    if not any(getattr(p, "images", None) for r in rows for p in r):
        return None
    if rows_a_pair == 2:
        return tuple(tuple(r[0].images or ()) for r in rows for _ in range(2))
    return tuple(tuple(f for p in r for f in 2 * tuple(p.images or ())) for r in rows)


def make_packed_pair_batch(
    rows: list[list[PairExample]], pad_id: int, capacity: int, split: str = "train"
) -> PairBatch:
    """Rows of ``capacity`` tokens, each holding whole pairs (chosen then rejected, a segment
    each); the pair slots are rounded up to a multiple of ``PAIR_QUANTUM``."""
    n = sum(len(r) for r in rows)
    slots = -(-n // PAIR_QUANTUM) * PAIR_QUANTUM
    tokens = np.full((len(rows), capacity), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), capacity), dtype=np.int32)
    seg = np.zeros((len(rows), capacity), dtype=np.int32)
    seq = np.full((len(rows), capacity), NO_SEQUENCE, dtype=np.int32)
    index = np.full(slots, -1, dtype=np.int32)
    lengths = []
    slot = 0
    for r, pairs in enumerate(rows):
        at = k = 0
        for p in pairs:
            index[slot] = p.index
            for j, (ids, m) in enumerate(((p.ids, p.mask), (p.rejected_ids, p.rejected_mask))):
                k += 1
                tokens[r, at : at + len(ids)] = ids
                mask[r, at : at + len(m)] = m
                mask[r, at] = 0  # a sequence's first token is never a target
                seg[r, at : at + len(ids)] = k
                seq[r, at : at + len(ids)] = 2 * slot + j
                at += len(ids)
            slot += 1
        lengths.append(at)
    return PairBatch(
        tokens, mask, int(mask[:, 1:].sum()), tuple(lengths), seg, seq, index, split, True,
        images=pair_images(rows),
    )  # fmt: skip


def split_pair_batch(b: PairBatch, parts: int) -> list[PairBatch]:
    """``b`` as up to ``parts`` micro-batches of whole pairs (whole packed rows)."""
    units = len(b.tokens) if b.packed else len(b.tokens) // 2
    if parts <= 1 or units <= 1:
        return [b]
    size = math.ceil(units / parts)
    out = []
    for s in range(0, units, size):
        if b.packed:
            rows = slice(s, s + size)
            slots = np.unique(b.seq[rows][b.seq[rows] >= 0] // 2)
            pairs = b.pairs[slots]
            # the rows' sequences renumbered from slot 0
            remap = np.full(2 * len(b.pairs), NO_SEQUENCE, dtype=np.int32)
            for new, old in enumerate(slots):
                remap[2 * old], remap[2 * old + 1] = 2 * new, 2 * new + 1
            seq = np.where(b.seq[rows] >= 0, remap[np.maximum(b.seq[rows], 0)], NO_SEQUENCE)
            padded = -(-len(pairs) // PAIR_QUANTUM) * PAIR_QUANTUM
            pairs = np.concatenate([pairs, np.full(padded - len(pairs), -1, dtype=np.int32)])
            seg = b.segments[rows]
        else:
            rows = slice(2 * s, 2 * (s + size))
            pairs, seg = b.pairs[s : s + size], None
            seq = np.where(b.seq[rows] >= 0, b.seq[rows] - 2 * s, NO_SEQUENCE)
        out.append(
            PairBatch(
                b.tokens[rows],
                b.mask[rows],
                int(b.mask[rows, 1:].sum()),
                b.lengths[rows],
                seg,
                seq.astype(np.int32),
                pairs,
                b.split,
                b.packed,
                images=None if b.images is None else b.images[rows],
            )
        )
    return out


def empty_pair_batch(b: PairBatch) -> PairBatch:
    """A batch shaped like one pair of ``b`` that counts nothing (a data-parallel rank's share
    when a small batch leaves it none)."""
    rows = 1 if b.packed else 2
    slots = PAIR_QUANTUM if b.packed else 1
    return PairBatch(
        b.tokens[:rows],
        np.zeros_like(b.mask[:rows]),
        0,
        b.lengths[:rows],
        None if b.segments is None else b.segments[:rows],
        np.full_like(b.seq[:rows], NO_SEQUENCE),
        np.full(slots, -1, dtype=np.int32),
        b.split,
        b.packed,
    )


def pair_batch_order(ds: Dataset, batch_size: int, epoch: int, seed: int, bucket_size: int):
    return batch_order([p.longest for p in ds.examples], batch_size, epoch, seed, bucket_size)


def packed_pair_epoch(ds: Dataset, capacity: int, seed: int, epoch: int):
    """One epoch's rows of whole pairs (best-fit, shuffled from the seed and epoch)."""
    return packed_epoch(ds, "pack", capacity, seed, epoch, [p.size for p in ds.examples])


def iterate_pairs(
    ds: Dataset,
    batch_size: int,
    pad_id: int,
    multiple: int,
    seed: int,
    bucket_size: int,
    packing: str = "off",
    capacity: int = 0,
    start_epoch: int = 0,
    skip: int = 0,
):
    """Endless (epoch, PairBatch) stream over the training pairs, resumable like
    ``iterate_batches`` (``batch_size`` pairs a batch, or rows when packing)."""
    epoch = start_epoch
    while True:
        if packing == "off":
            order = pair_batch_order(ds, batch_size, epoch, seed, bucket_size)
            batches = [[ds.examples[i] for i in idx] for idx in order]
        else:
            rows = packed_pair_epoch(ds, capacity, seed, epoch)
            batches = [rows[s : s + batch_size] for s in range(0, len(rows), batch_size)]
        for b in batches[skip if epoch == start_epoch else 0 :]:
            if packing == "off":
                yield epoch, make_pair_batch(b, pad_id, multiple)
            else:
                yield epoch, make_packed_pair_batch(b, pad_id, capacity)
        epoch += 1


def pair_batches(
    ds: Dataset,
    batch_size: int,
    pad_id: int,
    multiple: int,
    max_batches: int | None = None,
    split: str = "valid",
) -> list[PairBatch]:
    """Fixed, length-sorted batches over a whole split of pairs (deterministic)."""
    lengths = [p.longest for p in ds.examples]
    return [
        make_pair_batch([ds.examples[i] for i in idx], pad_id, multiple, split)
        for idx in eval_order(lengths, batch_size, max_batches)
    ]
