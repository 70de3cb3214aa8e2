"""KTO (Ethayarajh et al., 2024), as TRL's KTOTrainer computes it: unpaired feedback, each
completion desirable or not, trained against a reference policy.

With ``r`` an example's log-ratio log pi(y|x) - log ref(y|x) (summed over the completion's
tokens) and ``z0`` the reference point, the batch's mean log-ratio on mismatched
prompt/completion pairs (``data.feedback``), held constant and clamped at 0:

- ``kto``: ``desirable_weight x (1 - sigmoid(beta (r - z0)))`` for a desirable completion,
  ``undesirable_weight x (1 - sigmoid(beta (z0 - r)))`` for an undesirable one;
- ``apo_zero_unpaired``: ``1 - sigmoid(beta r)`` and ``sigmoid(beta r)`` (no reference point).

The loss is the mean over the step's examples. ``z0`` is estimated on each micro-batch, its
sum and count added up over the ranks of a data-parallel run. The reference is DPO's (``auto``,
``copy``, ``precomputed``); a precomputed one holds both sequences' log-probs of each example.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ObjectiveConfig
from ..data import BadRows
from ..data.cache import cached_split
from ..data.feedback import FeedbackExample, load_feedback
from ..data.preference import PairBatch, PairEncoder
from ..distributed import current
from .base import WEIGHT, metric_means
from .preference import DPO


@dataclass
class KTOConfig(ObjectiveConfig):
    """Kahneman-Tversky optimisation: unpaired completions labelled desirable or not, against
    a reference policy."""

    type: str = "kto"
    """This objective."""
    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the implicit rewards."""
    loss: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: each completion's log-ratio to the reference against the KL reference point;
    apo_zero_unpaired: desirable completions' likelihood raised and undesirable ones' lowered,
    each against zero (no reference point)."""
    desirable_weight: float = 1.0
    """Weight of a desirable completion's loss."""
    undesirable_weight: float = 1.0
    """Weight of an undesirable completion's loss. With unbalanced data, the run warns unless
    desirable_weight x desirable examples / (undesirable_weight x undesirable examples) lies
    in [1, 4/3], as the KTO paper recommends, saying which weights would."""
    reference: Literal["auto", "copy", "precomputed"] = "auto"
    """As DPO's: auto (the base with adapters off; full fine-tuning: copy), copy, or
    precomputed (both log-probs of every example, computed once before training)."""
    unpair: bool = False
    """Train on preference data (prompt, chosen, rejected): each pair becomes two examples, the
    chosen completion desirable and the rejected one undesirable."""

    def checks(self) -> tuple:
        return (
            (self.beta > 0, "beta", "greater than 0"),
            (self.desirable_weight > 0, "desirable_weight", "greater than 0"),
            (self.undesirable_weight > 0, "undesirable_weight", "greater than 0"),
        )


def class_balance_advice(desirable: int, undesirable: int, dw: float, uw: float) -> str | None:
    """A warning when dw x desirable / (uw x undesirable) is outside [1, 4/3] (the KTO paper's
    recommended range), naming the desirable_weight or undesirable_weight range that would put
    it inside; None when it is inside, or when one class is absent."""
    if not desirable or not undesirable:
        return None
    ratio = dw * desirable / (uw * undesirable)
    if 1.0 <= ratio <= 4.0 / 3.0:
        return None
    d_lo, d_hi = uw * undesirable / desirable, 4.0 / 3.0 * uw * undesirable / desirable
    u_lo, u_hi = 0.75 * dw * desirable / undesirable, dw * desirable / undesirable
    return (
        f"{desirable} desirable and {undesirable} undesirable examples with desirable_weight "
        f"{dw:g} and undesirable_weight {uw:g} weigh the classes {ratio:.2f} : 1; the KTO paper "
        f"recommends 1 to 4/3: set objective.desirable_weight in [{d_lo:.3g}, {d_hi:.3g}] or "
        f"objective.undesirable_weight in [{u_lo:.3g}, {u_hi:.3g}] (one of them)"
    )


