"""Data: JSONL -> formatted examples -> token ids with a loss mask -> length-bucketed batches.

An example becomes ``ids`` (every token the model reads) and ``mask`` (1 where that token is a
target the loss counts). The model reads ``ids[:-1]`` and predicts ``ids[1:]``, and target j
counts iff ``mask[j]``; padding is never a target, so it never enters the loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import UserInputError

FORMATS = ("text", "completion", "instruction", "chat", "tokens")

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Example:
    ids: list[int]
    mask: list[int]
    prompt: str | None = None
    """The prompt text, for generating answers (completion, instruction and chat data)."""
    answer: str | None = None
    """The reference answer, for the exact-match metric."""
    prompt_ids: list[int] | None = None
    """The prompt exactly as the model reads it in training, for generating answers."""

    @property
    def n_targets(self) -> int:
        return int(sum(self.mask[1:]))


@dataclass
class SplitStats:
    """What happened to one split's examples on the way to batches."""

    examples: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_too_short: int = 0
    dropped_no_targets: int = 0
    tokens: int = 0
    target_tokens: int = 0

    def line(self) -> str:
        parts = [
            f"{self.kept} examples",
            f"{self.tokens:,} tokens ({self.target_tokens:,} trained on)",
        ]
        for name in ("truncated", "dropped_too_long", "dropped_too_short", "dropped_no_targets"):
            n = getattr(self, name)
            if n:
                parts.append(f"{n} {name.replace('_', ' ')}")
        return ", ".join(parts)


