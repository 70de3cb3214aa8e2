"""Encoding: JSONL rows -> token ids with a loss mask, and the splits made of them.

A row's format (``formats``) turns it into pieces; the encoder tokenizes them and marks the
targets. An example becomes ``ids`` (every token the model reads) and ``mask`` (1 where that token is a
target the loss counts). The model reads ``ids[:-1]`` and predicts ``ids[1:]``, and target j
counts iff ``mask[j]``; padding is never a target, so it never enters the loss.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserInputError
from .chat import REASONING_KEYS, Rendering, common_prefix, marked_assistant_mask, with_reasoning
from .formats import (
    Chat,
    Labeled,
    Pair,
    PromptAnswer,
    Text,
    Tokens,
    check_messages,
    detect_format,
    get_format,
)
from .images import content_text, with_images
from .parallel import encoded, workers_for
from .rows import BadRows


@dataclass
class Example:
    """One example: the tokens the model reads and which of them the loss counts."""

    ids: list[int]
    mask: list[int]
    prompt: str | None = None
    """The whole prompt text the model reads (completion, instruction and chat data): for chat
    data the chat template's rendering, system prompt and role markers included."""
    answer: str | None = None
    """The reference answer, for the exact-match metric."""
    prompt_ids: list[int] | None = None
    """The prompt exactly as the model reads it in training, for generating answers."""
    display: str | None = None
    """The prompt as samples and exact-match rows show it: the last user message for chat
    data, the prompt for completion data, the instruction (and its input) for instruction
    data. Only for showing: generation reads ``prompt_ids``."""
    images: tuple[str, ...] | None = None
    """The image files the example shows (a vision chat), in token order; None for text."""

    @property
    def shown_prompt(self) -> str:
        """``display``, or the whole ``prompt`` when there is none."""
        return self.display if self.display is not None else (self.prompt or "")

    @property
    def n_targets(self) -> int:
        return int(sum(self.mask[1:]))


class ExampleTable(Sequence):
    """Examples kept as columns: each integer-list field (``ids``, ``mask``, ``prompt_ids``) as
    one flat int32 array with each example's start and length, the other fields as lists. An
    example is built when it is read (``table[i]``: a new object each time, its lists made from
    its slices), so a large data set read from the cache neither waits for every example to be
    built nor holds a Python int per token. ``lengths()`` and ``target_counts()`` give what
    batching and the stats need without building any."""

    def __init__(
        self,
        kind: type,
        columns: dict[str, list],
        arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        index: np.ndarray | None = None,
        _shared: dict | None = None,
    ):
        self.kind, self.columns, self.arrays = kind, columns, arrays
        """``arrays``: field -> (values, starts, lengths; -1 for None)."""
        self._shared = {} if _shared is None else _shared  # per-column figures, worked out once
        n = len(next(iter(arrays.values()))[1]) if arrays else len(next(iter(columns.values()), []))
        self.index = np.arange(n) if index is None else np.asarray(index, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(self.index[i], absolute=True)
        j = int(self.index[i])
        fields = {name: col[j] for name, col in self.columns.items()}
        for name, (values, starts, lengths) in self.arrays.items():
            n, a = int(lengths[j]), int(starts[j])
            fields[name] = None if n < 0 else values[a : a + n].tolist()
        return self.kind(**fields)

    def take(self, positions, absolute: bool = False) -> ExampleTable:
        """The examples at ``positions`` (of this table; ``absolute``: of the columns), as a
        table sharing these columns."""
        idx = np.asarray(positions, dtype=np.int64)
        index = idx if absolute else self.index[idx]
        return ExampleTable(self.kind, self.columns, self.arrays, index, self._shared)

    def flat(self) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, list]]:
        """The examples in order as ({field: (values, lengths)}, {field: list}): what an entry
        of the data cache stores."""
        whole = np.array_equal(self.index, np.arange(len(self.index)))
        ints = {}
        for name, (values, starts, lengths) in self.arrays.items():
            if whole:
                n = np.maximum(lengths, 0)
                ints[name] = (values[: int(n.sum())], lengths)
                continue
            ls, st = lengths[self.index], starts[self.index]
            parts = [
                values[a : a + n]
                for a, n in zip(st.tolist(), np.maximum(ls, 0).tolist(), strict=True)
            ]
            ints[name] = (np.concatenate(parts) if parts else values[:0], ls)
        other = {
            k: col if whole else [col[j] for j in self.index.tolist()]
            for k, col in self.columns.items()
        }
        return ints, other

    def lengths(self) -> np.ndarray:
        """Each example's tokens (``len(ids)``)."""
        return self.arrays["ids"][2][self.index]

    def target_counts(self) -> np.ndarray:
        """Each example's targets (``n_targets``: its mask after the first token)."""
        if "targets" not in self._shared:
            values, starts, lengths = self.arrays["mask"]
            sums = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
            n = np.maximum(lengths, 0)
            first = np.where(n > 0, values[np.minimum(starts, max(len(values) - 1, 0))], 0)
            self._shared["targets"] = sums[starts + n] - sums[starts] - first
        return self._shared["targets"][self.index]


