"""CPO and SimPO: preference optimisation without a reference policy (one forward a step, no
second set of weights), on the same pairs, batches and packing as DPO.

Per pair, with ``c`` and ``r`` the policy's log-probabilities of the chosen and rejected
completions (summed over their tokens; averaged over them for ``ipo`` and ``simpo``) and
``z = c - r``:

- sigmoid (CPO): ``-log sigmoid(beta z)``, with label smoothing ``eps``:
  ``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)``;
- simpo (SimPO): the same on ``z - gamma / beta`` (``simpo_gamma``: the target margin between
  the length-normalised rewards ``beta c`` and ``beta r``);
- hinge: ``max(0, 1 - beta z)``; ipo: ``(z - 1 / (2 beta))^2``;

plus ``cpo_alpha`` x the chosen completion's mean NLL (CPO's behaviour-cloning term; 0 with
``loss: simpo`` is SimPO as its paper trains it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from ..config import ObjectiveConfig
from .preference import Preference, pair_metrics


@dataclass
class CPOConfig(ObjectiveConfig):
    """Contrastive preference optimisation (and SimPO with ``loss: simpo``): the chosen
    completion made likelier than the rejected one, with no reference policy."""

    type: str = "cpo"
    """This objective."""
    loss: Literal["sigmoid", "simpo", "hinge", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta (c - r)) on summed log-probs; simpo: the same on log-probs
    averaged over each completion's tokens, less the margin simpo_gamma / beta; hinge: max(0,
    1 - beta (c - r)); ipo: (c - r - 1/(2 beta))^2 on averaged log-probs."""
    beta: float = 0.1
    """Scale of the implicit rewards beta x log-prob (SimPO's paper uses 2 to 2.5)."""
    label_smoothing: float = 0.0
    """sigmoid and simpo: the assumed share of pairs whose preference is wrong (0 to 0.5)."""
    cpo_alpha: float = 1.0
    """Weight of the chosen completion's NLL (its mean over the completion's tokens) added to
    each pair's loss; 0: none (SimPO)."""
    simpo_gamma: float = 0.5
    """simpo: the target margin between the chosen and rejected rewards."""

    def checks(self) -> tuple:
        return (
            (self.beta > 0, "beta", "greater than 0"),
            (0 <= self.label_smoothing < 0.5, "label_smoothing", "in [0, 0.5)"),
            (self.cpo_alpha >= 0, "cpo_alpha", "at least 0"),
            (self.simpo_gamma >= 0, "simpo_gamma", "at least 0"),
            (
                self.loss in ("sigmoid", "simpo") or not self.label_smoothing,
                "label_smoothing",
                f"0 with loss {self.loss} (it applies to the sigmoid and simpo losses)",
            ),
        )


class CPO(Preference):
    """CPO / SimPO on pairs; counts pairs."""

    name = "cpo"
    Config = CPOConfig

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        cfg = self.config
        valid, lengths = batch["valid"], batch["lengths"]
        summed = self.sequence_logps(batch)
        logps = summed / lengths if cfg.loss in ("simpo", "ipo") else summed
        z = logps[:, 0] - logps[:, 1]
        beta, eps = cfg.beta, cfg.label_smoothing
        if cfg.loss in ("sigmoid", "simpo"):
            if cfg.loss == "simpo":
                z = z - cfg.simpo_gamma / beta
            losses = -nn.log_sigmoid(beta * z) * (1 - eps) - nn.log_sigmoid(-beta * z) * eps
        elif cfg.loss == "hinge":
            losses = mx.maximum(1 - beta * z, 0)
        else:  # ipo
            losses = mx.square(z - 1 / (2 * beta))
        # logps/*: the log-probs the loss compares (averaged over the completion's tokens under
        # simpo and ipo), as TRL's CPOTrainer reports them
        metrics = pair_metrics(
            beta * logps[:, 0], beta * logps[:, 1], logps[:, 0], logps[:, 1], valid
        )
        if cfg.cpo_alpha:
            nll = -summed[:, 0] / lengths[:, 0]
            losses = losses + cfg.cpo_alpha * nll
            metrics["nll_loss"] = mx.sum(mx.stop_gradient(nll) * valid)
        return mx.sum(losses * valid), mx.sum(valid).astype(mx.int32), metrics


__all__ = ["CPO", "CPOConfig"]
