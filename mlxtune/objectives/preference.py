"""Preference objectives: DPO (and its sigmoid, IPO, hinge and robust losses), ORPO, and reward
models, on pairs of completions of one prompt, the chosen one preferred.

Every one of them needs each sequence's log-probability of its completion: the per-token
cross-entropy of the loss kernel (``reduction="none"``, over the completion tokens only, never
[N, V] logits), summed per sequence. A pair's chosen and rejected sequences run in one forward
(consecutive rows, or segments of one packed row).

DPO's reference policy:

- ``auto``: with LoRA/DoRA, the same model with its adapters off (the base: no second model in
  memory, one forward more a step); with full fine-tuning, ``copy``.
- ``copy``: the trainable weights as the run starts (the base and an ``adapter.init_from``
  adapter as loaded), kept aside: for LoRA a copy of the adapters, for full fine-tuning of the
  model's weights.
- ``precomputed``: the starting model's log-probs of every pair, computed once before training
  and kept in the run directory (``reference_logps.safetensors``); steps run no reference pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ObjectiveConfig
from ..data import BadRows, held_out, read_positions
from ..data.cache import cached_split
from ..data.preference import (
    PairBatch,
    PairEncoder,
    PairExample,
    empty_pair_batch,
    iterate_pairs,
    load_pairs,
    packed_pair_epoch,
    pair_batches,
    renumbered,
    split_pair_batch,
)
from ..errors import UserInputError
from ..kernels import forward_only
from ..models import VisionLM, add_reward_head, kernel_attention, segments
from .base import Objective, Usage, encoding, target_rows
from .reference import ReferencePolicy, reference_kind

REFERENCE_FILE = "reference_logps.safetensors"


@dataclass
class DPOConfig(ObjectiveConfig):
    """Direct preference optimisation against a reference policy."""

    type: str = "dpo"
    """This objective."""
    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the implicit rewards."""
    loss: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta x margin); ipo: (margin - 1/(2 beta))^2 on log-probs
    averaged over the completion's tokens; hinge: max(0, 1 - beta x margin); robust: the
    sigmoid loss corrected for label_smoothing's share of flipped labels."""
    label_smoothing: float = 0.0
    """sigmoid and robust: the assumed share of pairs whose preference is wrong (0 to 0.5)."""
    rpo_alpha: float = 0.0
    """Weight of the chosen completion's NLL (its mean over the completion's tokens) added to
    each pair's loss (RPO): DPO alone can lower both completions' likelihood; this keeps the
    chosen one likely. 0: plain DPO."""
    reference: Literal["auto", "copy", "precomputed"] = "auto"
    """auto: the base with adapters off (LoRA/DoRA; full fine-tuning: copy); copy: the
    trainable weights as the run starts, kept aside; precomputed: the starting model's
    log-probs of every pair, computed once before training into the run directory."""

    def checks(self) -> tuple:
        smooths = self.loss in ("sigmoid", "robust")
        return (
            (self.beta > 0, "beta", "greater than 0"),
            (0 <= self.label_smoothing < 0.5, "label_smoothing", "in [0, 0.5)"),
            (self.rpo_alpha >= 0, "rpo_alpha", "at least 0"),
            (
                smooths or not self.label_smoothing,
                "label_smoothing",
                f"0 with loss {self.loss} (it applies to the sigmoid and robust losses)",
            ),
        )


@dataclass
class ORPOConfig(ObjectiveConfig):
    """Odds-ratio preference optimisation: SFT on the chosen completion plus a penalty on the
    rejected one's odds; no reference policy."""

    type: str = "orpo"
    """This objective."""
    beta: float = 0.1
    """Weight of the odds-ratio term beside the chosen completion's NLL."""
    nll_over: Literal["completion", "sequence"] = "completion"
    """The NLL term. completion: each pair's chosen completion, its mean over the completion's
    tokens (the paper's SFT term; the prompt is not trained on, as in SFT); sequence: every token
    of the chosen sequences, prompt included, averaged over the batch's tokens (as TRL's
    ORPOTrainer computes it; a micro-batch of a split step averages over its own tokens)."""

    def checks(self) -> tuple:
        return ((self.beta > 0, "beta", "greater than 0"),)


@dataclass
class RewardConfig(ObjectiveConfig):
    """A reward model: a scalar head on each sequence's last token, trained so that the chosen
    completion scores above the rejected one (Bradley-Terry)."""

    type: str = "reward"
    """This objective."""
    center_rewards: float = 0.0
    """Weight of a penalty on the mean squared reward, which keeps rewards near 0."""

    def checks(self) -> tuple:
        return ((self.center_rewards >= 0, "center_rewards", "at least 0"),)