class TableBuilder:
    """An ``ExampleTable`` built one example at a time: each integer-list field appended to one
    compact int32 buffer, so that a large split never holds a Python int per token."""

    INTS = ("ids", "mask", "prompt_ids")

    def __init__(self):
        self.values = {k: array("i") for k in self.INTS}
        self.lengths = {k: array("q") for k in self.INTS}
        self.other: dict[str, list] = {
            f.name: [] for f in dataclasses.fields(Example) if f.name not in self.INTS
        }

    def add(self, e: Example) -> None:
        for k in self.INTS:
            v = getattr(e, k)
            self.lengths[k].append(-1 if v is None else len(v))
            if v:
                self.values[k].extend(v)
        for k, col in self.other.items():
            col.append(getattr(e, k))

    def __len__(self) -> int:
        return len(self.lengths["ids"])

    def table(self) -> ExampleTable:
        spans = {}
        for k in self.INTS:
            values = (
                np.frombuffer(self.values[k], dtype=np.int32)
                if self.values[k]
                else np.zeros(0, np.int32)
            )
            lengths = (
                np.frombuffer(self.lengths[k], dtype=np.int64)
                if self.lengths[k]
                else np.zeros(0, np.int64)
            )
            n = np.maximum(lengths, 0)
            spans[k] = (values, np.cumsum(n) - n, lengths)
        return ExampleTable(Example, self.other, spans)


def lengths_of(examples) -> list[int]:
    """``len(e.ids)`` of each example (an ``ExampleTable``'s without building them)."""
    if isinstance(examples, ExampleTable):
        return examples.lengths().tolist()
    return [len(e.ids) for e in examples]


def picked(examples, positions) -> Sequence:
    """The examples at ``positions``, in that order (an ``ExampleTable``'s as a table)."""
    if isinstance(examples, ExampleTable):
        return examples.take(positions)
    return [examples[i] for i in positions]


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
    noun: str = "examples"
    """What the split counts: examples, or pairs (preference data)."""
    skipped: int = 0
    """Bad rows skipped (data.bad_rows: skip)."""
    skipped_rows: list[str] = field(default_factory=list)
    """Log lines naming them (``BadRows.report``)."""
    cached: bool = False
    """Read from the data cache (encoded by an earlier run) rather than encoded now."""
    window: int = 0
    """Streamed (data.streaming): the rows of a window, and these counts are the first
    window's."""

    def line(self) -> str:
        parts = [
            f"{self.kept} {self.noun}",
            f"{self.tokens:,} tokens ({self.target_tokens:,} trained on)",
        ]
        names = ("truncated", "dropped_too_long", "dropped_too_short", "dropped_no_targets")
        for name in (*names, "skipped"):
            n = getattr(self, name)
            if n:
                parts.append(
                    f"{n} {name.replace('_', ' ')}" + (" (bad)" if name == "skipped" else "")
                )
        if self.window:
            parts.append(f"streamed {self.window:,} rows a window, counted in the first")
        return ", ".join(parts) + ("; encoded before, read from the cache" if self.cached else "")


@dataclass
class Dataset:
    """A split's examples, what happened on the way (``stats``) and the file they came from."""

    examples: Sequence[Example]
    """A list, or an ``ExampleTable`` (read from the cache)."""
    stats: SplitStats = field(default_factory=SplitStats)
    path: str = ""

    def __len__(self):
        return len(self.examples)


