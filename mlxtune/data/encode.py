"""Encoding: JSONL rows -> token ids with a loss mask, and the splits made of them.

A row's format (``formats``) turns it into pieces; the encoder tokenizes them and marks the
targets. An example becomes ``ids`` (every token the model reads) and ``mask`` (1 where that token is a
target the loss counts). The model reads ``ids[:-1]`` and predicts ``ids[1:]``, and target j
counts iff ``mask[j]``; padding is never a target, so it never enters the loss.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserInputError
from .formats import (
    Chat,
    Pair,
    PromptAnswer,
    Text,
    Tokens,
    check_messages,
    detect_format,
    get_format,
    only_built_in_formats,
)
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

    @property
    def shown_prompt(self) -> str:
        """``display``, or the whole ``prompt`` when there is none."""
        return self.display if self.display is not None else (self.prompt or "")

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
    noun: str = "examples"
    """What the split counts: examples, or pairs (preference data)."""
    skipped: int = 0
    """Bad rows skipped (data.bad_rows: skip)."""
    skipped_rows: list[str] = field(default_factory=list)
    """Log lines naming them (``BadRows.report``)."""
    cached: bool = False
    """Read from the data cache (encoded by an earlier run) rather than encoded now."""

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
        return ", ".join(parts) + ("; encoded before, read from the cache" if self.cached else "")


@dataclass
class Dataset:
    """A split's examples, what happened on the way (``stats``) and the file they came from."""

    examples: list[Example]
    stats: SplitStats = field(default_factory=SplitStats)
    path: str = ""

    def __len__(self):
        return len(self.examples)


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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
    ):
        self.tok = tokenizer
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
                "objective.type dpo, orpo, cpo or reward",
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
        start = _common_prefix(p_ids, ids) if self.mask_prompt else 1
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
                "chat data needs a tokenizer with a chat template (set tokenizer.chat_template)",
                where,
            )

        extra = dict(self.template_kwargs)
        if piece.tools:
            extra["tools"] = piece.tools

        def render(messages, gen=False, tokenize=True, **kwargs):
            if not messages:
                return [] if tokenize else ""
            try:
                out = tmpl.apply_chat_template(
                    messages,
                    tokenize=tokenize,
                    add_generation_prompt=gen,
                    return_dict=False,
                    **{**extra, **kwargs},
                )
            except Exception as e:  # jinja raises for conversations a template refuses
                raise UserInputError(
                    f"the chat template refused this conversation: {e}", where
                ) from None
            return list(out) if tokenize else out

        # the conversation's first n messages (with the generation prompt or not), rendered and
        # tokenized once each: as apply_chat_template tokenizes a rendering (no special tokens
        # added), where the tokenizer can be called so
        texts: dict[tuple[int, bool], str] = {}
        tokens: dict[tuple[int, bool], list[int]] = {}
        # a fast tokenizer's own (Rust) tokenizer: what apply_chat_template's tokenizing calls,
        # without the Python around it
        backend = getattr(tmpl, "backend_tokenizer", None)
        direct = backend is not None

        def text_of(n: int, gen: bool) -> str:
            if (n, gen) not in texts:
                texts[n, gen] = render(msgs[:n], gen=gen, tokenize=False)
            return texts[n, gen]

        def ids_of(n: int, gen: bool = False) -> list[int]:
            if (n, gen) not in tokens:
                if not n:
                    tokens[n, gen] = []
                elif direct:
                    tokens[n, gen] = backend.encode(text_of(n, gen), add_special_tokens=False).ids
                else:
                    tokens[n, gen] = render(msgs[:n], gen=gen)
            return tokens[n, gen]

        # The whole conversation is tokenized once with character offsets: where a prefix's
        # rendering begins the whole one (as templates render), the tokens it shares are those
        # ending within it, and no second tokenization is needed.
        whole = len(msgs)
        if direct:
            full = text_of(whole, False)
            out = backend.encode(full, add_special_tokens=False)
            ids = tokens[whole, False] = out.ids
            ends = [end for _, end in out.offsets]
        else:
            ids = ids_of(whole)

        def shared(n: int, gen: bool = False) -> int:
            """How many leading tokens of ``ids`` the first n messages' rendering holds."""
            if n == whole and not gen:
                return len(ids)
            if direct and full.startswith(text_of(n, gen)):
                return bisect.bisect_right(ends, len(text_of(n, gen)))
            return _common_prefix(ids_of(n, gen), ids)

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
                thought = _common_prefix(render([*msgs[:i], {**msgs[i], "content": ""}]), ids)
                for j in range(start, thought):
                    mask[j] = 0
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        before = msgs[:last]
        # Shown as the prompt: what the user last said before the answer (no system prompt, no
        # template markers); a conversation with no user turn there shows its last message.
        users = [m for m in before if m["role"] == "user"]
        shown = (users or before)[-1]["content"] if before else None
        return Example(
            ids,
            mask,
            prompt=text_of(last, True) if before else "",
            answer=msgs[last]["content"],
            prompt_ids=ids_of(last, True) or None,
            display=shown,
        )


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""How a chat template marks what the assistant says (transformers' {% generation %} block)."""


def marked_assistant_mask(tmpl, messages: list, ids: list[int], kwargs: dict) -> list[int] | None:
    """The assistant mask a chat template marks with {% generation %} blocks (transformers'
    return_assistant_tokens_mask), when it has them and renders ``ids`` alike; else None (the
    tokens of each assistant turn are then found by rendering the conversation's prefixes)."""
    if not GENERATION_BLOCK.search(getattr(tmpl, "chat_template", None) or ""):
        return None
    try:
        out = tmpl.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kwargs,
        )
    except ValueError:  # a tokenizer without offsets (not a fast one) cannot map the blocks
        return None
    if list(out["input_ids"]) != ids:
        return None
    return [int(m) for m in out["assistant_masks"]]


