"""What a training objective is: the batches it trains on, its loss, and its evaluation.

The engine compiles ``value_and_grad(objective.loss)`` over a batch pytree (a dict of arrays), so
an objective never touches the optimizer, the precision policy, accumulation or checkpoints, and
the loop never knows which loss it runs. A new objective is a subclass registered with
``mlxtune.objectives.register`` plus its recipe section (a dataclass derived from
``ObjectiveConfig``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ObjectiveConfig, Recipe
from ..data import (
    BadRows,
    Batch,
    Dataset,
    Encoder,
    Example,
    StreamedSet,
    encode_rows,
    held_out,
    lengths_of,
    load_split,
    read_positions,
    split_batch,
)
from ..data.cache import cached_split
from ..errors import UserInputError
from ..kernels import linear_cross_entropy, linear_entropy
from ..models import LMParts, images, packing_refusal, segments, step_images
from ..tensor import split_cross_entropy, vocab_split

IGNORE = -100


@dataclass
class Components:
    """What an objective is built from: the tokenizer, the model and the datasets a recipe
    names, with the kernel tiers this machine runs."""

    tokenizer: Any
    model: nn.Module
    lm: LMParts
    """The model's hidden states, head weight and softcap, as the loss kernel takes them."""
    train_set: Dataset
    valid_set: Dataset
    test_set: Dataset
    pad_id: int
    tiers: dict[str, str]
    head_trains: bool
    """Whether the LM head (or the tied embedding) is trained: the loss kernel then returns
    its gradient."""


@dataclass(frozen=True)
class Usage:
    """What a batch holds, for the loop's counters."""

    examples: int
    targets: int
    """Tokens trained on (tokens_seen, tokens_per_sec)."""
    tokens: int
    """Real tokens, and the token slots the step computed over, padding included
    (packing_utilization)."""
    room: int


def encoding(data, tokenizer) -> dict:
    """How the data section (``data``) says rows are encoded, as an encoder's keywords: EOS,
    the chat template's arguments, reasoning, and a vision model's image tokens."""
    return dict(
        add_eos=data.add_eos,
        train_on_eos=data.train_on_eos,
        template_kwargs=data.chat_template_kwargs,
        train_on_reasoning=data.train_on_reasoning,
        images=getattr(tokenizer, "image_tokens", None),
    )