class Encoder:
    """Turns one JSON object into an Example, for one tokenizer and data config: the object's
    format gives its pieces, and each kind of piece is tokenized and masked here."""

    def __init__(
        self,
        tokenizer,
        mask_prompt: bool = True,
        add_eos: bool = True,
        train_on_eos: bool = True,
        template_kwargs: dict | None = None,
        train_on_reasoning: bool = True,
        images=None,
    ):
        self.tok = tokenizer
        self.images = images  # a vision model's ImageTokens; None: a text model (no images)
        # arguments the chat template reads (data.chat_template_kwargs: enable_thinking, ...)
        self.template_kwargs = dict(template_kwargs or {})
        # false: an assistant turn's reasoning (reasoning_content / thinking) is context only
        self.train_on_reasoning = train_on_reasoning
        self.mask_prompt = mask_prompt
        self.add_eos = add_eos
        self.train_on_eos = train_on_eos
        self.eos = tokenizer.eos_token_id
        self._by_piece = {
            Text: self._text,
            PromptAnswer: self._prompt_answer,
            Chat: self._chat,
            Tokens: self._tokens,
        }

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

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

    def encode(self, obj: dict, fmt: str, where: str) -> Example:
        """The example for row ``obj`` of format ``fmt`` (a registered name); a bad row is a
        ``UserInputError`` at ``where``."""
        return self.encode_piece(get_format(fmt).pieces(obj, where), where)

    def encode_piece(self, piece, where: str) -> Example:
        """The example for one piece (``Text``, ``PromptAnswer``, ``Chat``, ``Tokens``, or a
        subclass of one)."""
        if isinstance(piece, Pair):
            raise UserInputError(
                "this is a preference pair (prompt, chosen, rejected): it trains with "
                "objective.type dpo, orpo, cpo or reward (or kto with objective.unpair: true)",
                where,
            )
        if isinstance(piece, Labeled):
            raise UserInputError(
                "this is unpaired feedback (prompt, completion, label): it trains with "
                "objective.type kto",
                where,
            )
        for kind in type(piece).__mro__:  # a subclass of a piece encodes as that piece
            if kind in self._by_piece:
                return self._by_piece[kind](piece, where)
        raise TypeError(
            f"a data format gave a {type(piece).__name__}; expected "
            "Text, PromptAnswer, Chat or Tokens"
        )

    def _text(self, piece: Text, where: str) -> Example:
        ids = self._encode(piece.text)
        return Example(ids, self._targets(ids, 1))

    def _prompt_answer(self, piece: PromptAnswer, where: str) -> Example:
        prompt, answer = piece.prompt, piece.answer
        p_ids = self._encode(prompt)
        ids = self._encode(prompt + answer)
        start = common_prefix(p_ids, ids) if self.mask_prompt else 1
        mask = self._targets(ids, start)
        display = prompt if piece.display is None else piece.display
        return Example(
            ids, mask, prompt=prompt, answer=answer, prompt_ids=ids[:start], display=display
        )

    def _tokens(self, piece: Tokens, where: str) -> Example:
        ids, mask = piece.ids, piece.mask
        vocab = len(self.tok._tokenizer) if hasattr(self.tok, "_tokenizer") else self.tok.vocab_size
        if any(i >= vocab for i in ids):
            raise UserInputError(f"token id {max(ids)} is outside the vocabulary ({vocab})", where)
        if mask is None:
            mask = [0] + [1] * (len(ids) - 1)
        elif (
            not isinstance(mask, list)
            or len(mask) != len(ids)
            or not all(m in (0, 1) for m in mask)
        ):
            raise UserInputError("'mask' must be 0/1 values, one per token", where)
        return Example(list(ids), [int(m) for m in mask])

    def _chat(self, piece: Chat, where: str) -> Example:
        msgs = piece.messages
        check_messages(msgs, where)
        msgs, reasoning = with_reasoning(msgs, where)
        if not any(m["role"] == "assistant" for m in msgs[piece.first_trained :]):
            raise UserInputError("the conversation has no assistant turn to train on", where)
        tmpl = self.tok._tokenizer if hasattr(self.tok, "_tokenizer") else self.tok
        if not getattr(tmpl, "chat_template", None):
            raise UserInputError(
                "chat data needs a tokenizer with a chat template, and this one has none (a "
                "base model's, often): write the rows as prompt/completion or text, or set "
                "tokenizer.chat_template (a Jinja template)",
                where,
            )

        extra = dict(self.template_kwargs)
        if piece.tools:
            extra["tools"] = piece.tools
        conv = Rendering(tmpl, msgs, extra, where)
        ids, shared, render = conv.ids, conv.shared, conv.render

        if piece.tools and ids == render(msgs, tools=None):
            raise UserInputError(
                "the row has tools, and the chat template does not show them to the model (it "
                "renders the conversation alike without them); use a template that renders tools",
                where,
            )
        plain = [{k: v for k, v in m.items() if k not in REASONING_KEYS} for m in msgs]
        if reasoning and ids == render(plain):
            raise UserInputError(
                "the row's assistant turns carry reasoning (reasoning_content or thinking), and "
                "the chat template does not show it (it renders the conversation alike without "
                "it); use a template that renders reasoning, or put it in the content",
                where,
            )
        mask = [0] * len(ids) if self.mask_prompt else [0] + [1] * (len(ids) - 1)
        marked = self.mask_prompt and marked_assistant_mask(tmpl, msgs, ids, extra)
        if marked:
            # the template marks what the assistant says ({% generation %}): those tokens, from
            # the first trained turn on
            first = shared(piece.first_trained, True)
            mask = [int(m and j >= max(first, 1)) for j, m in enumerate(marked)]
        elif self.mask_prompt:
            for i, m in enumerate(msgs):
                if m["role"] != "assistant" or i < piece.first_trained:
                    continue
                start, end = shared(i, True), shared(i + 1)
                for j in range(max(start, 1), end):
                    mask[j] = 1
        if not self.train_on_reasoning:
            for i in reasoning:
                # the turn up to its content: the template's opening and the reasoning
                start = shared(i, True)
                thought = common_prefix(render([*msgs[:i], {**msgs[i], "content": ""}]), ids)
                for j in range(start, thought):
                    mask[j] = 0
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        before = msgs[:last]
        # Shown as the prompt: what the user last said before the answer (no system prompt, no
        # template markers); a conversation with no user turn there shows its last message.
        users = [m for m in before if m["role"] == "user"]
        shown = content_text((users or before)[-1]["content"]) if before else None
        example = Example(
            ids,
            mask,
            prompt=conv.text(last, True) if before else "",
            answer=content_text(msgs[last]["content"]),
            prompt_ids=conv.tokens(last, True) or None,
            display=shown,
        )
        return with_images(example, piece, self.images, self.tok, where)