class Preference(Objective):
    """What the preference objectives share: pairs as data, batches that keep pairs whole,
    per-sequence completion log-probs, and evaluation on the validation pairs. Counts pairs."""

    noun = "pairs"
    sequences_per_example = 2

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        d = recipe.data
        self.packing = d.packing
        self.pack_length = d.pack_length or 2 * d.max_length
        if self.packing == "stream":
            raise UserInputError(
                "a stream cuts sequences apart; preference objectives pack whole pairs "
                "(data.packing: pack)",
                "data.packing",
            )
        if self.packing == "pack":
            self.refuse_packing_the_model_cannot_keep_apart()
            longest = max(p.size for p in components.train_set.examples)
            if longest > self.pack_length:
                raise UserInputError(
                    f"a packed row holds whole pairs, and a pair here has {longest} tokens; "
                    f"data.pack_length ({self.pack_length}) must hold it (2 x data.max_length)",
                    "data.pack_length",
                )

    # ---------------------------------------------------------------------- data
    @classmethod
    def load_split(cls, recipe, tokenizer, enc: PairEncoder, source, bad: BadRows):
        """One file's examples (cached): preference pairs here; KTO reads its feedback."""
        d = recipe.data
        limits = (d.max_length, d.overlong, d.min_length)
        build = partial(load_pairs, source, enc, d.format, limits, d.columns, bad, d.num_proc)
        return cached_split(source, d, tokenizer, enc, build, (PairExample,), limits=limits)

    @classmethod
    def datasets(cls, recipe, tokenizer):
        """(train, valid, test) as the data section says (``load_split`` reads each file)."""
        r, d = recipe, recipe.data
        enc = PairEncoder(tokenizer, **encoding(d, tokenizer))

        def load(path):
            source, bad = r.resolve_path(path), BadRows(d.bad_rows == "skip", d.max_bad_fraction)
            return cls.load_split(r, tokenizer, enc, source, bad)

        train = load(d.train)
        train, valid, test = held_out(train, d, r.train.seed, bool(d.valid), bool(d.test))
        if valid is not None or test is not None:
            train, valid, test = (
                None if x is None else renumbered(x) for x in (train, valid, test)
            )
        if valid is None:
            valid = load(d.valid)
        if test is None:
            test = load(d.test) if d.test else valid
        for ds in (train, valid, test):
            ds.stats.noun = cls.noun
        return train, valid, test

    def batches(self, start_epoch: int = 0, skip: int = 0):
        r, t, c = self.recipe, self.recipe.train, self.components
        return iterate_pairs(
            c.train_set,
            t.batch_size,
            c.pad_id,
            r.data.pad_to_multiple,
            t.seed,
            r.data.bucket_size,
            self.packing,
            self.pack_length,
            start_epoch,
            skip,
        )

    def batches_per_epoch(self) -> int:
        t, c = self.recipe.train, self.components
        if self.packing != "off":
            rows = packed_pair_epoch(c.train_set, self.pack_length, t.seed, 0)
            return self.epoch_batches(len(rows))
        return self.epoch_batches(len(c.train_set))

    def eval_batches(self):
        return self.padded_eval_batches(pair_batches)

    def arrays(self, batch: PairBatch) -> dict[str, np.ndarray]:
        """The rows, and for each target position the sequence it scores (``seq``: 2 x slots
        for none), each slot's validity and its sequences' completion lengths."""
        out = super().arrays(batch)  # tokens, mask, segments, rows
        slots = len(batch.pairs)
        seq = batch.seq[:, 1:]
        out["seq"] = np.where((batch.mask[:, 1:] > 0) & (seq >= 0), seq, 2 * slots).astype(np.int32)
        out["valid"] = (batch.pairs >= 0).astype(np.float32)
        counts = np.bincount(out["seq"].reshape(-1), minlength=2 * slots + 1)[: 2 * slots]
        out["lengths"] = np.maximum(counts, 1).reshape(slots, 2).astype(np.float32)
        return out

    def count(self, batch: PairBatch) -> int:
        return batch.n_pairs

    def split(self, batch: PairBatch, parts: int) -> list[PairBatch]:
        """Micro-batches of whole pairs."""
        return split_pair_batch(batch, parts)

    def nothing(self, batch: PairBatch) -> PairBatch:
        return empty_pair_batch(batch)

    def usage(self, batch: PairBatch) -> Usage:
        return Usage(batch.n_pairs, batch.n_targets, batch.n_tokens, batch.tokens.size)

    def layout(self) -> tuple[int, int]:
        """Two rows a pair (or packed rows of pack_length)."""
        r = self.recipe
        if self.packing != "off":
            return r.train.batch_size, self.pack_length - 1
        longest = max((p.longest for p in self.components.train_set.examples), default=2)
        return 2 * r.train.batch_size, read_positions(longest, r.data.pad_to_multiple)

    def units(self, batch: PairBatch) -> int:
        return len(batch.tokens) if batch.packed else len(batch.tokens) // 2

    # ---------------------------------------------------------------------- log-probs
    def sequence_logps(self, batch: dict[str, mx.array], tok: mx.array | None = None) -> mx.array:
        """[slots, 2]: each pair's chosen and rejected completion log-probs, summed over the
        completion's tokens (the prompt and padding add nothing). ``tok``: the batch's per-token
        losses where the caller has them already."""
        if tok is None:
            tok, _ = self.token_losses(batch, reduction="none")
        slots = batch["valid"].shape[0]
        seq = batch["seq"].reshape(-1)
        sums = mx.zeros((2 * slots + 1,), mx.float32).at[seq].add(-tok.reshape(-1))
        return sums[:-1].reshape(slots, 2)

    def eval_metrics(self, loss_sum: float, count: int, metrics: dict[str, float]) -> dict:
        n = max(count, 1)
        out = {"eval_loss": loss_sum / n, "eval_pairs": count}
        out.update({f"eval_{k}": v / n for k, v in metrics.items()})
        return out