@dataclass
class Dataset:
    examples: list[Example]
    stats: SplitStats = field(default_factory=SplitStats)
    path: str = ""

    def __len__(self):
        return len(self.examples)


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; any bad line is an error naming it."""
    if not path.exists():
        raise UserInputError("data file not found", str(path))
    rows = []
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserInputError(
                        f"not UTF-8 ({e.reason} at byte {e.start})", f"{path}:{n}"
                    ) from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserInputError(
                        f"not valid JSON ({e.msg} at column {e.colno})", f"{path}:{n}"
                    ) from None
                if not isinstance(obj, dict):
                    raise UserInputError(
                        f"each line must be a JSON object, got {type(obj).__name__}", f"{path}:{n}"
                    )
                rows.append((n, obj))
    except IsADirectoryError:
        raise UserInputError("expected a JSONL file, got a directory", str(path)) from None
    if not rows:
        raise UserInputError("the data file has no examples", str(path))
    return rows


def detect_format(obj: dict, where: str) -> str:
    keys = set(obj)
    if "messages" in keys:
        return "chat"
    if "input_ids" in keys or "tokens" in keys:
        return "tokens"
    if "instruction" in keys and "output" in keys:
        return "instruction"
    if "prompt" in keys and "completion" in keys:
        return "completion"
    if "text" in keys:
        return "text"
    raise UserInputError(
        f"cannot tell the format from keys {sorted(keys)}: expected text, prompt+completion, "
        "instruction+output, messages, or input_ids",
        where,
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Encoder:
    """Turns one JSON object into an Example, for one tokenizer and data config."""

    def __init__(
        self, tokenizer, mask_prompt: bool = True, add_eos: bool = True, train_on_eos: bool = True
    ):
        self.tok = tokenizer
        self.mask_prompt = mask_prompt
        self.add_eos = add_eos
        self.train_on_eos = train_on_eos
        self.eos = tokenizer.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def _field(self, obj, key, where, kind=str):
        if key not in obj:
            raise UserInputError(f"missing field {key!r}", where)
        v = obj[key]
        if not isinstance(v, kind):
            raise UserInputError(
                f"field {key!r} must be a {kind.__name__}, got {type(v).__name__}", where
            )
        return v

    def _targets(self, ids: list[int], start: int) -> list[int]:
        """Append EOS (add_eos) and return the mask: targets from ``start`` on, the EOS one only
        with train_on_eos."""
        eos = self.add_eos and self.eos is not None
        if eos:
            ids.append(self.eos)
        mask = [0] * start + [1] * (len(ids) - start)
        if eos and not self.train_on_eos:
            mask[-1] = 0
        return mask

    def _prompt_answer(self, prompt: str, answer: str) -> Example:
        p_ids = self._encode(prompt)
        ids = self._encode(prompt + answer)
        start = _common_prefix(p_ids, ids) if self.mask_prompt else 1
        mask = self._targets(ids, start)
        return Example(ids, mask, prompt=prompt, answer=answer, prompt_ids=ids[:start])

    def encode(self, obj: dict, fmt: str, where: str) -> Example:
        if fmt == "text":
            ids = self._encode(self._field(obj, "text", where))
            return Example(ids, self._targets(ids, 1))
        if fmt == "completion":
            return self._prompt_answer(
                self._field(obj, "prompt", where), self._field(obj, "completion", where)
            )
        if fmt == "instruction":
            inst = self._field(obj, "instruction", where)
            extra = obj.get("input") or ""
            if not isinstance(extra, str):
                raise UserInputError("field 'input' must be a string", where)
            prompt = (ALPACA_PROMPT_INPUT if extra else ALPACA_PROMPT).format(
                instruction=inst, input=extra
            )
            return self._prompt_answer(prompt, self._field(obj, "output", where))
        if fmt == "chat":
            return self._chat(obj, where)
        if fmt == "tokens":
            key = "input_ids" if "input_ids" in obj else "tokens"
            ids = self._field(obj, key, where, list)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise UserInputError(
                    f"field {key!r} must be a list of non-negative integers", where
                )
            vocab = (
                len(self.tok._tokenizer) if hasattr(self.tok, "_tokenizer") else self.tok.vocab_size
            )
            if any(i >= vocab for i in ids):
                raise UserInputError(
                    f"token id {max(ids)} is outside the vocabulary ({vocab})", where
                )
            mask = obj.get("mask") or obj.get("loss_mask")
            if mask is None:
                mask = [0] + [1] * (len(ids) - 1)
            elif (
                not isinstance(mask, list)
                or len(mask) != len(ids)
                or not all(m in (0, 1) for m in mask)
            ):
                raise UserInputError("'mask' must be 0/1 values, one per token", where)
            return Example(list(ids), [int(m) for m in mask])
        raise ValueError(fmt)

    def _chat(self, obj, where) -> Example:
        msgs = self._field(obj, "messages", where, list)
        for m in msgs:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise UserInputError("each message needs a string 'role' and 'content'", where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserInputError("the conversation has no assistant turn to train on", where)
        tmpl = self.tok._tokenizer if hasattr(self.tok, "_tokenizer") else self.tok
        if not getattr(tmpl, "chat_template", None):
            raise UserInputError(
                "chat data needs a tokenizer with a chat template (set tokenizer.chat_template)",
                where,
            )

        def render(messages, gen=False, tokenize=True):
            if not messages:
                return [] if tokenize else ""
            try:
                out = tmpl.apply_chat_template(
                    messages, tokenize=tokenize, add_generation_prompt=gen, return_dict=False
                )
            except Exception as e:  # jinja raises for conversations a template refuses
                raise UserInputError(
                    f"the chat template refused this conversation: {e}", where
                ) from None
            return list(out) if tokenize else out

        ids = render(msgs)
        mask = [0] * len(ids) if self.mask_prompt else [0] + [1] * (len(ids) - 1)
        if self.mask_prompt:
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                start = _common_prefix(render(msgs[:i], gen=True), ids)
                end = _common_prefix(render(msgs[: i + 1]), ids)
                for j in range(max(start, 1), end):
                    mask[j] = 1
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        return Example(
            ids,
            mask,
            prompt=render(msgs[:last], gen=True, tokenize=False),
            answer=msgs[last]["content"],
            prompt_ids=render(msgs[:last], gen=True) or None,
        )


def load_split(
    path: Path, encoder: Encoder, fmt: str, max_length: int, overlong: str, min_length: int
) -> Dataset:
    rows = read_jsonl(path)
    if fmt == "auto":
        fmt = detect_format(rows[0][1], f"{path}:{rows[0][0]}")
    stats = SplitStats(examples=len(rows))
    out = []
    for n, obj in rows:
        ex = encoder.encode(obj, fmt, f"{path}:{n}")
        if len(ex.ids) > max_length:
            if overlong == "drop":
                stats.dropped_too_long += 1
                continue
            ex.ids, ex.mask = ex.ids[:max_length], ex.mask[:max_length]
            stats.truncated += 1
        if len(ex.ids) < min_length:
            stats.dropped_too_short += 1
            continue
        if ex.n_targets == 0:
            stats.dropped_no_targets += 1
            continue
        out.append(ex)
        stats.tokens += len(ex.ids)
        stats.target_tokens += ex.n_targets
    stats.kept = len(out)
    if not out:
        raise UserInputError(
            f"no example is left to train on ({stats.line()}; {stats.examples} read): check data.max_length, "
            "data.min_length and the prompt masking",
            str(path),
        )
    return Dataset(out, stats, str(path))


def split_off(ds: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Hold out a fraction of a dataset (at least one example) as a validation set."""
    n = len(ds.examples)
    if n < 2:
        raise UserInputError(
            "too few examples to hold out a validation set; give data.valid", ds.path
        )
    k = min(max(1, int(round(n * fraction))), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    valid = [ds.examples[i] for i in sorted(order[:k])]
    train = [ds.examples[i] for i in sorted(order[k:])]
    # The training split keeps what happened to the whole file (truncated, dropped).
    file_counts = {
        f: getattr(ds.stats, f)
        for f in ("truncated", "dropped_too_long", "dropped_too_short", "dropped_no_targets")
    }
    train_stats = dataclasses.replace(_stats_of(train), **file_counts)
    return Dataset(train, train_stats, ds.path), Dataset(
        valid, _stats_of(valid), ds.path + " (held out)"
    )


def _stats_of(examples: list[Example]) -> SplitStats:
    s = SplitStats(examples=len(examples), kept=len(examples))
    s.tokens = sum(len(e.ids) for e in examples)
    s.target_tokens = sum(e.n_targets for e in examples)
    return s


@dataclass
class Batch:
    tokens: np.ndarray
    """[B, L] int32 token ids, right-padded."""
    mask: np.ndarray
    """[B, L] 1 where the token is a loss target."""
    n_targets: int
    lengths: tuple[int, ...]
    """Each row's length before padding (a packed row: its tokens, all segments together)."""
    segments: np.ndarray | None = None
    """[B, L] packed rows: 1, 2, ... for each example in the row, 0 for padding."""

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
            )
        )
    return out


