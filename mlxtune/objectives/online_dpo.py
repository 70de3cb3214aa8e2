"""Online DPO: DPO on pairs the policy writes as it trains. Each step's prompts are completed twice
by the policy as it is; the recipe's reward functions score both, the higher one is the pair's
chosen completion, and the pair trains with DPO's loss against the reference policy:

    -log sigmoid(beta ((p_c - q_c) - (p_r - q_r)))      (ipo: (that margin - 1/(2 beta))^2)

``p`` a completion's log-probability under the policy, ``q`` under the reference (summed over
its tokens; averaged over them for ipo). A pair whose two completions score the same teaches no
preference and counts nothing (``frac_ties``); ``missing_eos_penalty`` is taken off the score of
a completion that did not end before ``max_completion_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..data.prompts import PromptExample
from ..kernels import forward_only
from .online import OnPolicy, RLConfig
from .preference import pair_metrics
from .rollout import RolloutBatch, cut_rows, even_sizes, rows_of


@dataclass
class OnlineDPOConfig(RLConfig):
    """DPO on pairs of the policy's own completions, ranked by the reward functions."""

    type: str = "online_dpo"
    """This objective."""
    num_generations: int = 2
    """Completions a prompt: a pair (2, the only value)."""
    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the implicit rewards."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta x margin); ipo: (margin - 1/(2 beta))^2 on log-probs
    averaged over each completion's tokens."""
    missing_eos_penalty: float = 0.0
    """Taken off the score of a completion cut at max_completion_length before the pair is
    ranked."""

    def checks(self) -> tuple:
        return super().checks() + (
            (self.num_generations == 2, "num_generations", "2 (a pair a prompt)"),
            (self.beta > 0, "beta", "greater than 0"),
            (self.missing_eos_penalty >= 0, "missing_eos_penalty", "at least 0"),
        )


class OnlineDPO(OnPolicy):
    """Online DPO on prompt rows; counts pairs that are not ties."""

    name = "online_dpo"
    Config = OnlineDPOConfig
    offline_refusal = (
        "online DPO ranks its own completions: offline rows (responses and rewards) train with "
        "objective.type grpo, and fixed pairs with dpo"
    )

    def _kl_weight(self) -> float:
        return self.config.beta

    def per_step(self, n: int) -> str:
        return f"{n} prompts x 2 completions (a pair)/step"

    def _yields(self) -> int:
        return self.recipe.train.grad_accumulation  # one step a rollout

    def _steps_per_rollout(self) -> float:
        return 1

    # ------------------------------------------------------------------ rollouts
    def make_batch(self, prompts: list[PromptExample], seed: int) -> RolloutBatch:
        """Two completions a prompt, ranked by their scores (ties count nothing), with the
        reference's log-probs of their tokens."""
        ids, ended, groups, rewards, host = self.complete(prompts, seed)
        scores = rewards - self.config.missing_eos_penalty * ~np.array(ended)
        pair = scores.reshape(-1, 2)
        batch = self._rows(prompts, groups, ids, ended, None)
        kept = batch.mask[:, 1:].sum(axis=1).reshape(-1, 2).min(axis=1) > 0  # none masked out
        valid = (pair[:, 0] != pair[:, 1]) & kept
        first = np.where(pair[:, 0] > pair[:, 1], 1.0, -1.0)
        batch.side = np.stack([first, -first], axis=1).reshape(-1).astype(np.float32)
        batch.valid = np.repeat(valid, 2).astype(np.float32)
        host["frac_ties"] = (float((pair[:, 0] == pair[:, 1]).sum()), len(pair))
        batch.host = host
        with forward_only(), self._reference.active():
            batch.ref = self._passes(batch, self._target_logps)[0]
        return batch

    def arrays(self, batch: RolloutBatch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        out["ref"], out["side"], out["valid"] = batch.ref, batch.side, batch.valid
        return out

    # ------------------------------------------------------------------ the loss
    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        cfg = self.config
        tok, _ = self.token_losses(batch, reduction="none")
        m = (batch["mask"][:, 1:] > 0).astype(mx.float32)
        policy = mx.sum(-tok * m, axis=-1)  # [rows]: each completion's log-prob
        ref = mx.sum(batch["ref"] * m, axis=-1)
        kl = policy - ref
        if cfg.loss == "ipo":
            n = mx.maximum(mx.sum(m, axis=-1), 1.0)
            policy, ref = policy / n, ref / n
        h = (policy - ref).reshape(-1, 2)
        lp = policy.reshape(-1, 2)
        first = batch["side"].reshape(-1, 2)[:, 0] > 0
        valid = batch["valid"].reshape(-1, 2)[:, 0]
        chosen, rejected = mx.where(first, h[:, 0], h[:, 1]), mx.where(first, h[:, 1], h[:, 0])
        margin = chosen - rejected
        beta = cfg.beta
        if cfg.loss == "sigmoid":
            losses = -nn.log_sigmoid(beta * margin)
        else:
            losses = mx.square(margin - 1 / (2 * beta))
        lp_c, lp_r = mx.where(first, lp[:, 0], lp[:, 1]), mx.where(first, lp[:, 1], lp[:, 0])
        metrics = pair_metrics(beta * chosen, beta * rejected, lp_c, lp_r, valid)
        metrics["kl"] = mx.sum(mx.stop_gradient(kl).reshape(-1, 2).mean(axis=1) * valid)
        return mx.sum(losses * valid), mx.sum(valid).astype(mx.int32), metrics

    def count(self, batch: RolloutBatch) -> int:
        return int(batch.valid.sum()) // 2

    def units(self, batch: RolloutBatch) -> int:
        return len(batch.tokens) // 2

    # ------------------------------------------------------------------ passes and shares
    def micro_rows(self, positions: int) -> int:
        """Completions a training pass holds: whole pairs."""
        return max(2, super().micro_rows(positions) // 2 * 2)

    def micro(self, batch: RolloutBatch) -> list[RolloutBatch]:
        pairs, per = len(batch.tokens) // 2, self.micro_rows(batch.tokens.shape[1] - 1) // 2
        return self._pairs(batch, -(-pairs // per))

    def split(self, batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
        return self._pairs(batch, parts)

    def _pairs(self, batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
        """``batch`` in up to ``parts`` consecutive parts of whole pairs, as even as they come."""
        pairs = len(batch.tokens) // 2
        if parts <= 1 or pairs <= 1:
            return [batch]
        return cut_rows(batch, [2 * n for n in even_sizes(pairs, min(parts, pairs))])

    def nothing(self, batch: RolloutBatch) -> RolloutBatch:
        b = rows_of(batch, slice(0, 2), (2,), 0, False)
        b.mask = np.zeros_like(b.mask)
        b.n_targets = 0
        b.valid = np.zeros(2, np.float32)
        b.side = np.array([1.0, -1.0], np.float32)
        return b


__all__ = ["OnlineDPO", "OnlineDPOConfig"]