def fitted(ex: Example, max_length: int, overlong: str, min_length: int, stats) -> bool:
    """Whether ``ex`` stays in its split: longer than ``max_length`` it is cut to it
    (``overlong: truncate``) or dropped; shorter than ``min_length``, or left with no target, it
    is dropped. Each counted in ``stats``. An example with images is never cut (its image
    tokens must all stay with their image): too long, it is dropped."""
    if len(ex.ids) > max_length:
        if overlong == "drop" or getattr(ex, "images", None):
            stats.dropped_too_long += 1
            return False
        ex.ids, ex.mask = ex.ids[:max_length], ex.mask[:max_length]
        stats.truncated += 1
    if len(ex.ids) < min_length:
        stats.dropped_too_short += 1
        return False
    if ex.n_targets == 0:
        stats.dropped_no_targets += 1
        return False
    return True


def load_split(
    path: Path,
    encoder: Encoder,
    fmt: str,
    max_length: int,
    overlong: str,
    min_length: int,
    columns: dict[str, str] | None = None,
    bad: BadRows | None = None,
    num_proc: int | str = 1,
) -> Dataset:
    """A JSONL file's examples in format ``fmt`` ("auto": detected from the first row), too
    long ones truncated or dropped (``overlong``), too short and untrained ones dropped, each
    counted in the split's stats. No example left is an error naming the file. ``num_proc``
    processes encode it (``workers_for``)."""
    bad = bad or BadRows()
    rows = bad.read(path, columns)
    limits = (max_length, overlong, min_length)
    return encode_rows(rows, path, encoder, fmt, limits, bad, workers_for(len(rows), num_proc))


def encode_rows(
    rows: list,
    path,
    encoder: Encoder,
    fmt: str,
    limits: tuple,
    bad: BadRows,
    workers: int = 1,
    pool=None,
    allow_empty: bool = False,
) -> Dataset:
    """``load_split`` of rows read already: (row number, object) each, named ``path:number``;
    ``limits`` is (max_length, overlong, min_length). ``pool``: processes started already
    (``encoded``). ``allow_empty``: no example left is no error (a window of a stream)."""
    max_length, overlong, min_length = limits
    if fmt == "auto":
        fmt = detect_format(rows[0][1], f"{path}:{rows[0][0]}")
    stats = SplitStats(examples=len(rows))
    out = TableBuilder()
    for _, ex in encoded(encoder, rows, fmt, path, workers, pool):
        with bad.row():
            if isinstance(ex, UserInputError):
                raise ex
            if fitted(ex, max_length, overlong, min_length, stats):
                out.add(ex)
                stats.tokens += len(ex.ids)
                stats.target_tokens += ex.n_targets
    check = "data.max_length, data.min_length and the prompt masking"
    return finished_split(out.table(), stats, bad, path, "example", check, allow_empty)