def pair_metrics(chosen, rejected, logp_chosen, logp_rejected, valid) -> dict:
    """TRL's names: implicit rewards, their margin and accuracy, the policy's log-probs; sums
    over the batch's pairs (rows show them divided by the pairs)."""
    chosen, rejected = mx.stop_gradient(chosen), mx.stop_gradient(rejected)
    return {
        "rewards/chosen": mx.sum(chosen * valid),
        "rewards/rejected": mx.sum(rejected * valid),
        "rewards/margins": mx.sum((chosen - rejected) * valid),
        "rewards/accuracies": mx.sum((chosen > rejected).astype(mx.float32) * valid),
        "logps/chosen": mx.sum(mx.stop_gradient(logp_chosen) * valid),
        "logps/rejected": mx.sum(mx.stop_gradient(logp_rejected) * valid),
    }


class DPO(Preference):
    """DPO: -log sigmoid(beta ((log pi_c - log ref_c) - (log pi_r - log ref_r))) a pair, or
    one of its variants (``objective.loss``)."""

    name = "dpo"
    Config = DPOConfig

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        cfg = self.config
        self.reference = reference_kind(cfg.reference, recipe.adapter.type)
        self._policy = (
            ReferencePolicy(self.reference, components.model)
            if self.reference != "precomputed"
            else None
        )
        self._table: dict[str, np.ndarray] | None = None

    def prepare(self, run_dir, source, log) -> None:
        """Keep the reference the recipe asks for, from the model as built (before a resumed
        run's weights are loaded): the starting weights, or every pair's log-probs under them
        (read back from the run when it has them)."""
        if self._policy is not None:
            self._policy.keep(log)
        else:
            self._table = self._reference_table(run_dir, source, log)

    def _reference_table(self, run_dir, source, log) -> dict[str, np.ndarray]:
        c = self.components
        splits = {"train": c.train_set, "valid": c.valid_set}
        saved = source.path / REFERENCE_FILE if source is not None else None
        if saved is not None and saved.exists():  # a resumed run's
            table = {k: np.array(v) for k, v in mx.load(str(saved)).items()}
            for k, ds in splits.items():
                if k not in table or table[k].shape != (len(ds), 2):
                    raise UserInputError(
                        f"the reference log-probs here are for other data ({k}: "
                        f"{table.get(k, np.zeros((0, 2))).shape[0]} pairs, the data has "
                        f"{len(ds)})",
                        str(saved),
                    )
            log(f"reference: log-probs of every pair, read from {REFERENCE_FILE}")
            return table
        model = c.model
        was = model.training
        model.eval()
        step = mx.compile(self.sequence_logps, inputs=[model.state])
        table = {}
        tier = c.tiers["attention"]  # the attention the steps will run
        routed = kernel_attention(model, tier) if tier != "off" else contextlib.nullcontext()
        try:
            for k, ds in splits.items():
                out = np.zeros((len(ds), 2), np.float32)
                size = self.eval_batch_size
                for b in pair_batches(
                    ds, size, c.pad_id, self.recipe.data.pad_to_multiple, None, k
                ):
                    arrays = {n: mx.array(v) for n, v in self.arrays(b).items()}
                    if isinstance(model, VisionLM):  # its images through its tower, here
                        arrays = model.prepare(arrays)
                    with forward_only(), routed:
                        got = step(arrays)
                    out[b.pairs] = np.array(got)
                table[k] = out
        finally:
            model.train(was)
        mx.save_safetensors(
            str(run_dir.path / REFERENCE_FILE), {k: mx.array(v) for k, v in table.items()}
        )
        log(
            f"reference: log-probs of {sum(len(d) for d in splits.values())} pairs computed "
            f"once under the starting weights ({REFERENCE_FILE})"
        )
        return table

    def arrays(self, batch: PairBatch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        if self._table is not None:
            table = self._table[batch.split]
            out["reference"] = np.where(
                (batch.pairs >= 0)[:, None], table[np.maximum(batch.pairs, 0)], 0.0
            ).astype(np.float32)
        return out

    def reference_memory(self) -> dict:
        kept = self._policy.bytes if self._policy is not None else 0
        return {"forward": self._policy is not None, "bytes": kept}

    def reference_logps(self, model: nn.Module, batch: dict[str, mx.array]) -> mx.array:
        """[slots, 2] the reference policy's log-probs of the batch's completions."""
        if self._policy is None:
            return batch["reference"]
        with self._policy.active():  # nothing flows back through the reference
            out = self.sequence_logps(batch)
        return mx.stop_gradient(out)

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        cfg = self.config
        valid = batch["valid"]
        policy = self.sequence_logps(batch)
        ref = self.reference_logps(model, batch)
        if cfg.loss == "ipo":  # IPO compares log-probs averaged over the completion's tokens
            policy, ref = policy / batch["lengths"], ref / batch["lengths"]
        chosen = policy[:, 0] - ref[:, 0]
        rejected = policy[:, 1] - ref[:, 1]
        margin = chosen - rejected
        beta, eps = cfg.beta, cfg.label_smoothing
        if cfg.loss == "sigmoid":
            losses = (
                -nn.log_sigmoid(beta * margin) * (1 - eps) - nn.log_sigmoid(-beta * margin) * eps
            )
        elif cfg.loss == "robust":
            losses = (
                -nn.log_sigmoid(beta * margin) * (1 - eps) + nn.log_sigmoid(-beta * margin) * eps
            ) / (1 - 2 * eps)
        elif cfg.loss == "hinge":
            losses = mx.maximum(1 - beta * margin, 0)
        else:  # ipo
            losses = mx.square(margin - 1 / (2 * beta))
        metrics = pair_metrics(beta * chosen, beta * rejected, policy[:, 0], policy[:, 1], valid)
        if cfg.rpo_alpha:
            nll = -policy[:, 0] if cfg.loss == "ipo" else -policy[:, 0] / batch["lengths"][:, 0]
            losses = losses + cfg.rpo_alpha * nll
            metrics["nll_loss"] = mx.sum(mx.stop_gradient(nll) * valid)
        return mx.sum(losses * valid), mx.sum(valid).astype(mx.int32), metrics


class ORPO(Preference):
    """ORPO: the chosen completion's mean NLL plus beta x -log sigmoid(log odds ratio), the
    odds of each completion from its log-probs averaged over its tokens."""

    name = "orpo"
    Config = ORPOConfig

    def arrays(self, batch: PairBatch) -> dict[str, np.ndarray]:
        """With ``nll_over: sequence``, the loss kernel also scores every token of the chosen
        sequences (``whole``: where it counts toward the NLL), beside the completions."""
        out = super().arrays(batch)
        if self.config.nll_over != "sequence":
            return out
        seq = batch.seq
        # position t reads token t + 1 of the same sequence, the sequence's first token excluded
        inside = (seq[:, 1:] >= 0) & (seq[:, 1:] == seq[:, :-1])
        whole = inside & (seq[:, 1:] % 2 == 0)
        mask = np.zeros_like(batch.mask)
        mask[:, 1:] = (batch.mask[:, 1:] > 0) | whole
        out["mask"] = mask
        out.pop("rows", None)
        rows = target_rows(mask)
        if rows is not None:
            out["rows"] = rows
        out["whole"] = whole.astype(np.float32)
        return out

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        valid = batch["valid"]
        tok, _ = self.token_losses(batch, reduction="none")
        mean = self.sequence_logps(batch, tok) / batch["lengths"]
        # log(1 - p) from log p, kept finite where p rounds to 1
        log_not = mx.log(-mx.expm1(mx.minimum(mean, -1e-7)))
        log_odds = (mean[:, 0] - mean[:, 1]) - (log_not[:, 0] - log_not[:, 1])
        ratio = nn.log_sigmoid(log_odds)
        beta = self.config.beta
        if self.config.nll_over == "sequence":  # the batch's token mean, once a pair
            whole = batch["whole"]
            per_token = mx.sum(tok * whole) / mx.maximum(mx.sum(whole), 1.0)
            nll = mx.broadcast_to(per_token, valid.shape)
        else:
            nll = -mean[:, 0]
        losses = nll - beta * ratio
        metrics = pair_metrics(beta * mean[:, 0], beta * mean[:, 1], mean[:, 0], mean[:, 1], valid)
        metrics["nll_loss"] = mx.sum(mx.stop_gradient(nll) * valid)
        metrics["log_odds_ratio"] = mx.sum(mx.stop_gradient(ratio) * valid)
        metrics["log_odds_chosen"] = mx.sum(mx.stop_gradient(log_odds) * valid)
        return mx.sum(losses * valid), mx.sum(valid).astype(mx.int32), metrics


class Reward(Preference):
    """A reward model: the score head's value at each sequence's last token, trained with the
    Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) (plus ``center_rewards`` x
    (r_chosen + r_rejected)^2)."""

    name = "reward"
    Config = RewardConfig

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        if recipe.eval.exact_match:
            raise UserInputError(
                "a reward model scores answers and generates none: set eval.exact_match: 0",
                "eval.exact_match",
            )
        if recipe.samples.every or recipe.samples.prompts:
            raise UserInputError(
                "a reward model scores answers and generates none: leave samples unset",
                "samples",
            )

    @classmethod
    def extend(cls, recipe, model, log) -> None:
        hidden = int(model.args.hidden_size)
        add_reward_head(model, hidden)
        if "lm_head" in model:  # an untied LM head scores nothing here: no optimizer state
            model.lm_head.freeze()
        log(f"reward head: a trainable {hidden} -> 1 score on each sequence's last token")

    def arrays(self, batch: PairBatch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        out.pop("rows", None)  # the head reads last tokens only: no LM head to skip
        # each sequence's last token, as a flat index into the [R x L] positions
        slots = len(batch.pairs)
        last = np.zeros(2 * slots, np.int64)
        flat = batch.seq.reshape(-1)
        where = np.flatnonzero(flat >= 0)
        np.maximum.at(last, flat[where], where)  # each sequence's highest position
        out["last"] = last.reshape(slots, 2).astype(np.int32)
        return out

    def rewards(self, model: nn.Module, batch: dict[str, mx.array]) -> mx.array:
        """[slots, 2] the scores of each pair's chosen and rejected sequences."""
        tokens, seg = batch["tokens"], batch.get("segments")
        with segments(seg):
            h = self.components.lm.hidden(tokens)
        h = h.reshape(-1, h.shape[-1])[batch["last"].reshape(-1)]
        return model.score(h.astype(mx.float32)).reshape(-1, 2)

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        valid = batch["valid"]
        r = self.rewards(model, batch)
        losses = -nn.log_sigmoid(r[:, 0] - r[:, 1])
        if self.config.center_rewards:
            losses = losses + self.config.center_rewards * mx.square(r[:, 0] + r[:, 1])
        c, j = mx.stop_gradient(r[:, 0]), mx.stop_gradient(r[:, 1])
        metrics = {
            "rewards/chosen": mx.sum(c * valid),
            "rewards/rejected": mx.sum(j * valid),
            "rewards/margins": mx.sum((c - j) * valid),
            "rewards/accuracies": mx.sum((c > j).astype(mx.float32) * valid),
        }
        return mx.sum(losses * valid), mx.sum(valid).astype(mx.int32), metrics


__all__ = [
    "DPO",
    "DPOConfig",
    "ORPO",
    "ORPOConfig",
    "Preference",
    "Reward",
    "RewardConfig",
    "pair_metrics",
]