def read_positions(longest: int, multiple: int) -> int:
    """Positions the model reads in a batch whose longest example has ``longest`` tokens: L-1,
    rounded up to a multiple so that few shapes are compiled."""
    return -(-(longest - 1) // multiple) * multiple


def make_batch(examples: list[Example], pad_id: int, multiple: int) -> Batch:
    length = read_positions(max(len(e.ids) for e in examples), multiple) + 1
    tokens = np.full((len(examples), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(examples), length), dtype=np.int32)
    for i, e in enumerate(examples):
        tokens[i, : len(e.ids)] = e.ids
        mask[i, : len(e.mask)] = e.mask
    return Batch(tokens, mask, int(mask[:, 1:].sum()), tuple(len(e.ids) for e in examples))


def batch_order(
    lengths: list[int], batch_size: int, epoch: int, seed: int, bucket_size: int
) -> list[list[int]]:
    """Batches of example indices for one epoch: shuffled from (seed, epoch), sorted by length
    within buckets of bucket_size batches so padding stays small, batch order shuffled again.
    A last partial batch is kept."""
    rng = np.random.default_rng([seed, epoch])
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
    lengths = [len(e.ids) for e in ds.examples]
    epoch = start_epoch
    while True:
        order = batch_order(lengths, batch_size, epoch, seed, bucket_size)
        for idx in order[skip if epoch == start_epoch else 0 :]:
            yield epoch, make_batch([ds.examples[i] for i in idx], pad_id, multiple)
        epoch += 1


def eval_batches(
    ds: Dataset, batch_size: int, pad_id: int, multiple: int, max_batches: int | None = None
):
    """Fixed, length-sorted batches over a whole split (deterministic)."""
    order = range(len(ds.examples))
    if max_batches and max_batches * batch_size < len(ds.examples):
        # A fixed random subset (not the shortest examples), sorted to keep padding small.
        order = np.random.default_rng(0).choice(
            len(ds.examples), max_batches * batch_size, replace=False
        )
    order = sorted(order, key=lambda i: len(ds.examples[i].ids))
    out = []
    for s in range(0, len(order), batch_size):
        out.append(
            make_batch([ds.examples[i] for i in order[s : s + batch_size]], pad_id, multiple)
        )
        if max_batches and len(out) >= max_batches:
            break
    return out


# ------------------------------------------------------------------------------------- packing


def pack_rows(lengths: list[int], capacity: int, order: np.ndarray) -> list[list[int]]:
    """Best-fit decreasing: example indices grouped into rows of at most ``capacity`` tokens.
    ``order`` (a permutation) breaks ties between equal lengths, so each epoch packs anew."""
    import bisect

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
    return Batch(tokens, mask, int(mask[:, 1:].sum()), tuple(lengths), seg)


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
    ds: Dataset, mode: str, capacity: int, seed: int, epoch: int
) -> list[list[Example]]:
    """One epoch's packed rows (shuffled from the seed and epoch)."""
    rng = np.random.default_rng([seed, epoch, 1])
    order = rng.permutation(len(ds.examples))
    if mode == "stream":
        rows = stream_rows(ds.examples, capacity, order)
    else:
        lengths = [len(e.ids) for e in ds.examples]
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