def finished_split(
    examples,
    stats: SplitStats,
    bad: BadRows,
    path,
    noun: str = "example",
    check: str = "data.max_length and data.min_length",
    allow_empty: bool = False,
) -> Dataset:
    """A split once every row is read: the bad rows' verdict, the count kept, and the error
    naming ``check`` when no ``noun`` is left (unless ``allow_empty``)."""
    bad.finish(stats, path)
    stats.kept = len(examples)
    if not len(examples) and not allow_empty:
        raise UserInputError(
            f"no {noun} is left to train on ({stats.line()}; {stats.examples} read): check {check}",
            str(path),
        )
    return Dataset(examples, stats, str(path))


def split_off(ds: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Hold out a fraction of a dataset (at least one example) as a validation set."""
    train, valid, _ = split_sets(ds, fraction, None, seed)
    return train, valid


def held_out_count(n: int, size: float | int) -> int:
    """Examples that ``size`` holds out of ``n``: a fraction below 1 (rounded, at least one), or
    a count."""
    if isinstance(size, float) and size < 1:
        return max(1, min(int(round(n * size)), n - 1))
    return int(size)


def split_sets(
    ds: Dataset, valid_size: float | int | None, test_size: float | int | None, seed: int
) -> tuple[Dataset, Dataset | None, Dataset | None]:
    """(train, valid, test) carved out of one data set by one seeded permutation: the first
    ``valid_size`` examples of it validate, the next ``test_size`` test (each a fraction of the
    whole below 1, or a count; None holds none out), the rest train, each in file order. At least
    one example is left to train on."""
    n = len(ds.examples)
    sizes = [held_out_count(n, s) if s is not None else 0 for s in (valid_size, test_size)]
    names = " and ".join(w for w, s in zip(("validation", "test"), sizes, strict=True) if s)
    if sum(sizes) >= n:
        give = " and ".join(k for k, s in zip(("data.valid", "data.test"), sizes, strict=True) if s)
        raise UserInputError(
            f"{n} example{'s' if n != 1 else ''} cannot give {sum(sizes)} for {names} and "
            f"keep one to train on; give {give} or hold out fewer",
            ds.path,
        )
    order = np.random.default_rng(seed).permutation(n)
    cuts = [0, sizes[0], sizes[0] + sizes[1]]
    valid = picked(ds.examples, sorted(order[cuts[0] : cuts[1]]))
    test = picked(ds.examples, sorted(order[cuts[1] : cuts[2]]))
    train = picked(ds.examples, sorted(order[cuts[2] :]))
    # The training split keeps what happened to the whole file (truncated, dropped).
    file_counts = {
        f: getattr(ds.stats, f)
        for f in ("truncated", "dropped_too_long", "dropped_too_short", "dropped_no_targets")
    }
    train_stats = dataclasses.replace(_stats_of(train), **file_counts, cached=ds.stats.cached)

    def held(examples, what):
        stats = dataclasses.replace(_stats_of(examples), cached=ds.stats.cached)
        return Dataset(examples, stats, f"{ds.path} ({what})")

    return (
        Dataset(train, train_stats, ds.path),
        held(valid, "held out") if sizes[0] else None,
        held(test, "held out for test") if sizes[1] else None,
    )


def held_out(ds: Dataset, data, seed: int, valid_given: bool, test_given: bool):
    """What the data section holds out of the training set ``ds``: (train, valid or None,
    test or None) by data.valid_size (else valid_fraction) unless a valid file is given, and
    data.test_size unless a test file is given; data.split_seed, else ``seed``, draws them."""
    valid_size = None if valid_given else (data.valid_size or data.valid_fraction)
    test_size = None if test_given else data.test_size
    if valid_size is None and test_size is None:
        return ds, None, None
    seed = data.split_seed if data.split_seed is not None else seed
    return split_sets(ds, valid_size, test_size, seed)


def _stats_of(examples) -> SplitStats:
    s = SplitStats(examples=len(examples), kept=len(examples))
    if isinstance(examples, ExampleTable):
        s.tokens = int(examples.lengths().sum())
        s.target_tokens = int(examples.target_counts().sum())
    else:
        s.tokens = sum(len(e.ids) for e in examples)
        s.target_tokens = sum(e.n_targets for e in examples)
    return s
