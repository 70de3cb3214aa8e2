"""Unpaired feedback for KTO: JSONL rows of a prompt, one completion and a ``label`` (true: the
completion is desirable) -> a ``FeedbackExample`` each, which batches as a preference pair does.

KTO's reference point is the policy's KL divergence from the reference, estimated on
*mismatched* prompt/completion pairs: each example's prompt followed by another example's
completion. Each example carries its mismatched sequence as the pair's second sequence
(``rejected_ids``/``rejected_mask``), so a batch of examples is a batch of pairs: one forward
scores both, the pair batching, packing and micro-batch splits keep them together, and a
precomputed reference holds both log-probs. An example's partner is the next row (in file order,
wrapping round) whose prompt differs from its own, as TRL's KTOTrainer pairs each prompt with a
neighbouring row's completion; the partner's completion is rendered after this example's
prompt (through the chat template for conversations).

Preference rows (prompt, chosen, rejected) train too when ``unpair`` is set: each becomes two
examples, the chosen completion desirable and the rejected one not, side by side in the order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserInputError
from .encode import Dataset, SplitStats, finished_split
from .formats import Labeled, Pair, detect_format, get_format
from .preference import PairEncoder, PairExample, fit_to_length, keep
from .rows import BadRows


@dataclass
class FeedbackExample(PairExample):
    """One completion with its label. ``ids``/``mask``: the prompt and the completion (its
    tokens the targets); ``rejected_ids``/``rejected_mask``: the same prompt with the partner
    example's completion (the KL estimate's sequence); ``label``: desirable or not."""

    label: bool = True


def load_feedback(
    path,
    encoder: PairEncoder,
    fmt: str,
    limits: tuple,
    columns: dict[str, str] | None = None,
    bad: BadRows | None = None,
    unpair: bool = False,
) -> Dataset:
    """A JSONL file's feedback examples (``unpair``: preference rows become two each);
    ``limits`` is (max_length, overlong, min_length), as ``load_pairs`` takes them. A sequence
    longer than ``max_length`` has its completion cut at the end (``overlong: truncate``) or its
    example dropped (``drop``); a prompt that leaves no room for a completion token is an error
    naming the line."""
    max_length, overlong, min_length = limits
    bad = bad or BadRows()
    rows = bad.read(path, columns)
    if fmt == "auto":
        fmt = detect_format(rows[0][1], f"{path}:{rows[0][0]}")
    items: list[tuple[str, Labeled]] = []
    for n, obj in rows:
        where = f"{path}:{n}"
        with bad.row():
            piece = get_format(fmt).pieces(obj, where)
            if isinstance(piece, Labeled):
                items.append((where, piece))
            elif isinstance(piece, Pair):
                if not unpair:
                    raise UserInputError(
                        "kto trains on unpaired feedback (prompt, completion, label); set "
                        "objective.unpair: true to train on each pair's chosen completion as "
                        "desirable and its rejected one as undesirable",
                        where,
                    )
                items.append((where, Labeled(piece.prompt, piece.chosen, True, piece.tools)))
                items.append((where, Labeled(piece.prompt, piece.rejected, False, piece.tools)))
            else:
                raise UserInputError(
                    "kto trains on unpaired feedback: rows of prompt, completion and label "
                    f"(true or false); this row is {fmt!r} data",
                    where,
                )
    stats = SplitStats(examples=len(items))
    out: list[FeedbackExample] = []
    for i, (where, item) in enumerate(items):
        with bad.row():
            partner = _partner(items, i)
            pair = Pair(item.prompt, item.completion, partner.completion, item.tools)
            try:
                ex = encoder.encode(pair, where, FeedbackExample, label=item.label)
            except UserInputError as e:  # the pair's names, said as this row's
                said = e.message.replace("the 'chosen' completion", "the completion")
                said = said.replace(
                    "the 'rejected' completion",
                    "the completion this row's KL estimate borrows from another row",
                )
                raise UserInputError(said, where) from None
            # (the KL sequence is an estimate's sample: only the example's own decides a drop)
            drop = overlong == "drop" and len(ex.ids) > max_length
            if fit_to_length(ex, max_length, drop, where, stats):
                keep(ex, out, stats, len(ex.ids) >= min_length)
    return finished_split(out, stats, bad, path, "example")


def _partner(items: list[tuple[str, Labeled]], i: int) -> Labeled:
    """The next item after ``i`` (wrapping round) whose prompt differs from item ``i``'s, or
    the next one when every prompt is the same."""
    prompt = items[i][1].prompt
    for step in range(1, len(items)):
        other = items[(i + step) % len(items)][1]
        if other.prompt != prompt:
            return other
    return items[(i + 1) % len(items)][1]


__all__ = ["FeedbackExample", "load_feedback"]