class Objective:
    """Base class of training objectives.

    Subclasses set ``name`` and ``Config`` and implement ``loss``; the batching, evaluation and
    batch handling below serve any objective whose batches are ``mlxtune.data.Batch`` rows and
    can be overridden one by one.

    ``loss(model, batch)`` returns ``(loss_sum, count, metrics)``: the loss summed over what it
    counts (target tokens, sequences, pairs, ...), that count, and a dict of further sums (each
    shown in log rows divided by the count). The step's loss is ``sum / count`` over all its
    micro-batches: the engine scales each micro-batch by the step's total count, which the host
    knows before the step runs from ``count(batch)`` (it must equal what ``loss`` returns).
    ``tokens_seen`` and ``tokens_per_sec`` count target tokens (``usage``) whatever the count.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    sequences_per_example: ClassVar[int] = 1
    """Sequences an example is (a preference pair: two), for the memory plan."""
    micro_key: ClassVar[str | None] = None
    """The recipe key that sets how many rows a training pass holds, where the objective has
    one (its passes are ``micro``); None: train.batch_size does."""
    noun: ClassVar[str] = "examples"
    """What a batch holds, as the header and summary name it (examples, pairs)."""

    def per_step(self, n: int) -> str:
        """What a step of ``n`` examples trains on, as the run's header says it."""
        return f"{n} {self.noun}/step"

    def __init__(self, recipe: Recipe, components: Components):
        self.recipe = recipe
        self.config = recipe.objective
        self.components = components

    # --------------------------------------------------------------------- set-up
    @classmethod
    def datasets(cls, recipe: Recipe, tokenizer) -> tuple[Dataset, Dataset, Dataset]:
        """(train, valid, test) as the recipe's data section names them, read before the
        objective is built (``Components`` holds them). By default examples in one of the
        registered data formats, encoded and masked as the data section says; valid is split
        off train when no file is named, and test is valid unless named."""
        r, d = recipe, recipe.data
        enc = Encoder(tokenizer, d.mask_prompt, **encoding(d, tokenizer))

        def load(path, max_length):
            source, bad = r.resolve_path(path), BadRows(d.bad_rows == "skip", d.max_bad_fraction)
            limits = (max_length, d.overlong, d.min_length)
            build = partial(load_split, source, enc, d.format, *limits, d.columns, bad, d.num_proc)
            return cached_split(source, d, tokenizer, enc, build, (Example,), limits=limits)

        # a token stream is cut into rows, not truncated per document
        longest = 1 << 62 if d.packing == "stream" else d.max_length
        if d.streaming:
            train, valid, test = cls._streamed(recipe, enc, longest)
        else:
            train = load(d.train, longest)
            train, valid, test = held_out(train, d, r.train.seed, bool(d.valid), bool(d.test))
        if d.packing == "stream":  # evaluation reads one document a row, up to max_length
            for ds in {id(x): x for x in (valid, test) if x is not None}.values():
                ds.examples = [
                    dataclasses.replace(e, ids=e.ids[: d.max_length], mask=e.mask[: d.max_length])
                    for e in ds.examples
                ]
        if valid is None:
            valid = load(d.valid, d.max_length)
        if test is None:
            test = load(d.test, d.max_length) if d.test else valid
        if r.eval.exact_match and not any(e.prompt_ids for e in test.examples):
            raise UserInputError(
                "eval.exact_match needs completion, instruction or chat data", "eval.exact_match"
            )
        return train, valid, test

    @classmethod
    def _streamed(cls, recipe: Recipe, enc: Encoder, longest: int):
        """data.streaming: (the ``StreamedSet``, valid and test held out of its first rows, or
        None where a file gives them)."""
        d = recipe.data
        limits = (longest, d.overlong, d.min_length)
        train = StreamedSet(
            str(recipe.resolve_path(d.train)),
            enc,
            d.format,
            limits,
            d.columns,
            (d.bad_rows == "skip", d.max_bad_fraction),
            d.num_proc,
            d.stream_window,
        )
        counts = [d.valid_size or 0 if d.valid is None else 0]
        counts.append(d.test_size or 0 if d.test is None else 0)
        held = train.hold_out(counts) if any(counts) else [[], []]
        sets = []
        for rows, what in zip(held, ("held out", "held out for test"), strict=True):
            if not rows:
                sets.append(None)
                continue
            bad = BadRows(d.bad_rows == "skip", d.max_bad_fraction)
            bad.rows = len(rows)
            where = f"{train.path} ({what})"
            limits = (d.max_length, d.overlong, d.min_length)
            ds = encode_rows(rows, train.path, enc, d.format, limits, bad)
            ds.path = where
            sets.append(ds)
        train.read_first()  # its errors come before the model loads
        return train, sets[0], sets[1]

    @classmethod
    def extend(cls, recipe: Recipe, model: nn.Module, log) -> None:
        """Called once the adapters are in, before the trainable weights are counted: what the
        objective adds to the model (a reward head). Nothing by default."""

    def prepare(self, run_dir, source, log) -> None:
        """Called once the engine is built and before a resumed run's weights are loaded (the
        model holds its starting weights): what the objective keeps from them, written to
        ``run_dir`` (or read back from ``source``, the run being resumed). Nothing by
        default."""

    def refuse_packing_the_model_cannot_keep_apart(self) -> None:
        """Packed rows are for models whose packed examples give what each gives alone
        (``models.packing_refusal``); else the recipe's ``data.packing`` is refused, saying why."""
        c = self.components
        why = packing_refusal(c.model, c.lm, c.tiers["attention"])
        if why is not None:
            raise UserInputError(f"{why}; use packing: off", "data.packing")

    # --------------------------------------------------------------------- the loss
    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        raise NotImplementedError(f"{type(self).__name__} must define loss(model, batch)")

    def hidden(self, batch: dict[str, mx.array]) -> mx.array:
        """The model's final hidden states [B, T-1, D] for every position but the last; packed
        rows (``batch["segments"]``) keep attention within each example."""
        tokens = batch["tokens"]
        seg = batch.get("segments")
        with segments(None if seg is None else seg[:, :-1]), images(step_images(batch, -1)):
            return self.components.lm.hidden(tokens[:, :-1])

    def token_losses(
        self,
        batch: dict[str, mx.array],
        reduction: str = "sum",
        label_smoothing: float = 0.0,
        hidden: mx.array | None = None,
    ):
        """Next-token cross-entropy over the batch's target tokens (``batch["mask"]`` marks
        them), from the hidden states through the loss kernel without materialising logits:
        ``(sum, count)``, or with ``reduction="none"`` per-token losses [B, T-1] (0 off-target)
        and the count. When the batch carries ``rows`` (see ``target_rows``), the head and the
        loss run over those positions only: the same losses, without the vocabulary-wide work
        for positions that are no target (a chat's prompt). ``hidden``: the batch's
        ``hidden(batch)`` when the caller has it already."""
        tokens, mask = batch["tokens"], batch["mask"]
        labels = batch.get("labels", tokens[:, 1:])  # the next tokens, unless drawn (Sophia)
        targets = mx.where(mask[:, 1:] > 0, labels, IGNORE).reshape(-1)
        h = self.hidden(batch) if hidden is None else hidden
        h = h.reshape(-1, h.shape[-1])
        rows = batch.get("rows")
        picked = targets if rows is None else targets[rows]
        c = self.components
        split = vocab_split(c.lm.head)  # tensor parallelism: this rank's rows of the head
        loss = linear_cross_entropy if split is None else partial(split_cross_entropy, where=split)
        out, n = loss(
            c.lm.loss_hidden(h if rows is None else h[rows]),
            c.lm.head_rows(),
            picked,
            ignore_index=IGNORE,
            label_smoothing=label_smoothing,
            softcap=c.lm.softcap,
            reduction=reduction,
            impl=c.tiers["loss"],
            weight_grad=c.head_trains,
        )
        if reduction != "none":
            return out, n
        if rows is not None:  # back to every position; the filler rows add their 0 loss
            out = mx.zeros(targets.shape, out.dtype).at[rows].add(out)
        return out.reshape(mask.shape[0], -1), n

    def token_entropies(self, batch: dict[str, mx.array], hidden: mx.array | None = None):
        """The entropy (fp32, nats) of the model's next-token distribution at each target
        position [B, T-1] (0 off-target), through ``linear_entropy``: the head, soft cap and
        ``rows`` as ``token_losses`` reads them, no [tokens, vocabulary] logits, no gradient. A
        head split by vocabulary among ranks (tensor parallelism) is not supported."""
        c = self.components
        if vocab_split(c.lm.head) is not None:
            raise ValueError("token_entropies: the head is split by vocabulary among ranks")
        mask = batch["mask"][:, 1:] > 0
        h = self.hidden(batch) if hidden is None else hidden
        h = h.reshape(-1, h.shape[-1])
        rows = batch.get("rows")
        out = linear_entropy(
            c.lm.loss_hidden(h if rows is None else h[rows]), c.lm.head_rows(), softcap=c.lm.softcap
        )
        if rows is not None:  # back to every position (the filler rows land off-target)
            out = mx.zeros((h.shape[0],), out.dtype).at[rows].add(out)
        return mx.where(mask, out.reshape(mask.shape), 0.0)

    # --------------------------------------------------------------------- batches
    def batches(self, start_epoch: int = 0, skip: int = 0) -> Iterator[tuple[int, Batch]]:
        """The endless (epoch, batch) stream the run trains on, from batch ``skip`` of epoch
        ``start_epoch``."""
        raise NotImplementedError(f"{type(self).__name__} must define batches()")

    def batches_per_epoch(self) -> int | None:
        """Batches in a pass over the training set (None: a stream, not known before it is
        read)."""
        raise NotImplementedError(f"{type(self).__name__} must define batches_per_epoch()")

    def epoch_batches(self, rows: int) -> int:
        """The training batches ``rows`` rows make (examples, pairs or packed rows), at
        train.batch_size a batch."""
        return math.ceil(rows / self.recipe.train.batch_size)

    @property
    def eval_batch_size(self) -> int:
        """Rows in a validation batch: eval.batch_size, else train.batch_size."""
        r = self.recipe
        return r.eval.batch_size or r.train.batch_size

    def arrays(self, batch: Batch) -> dict[str, np.ndarray]:
        """The batch as the pytree the compiled step takes."""
        out = {"tokens": batch.tokens, "mask": batch.mask}
        if batch.segments is not None:
            out["segments"] = batch.segments
        if batch.images is not None:  # a vision model's: what its tower and forward read
            files = [[Path(p) for p in row] for row in batch.images]
            out.update(self.components.model.batch_arrays(batch.tokens, files))
        rows = target_rows(batch.mask)
        if rows is not None:
            out["rows"] = rows
        return out

    def count(self, batch: Batch) -> int:
        """What ``loss`` will count for this batch, known on the host before the step runs."""
        return batch.n_targets

    def split(self, batch: Batch, parts: int) -> list[Batch]:
        """``batch`` as up to ``parts`` micro-batches whose summed losses are the batch's (used
        when a step runs out of memory)."""
        return split_batch(batch, parts)

    def micro(self, batch: Batch) -> list[Batch]:
        """The passes (a forward and a backward each) the objective trains ``batch`` in, before
        any out-of-memory split; most take a batch whole."""
        return [batch]

    def layout(self) -> tuple[int, int]:
        """(rows, positions) of the largest batch: what the memory plan sizes a step by."""
        r = self.recipe
        if r.data.packing != "off":  # packed rows are all pack_length long
            return r.train.batch_size, (r.data.pack_length or r.data.max_length) - 1
        if r.data.streaming:  # a later window may hold an example as long as max_length
            return r.train.batch_size, read_positions(r.data.max_length, r.data.pad_to_multiple)
        longest = max(lengths_of(self.components.train_set.examples), default=2)
        return r.train.batch_size, read_positions(longest, r.data.pad_to_multiple)

    def generation_layout(self) -> tuple[int, int] | None:
        """(rows, positions) the objective generates at once while training (their KV cache
        and sampling logits, for the memory plan); None: it does not generate."""
        return None

    def generates(self) -> bool:
        """Whether the objective decodes while it trains or evaluates (each rank its own
        prompts): a fully sharded run, whose every forward gathers from all ranks, cannot."""
        return self.generation_layout() is not None

    def reference_memory(self) -> dict:
        """What a reference policy (or a teacher) adds to a step: ``forward`` (one more forward
        pass, without its backward), ``bytes`` (weights kept for it) and, optionally,
        ``step_bytes`` (what the loss holds while a step runs besides the loss kernel's)."""
        return {"forward": False, "bytes": 0}

    def units(self, batch: Batch) -> int:
        """The most micro-batches ``split`` can make of ``batch`` (its rows)."""
        return len(batch.tokens)

    def nothing(self, batch: Batch) -> Batch:
        """A batch shaped like ``batch``'s first row whose loss and count are 0: the share of a
        data-parallel rank that a small batch leaves without rows."""
        seg = None if batch.segments is None else batch.segments[:1]
        return Batch(batch.tokens[:1], np.zeros_like(batch.mask[:1]), 0, batch.lengths[:1], seg)

    def usage(self, batch: Batch) -> Usage:
        return Usage(batch.examples, batch.n_targets, batch.n_tokens, batch.tokens.size)

    def host_metrics(self, batch: Batch) -> dict[str, tuple[float, float]]:
        """Metrics the host made for ``batch`` (not the loss's): name -> (sum, weight), shown
        in log rows as the window's sum over its weight; a name ending in ``_max`` carries
        (max, 1) and shows the window's largest. None by default."""
        return {}

    # --------------------------------------------------------------------- checkpoints
    def save(self, folder) -> None:
        """Write what the objective carries between steps into checkpoint ``folder`` (beside
        the optimizer's state). Nothing by default."""

    def restore(self, folder) -> None:
        """Read back what ``save`` wrote, before the resumed run's first batch."""

    # --------------------------------------------------------------------- evaluation
    eval_samples: list[dict] = []
    """Completions the last ``evaluate`` made, to be shown and kept (``prompt``, ``completion``
    and what the objective adds); none by default."""

    def evaluate(self, engine, world) -> dict:
        """The eval row's metrics (``eval_loss`` among them: lower is better), the model in
        eval mode: by default the loss over ``eval_batches()``, each data-parallel rank
        running its share."""
        total, count, sums = 0.0, 0, {}
        batches = list(self.eval_batches())
        split = engine.data_ranks  # tensor parallelism: every rank runs every batch
        mine = batches[world.rank :: world.size] if split > 1 else batches
        if not mine and batches:  # a rank left without batches still reports the metrics' names
            mine = [self.nothing(batches[0])]
        if engine.sharded and batches:  # each forward gathers from every rank: as many each
            mine += [self.nothing(batches[0])] * (-(-len(batches) // split) - len(mine))
        for b in mine:
            loss, n, metrics = engine.evaluate_batch(b)
            mx.eval(loss, n, metrics)
            total, count = total + loss.item(), count + n.item()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        if split > 1:
            names = sorted(sums)
            got = world.agree([total, count] + [sums[k] for k in names])
            total, count = got[0], int(round(got[1]))
            sums = {k: got[2 + i] for i, k in enumerate(names)}
        return self.eval_metrics(total, count, sums)

    def eval_batches(self) -> Iterable[Batch]:
        """The fixed batches ``evaluate`` runs over."""
        raise NotImplementedError(f"{type(self).__name__} must define eval_batches()")

    def padded_eval_batches(self, batcher) -> Iterable[Batch]:
        """The validation set as ``batcher(dataset, size, pad_id, pad_to_multiple,
        max_batches)`` batches it (examples or pairs), padded as the data section says."""
        r, c = self.recipe, self.components
        size = self.eval_batch_size
        return batcher(c.valid_set, size, c.pad_id, r.data.pad_to_multiple, r.eval.max_batches)

    def eval_metrics(self, loss_sum: float, count: int, metrics: dict[str, float]) -> dict:
        """The eval row's values from the summed losses over ``eval_batches()``."""
        loss = loss_sum / max(count, 1)
        out = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": count}
        out.update({f"eval_{k}": v for k, v in metric_means(metrics, count).items()})
        return out


WEIGHT = "@weight"
"""A metric named ``GROUP@weight`` is what the sums of the metrics ``.../GROUP`` are divided by
in a row (``metric_means``), in place of the row's examples or tokens: ``chosen@weight`` for
``rewards/chosen`` and ``logps/chosen``."""


def metric_means(sums: dict[str, float], count: float) -> dict[str, float | None]:
    """A row's metrics from their sums over its micro-batches: each divided by ``count`` (the
    examples or tokens the row counts), or by its own weight where the objective gives one
    (``GROUP@weight`` for ``.../GROUP``: a class's mean over the batches that hold the class,
    say); None where that is 0. The weights themselves are no metric."""
    out: dict[str, float | None] = {}
    for k, v in sums.items():
        if k.endswith(WEIGHT):
            continue
        w = sums.get(k.rsplit("/", 1)[-1] + WEIGHT, count)
        out[k] = v / w if w else None
    return out


# target_rows pads its row count up to a multiple of 1/ROW_STEPS of the positions (and of
# ROW_QUANTUM), so that a run compiles its step for few distinct shapes per batch width.
ROW_STEPS = 8
ROW_QUANTUM = 16


def target_rows(mask: np.ndarray) -> np.ndarray | None:
    """Where the loss has work to do: the flat indices (into the [B * (L-1)] positions the
    model reads) of the positions whose next token is a target, padded with a position that is
    no target (whose loss is 0) up to a coarse size; None where that size would save little
    over all positions (plain text, packed completions) or no position is free to pad with.

    The head's matmul and the loss then run over about the target positions only; on chat data
    most positions are the prompt."""
    flat = np.asarray(mask)[:, 1:].reshape(-1) > 0
    n = flat.size
    k = int(flat.sum())
    if k == n:
        return None
    step = max(ROW_QUANTUM, -(-n // (ROW_STEPS * ROW_QUANTUM)) * ROW_QUANTUM)
    size = max(step, -(-k // step) * step)
    if size * ROW_STEPS > n * (ROW_STEPS - 1):  # saves less than one step's share
        return None
    filler = int(np.argmin(flat))  # the first position that is no target
    out = np.full(size, filler, dtype=np.int32)
    out[:k] = np.flatnonzero(flat)
    return out