REASONING_KEYS = ("reasoning_content", "thinking")
"""The fields an assistant message may carry its reasoning in (chat templates read one or the
other: Qwen3's and DeepSeek's reasoning_content, others thinking)."""


def with_reasoning(messages: list, where: str) -> tuple[list, list[int]]:
    """(messages, the indices of assistant turns with reasoning): each such turn's reasoning
    under both REASONING_KEYS, so that a template reading either shows it."""
    out, found = list(messages), []
    for i, m in enumerate(messages):
        given = [k for k in REASONING_KEYS if m.get(k) is not None]
        if not given:
            continue
        value = m[given[0]]
        if not isinstance(value, str):
            raise UserInputError(f"{given[0]} must be a string", f"{where} (messages[{i}])")
        if m["role"] != "assistant":
            raise UserInputError(
                f"{given[0]} belongs to an assistant turn, not a {m['role']!r} one",
                f"{where} (messages[{i}])",
            )
        if value.strip():
            out[i] = {**m, **dict.fromkeys(REASONING_KEYS, value)}
            found.append(i)
    return out, found


def fitted(ex: Example, max_length: int, overlong: str, min_length: int, stats) -> bool:
    """Whether ``ex`` stays in its split: longer than ``max_length`` it is cut to it
    (``overlong: truncate``) or dropped; shorter than ``min_length``, or left with no target, it
    is dropped. Each counted in ``stats``."""
    if len(ex.ids) > max_length:
        if overlong == "drop":
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


def _encode_rows(job):
    """In a worker: each row encoded, or the error it gave as (message, where)."""
    fmt, path, rows = job
    encoder = _WORKER["encoder"]
    out = []
    for n, obj in rows:
        try:
            out.append(encoder.encode(obj, fmt, f"{path}:{n}"))
        except UserInputError as e:
            out.append((e.message, e.where))
    return out


def encoded(encoder: Encoder, rows: list, fmt: str, path, workers: int = 1):
    """(row number, Example or the UserInputError its row gave), in file order: encoded here, or
    by ``workers`` processes (spawned, as macOS needs), each given the encoder and chunks of
    rows."""
    label = f"encoding {Path(path).name}"
    if workers <= 1:
        for n, obj in tracked(rows, label):
            try:
                yield n, encoder.encode(obj, fmt, f"{path}:{n}")
            except UserInputError as e:
                yield n, e
        return
    chunks = [rows[i : i + _CHUNK_ROWS] for i in range(0, len(rows), _CHUNK_ROWS)]
    jobs = [(fmt, str(path), chunk) for chunk in chunks]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)
    ) as pool:
        for chunk, results in zip(
            chunks, tracked(pool.map(_encode_rows, jobs), label), strict=True
        ):
            for (n, _), result in zip(chunk, results, strict=True):
                if isinstance(result, tuple):
                    result = UserInputError(*result)
                yield n, result


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
    if fmt == "auto":
        fmt = detect_format(rows[0][1], f"{path}:{rows[0][0]}")
    stats = SplitStats(examples=len(rows))
    out = []
    for _, ex in encoded(encoder, rows, fmt, path, workers_for(len(rows), num_proc)):
        with bad.row():
            if isinstance(ex, UserInputError):
                raise ex
            if fitted(ex, max_length, overlong, min_length, stats):
                out.append(ex)
                stats.tokens += len(ex.ids)
                stats.target_tokens += ex.n_targets
    bad.finish(stats, path)
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
    valid = [ds.examples[i] for i in sorted(order[cuts[0] : cuts[1]])]
    test = [ds.examples[i] for i in sorted(order[cuts[1] : cuts[2]])]
    train = [ds.examples[i] for i in sorted(order[cuts[2] :])]
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


def _stats_of(examples: list[Example]) -> SplitStats:
    s = SplitStats(examples=len(examples), kept=len(examples))
    s.tokens = sum(len(e.ids) for e in examples)
    s.target_tokens = sum(e.n_targets for e in examples)
    return s