class KTO(DPO):
    """KTO on unpaired feedback; counts examples. A batch is a batch of pairs whose second
    sequence is the example's mismatched one (``data.feedback``)."""

    name = "kto"
    Config = KTOConfig
    noun = "examples"

    @classmethod
    def load_split(cls, recipe, tokenizer, enc: PairEncoder, source, bad: BadRows):
        """One file's feedback examples (cached); preference pairs too with ``unpair``."""
        d, unpair = recipe.data, bool(getattr(recipe.objective, "unpair", False))
        limits = (d.max_length, d.overlong, d.min_length)
        build = partial(load_feedback, source, enc, d.format, limits, d.columns, bad, unpair)
        return cached_split(
            source, d, tokenizer, enc, build, (FeedbackExample,), limits=limits, kto=unpair
        )

    def prepare(self, run_dir, source, log) -> None:
        labels = [e.label for e in self.components.train_set.examples]
        cfg = self.config
        advice = class_balance_advice(
            sum(labels), len(labels) - sum(labels), cfg.desirable_weight, cfg.undesirable_weight
        )
        if advice:
            log(f"WARNING: {advice}")
        super().prepare(run_dir, source, log)

    def arrays(self, batch: PairBatch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        ds = self.components.train_set if batch.split == "train" else self.components.valid_set
        out["label"] = np.array(
            [ds.examples[i].label if i >= 0 else False for i in batch.pairs], np.float32
        )
        return out

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        cfg = self.config
        valid, label = batch["valid"], batch["label"]
        policy = self.sequence_logps(batch)  # [slots, 2]: the completion, the mismatched one
        ref = self.reference_logps(model, batch)
        ratio = policy[:, 0] - ref[:, 0]
        good_w, bad_w = label * valid, (1 - label) * valid
        # the reference point: the mismatched pairs' mean log-ratio; with the examples of each
        # class, summed over the ranks' shares of the batch (not in evaluation: each rank's
        # batches are its own there)
        kl_sum = mx.sum(mx.stop_gradient(policy[:, 1] - ref[:, 1]) * valid)
        n = mx.sum(valid)
        sums = mx.stack([kl_sum, n, mx.sum(good_w), mx.sum(bad_w)])
        world = current()
        if world.size > 1 and model.training:
            sums = world.all_sum(sums)
        z0 = mx.maximum(sums[0] / mx.maximum(sums[1], 1.0), 0.0)
        beta = cfg.beta
        if cfg.loss == "kto":
            good = 1 - mx.sigmoid(beta * (ratio - z0))
            bad = 1 - mx.sigmoid(beta * (z0 - ratio))
        else:  # apo_zero_unpaired
            good = 1 - mx.sigmoid(beta * ratio)
            bad = mx.sigmoid(beta * ratio)
        losses = label * cfg.desirable_weight * good + (1 - label) * cfg.undesirable_weight * bad
        means = _class_means(beta * ratio, policy[:, 0], (good_w, bad_w), sums, model.training)
        metrics = {"kl": z0 * n, **means}
        return mx.sum(losses * valid), n.astype(mx.int32), metrics

    def eval_metrics(self, loss_sum: float, count: int, metrics: dict[str, float]) -> dict:
        out = {"eval_loss": loss_sum / max(count, 1), "eval_examples": count}
        out.update({f"eval_{k}": v for k, v in metric_means(metrics, max(count, 1)).items()})
        return out


def _class_means(rewards, logps, weights, sums, training: bool) -> dict:
    """Each class's mean reward and log-prob over one micro-batch, weighted 1 where it holds
    the class and 0 where not (``WEIGHT``): a row is then their mean over the batches that hold
    the class, as TRL's KTOTrainer logs them, and the margin's over the batches that hold both.
    ``weights``: the desirable and undesirable rows' masks. In training each rank adds its
    share of the whole batch's mean (``sums``: over every rank's rows) and 1/N of the weight."""
    world = current()
    ranks = world.size if world.size > 1 and training else 1
    out, present = {}, {}
    for cls, w, total in (("chosen", weights[0], sums[2]), ("rejected", weights[1], sums[3])):
        present[cls] = (total > 0).astype(mx.float32)
        out[cls + WEIGHT] = present[cls] / ranks  # rewards/CLASS and logps/CLASS
        for name, v in (("rewards", rewards), ("logps", logps)):
            out[f"{name}/{cls}"] = mx.sum(mx.stop_gradient(v) * w) / mx.maximum(total, 1.0)
    both = present["chosen"] * present["rejected"]
    out["rewards/margins"] = (out["rewards/chosen"] - out["rewards/rejected"]) * both
    out["margins" + WEIGHT] = both / ranks
    return out


__all__ = ["KTO", "KTOConfig", "class_balance_advice"]
