"""Supervised fine-tuning: next-token cross-entropy over the target tokens (the completion, the
assistant's turns, or every token of plain text), in length-bucketed batches or packed rows."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..data import eval_batches, iterate_batches, iterate_packed, packed_epoch
from ..errors import UserInputError
from ..models import packing_refusal
from .base import Objective


class SFT(Objective):
    """Summed cross-entropy over target tokens, counted in tokens; evaluation gives the
    token-weighted validation loss and its perplexity."""

    name = "sft"

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        d = recipe.data
        self.packing = d.packing
        self.pack_length = d.pack_length or d.max_length
        if self.packing != "off":
            why = packing_refusal(components.model, components.lm, components.tiers["attention"])
            if why is not None:
                raise UserInputError(f"{why}; use packing: off", "data.packing")

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        loss, n = self.token_losses(batch, label_smoothing=self.recipe.train.label_smoothing)
        return loss, n, {}

    def sampled_loss(self, model: nn.Module, batch: dict[str, mx.array]):
        """Cross-entropy at the target positions against next tokens drawn from the model's
        own (softcapped) distribution there, with the global random state; no gradient flows
        through the draw: (sum, count). Sophia's curvature estimate needs it; an objective
        without one cannot use Sophia."""
        h = self.hidden(batch)
        lm = self.components.lm
        logits = mx.stop_gradient(lm.logits(h))
        drawn = mx.random.categorical(logits).astype(batch["tokens"].dtype)
        return self.token_losses({**batch, "labels": drawn}, hidden=h)

    def batches(self, start_epoch: int = 0, skip: int = 0):
        r, t, c = self.recipe, self.recipe.train, self.components
        if self.packing != "off":
            return iterate_packed(
                c.train_set,
                t.batch_size,
                c.pad_id,
                self.packing,
                self.pack_length,
                t.seed,
                r.data.mask_boundary_loss,
                start_epoch=start_epoch,
                skip=skip,
            )
        return iterate_batches(
            c.train_set,
            t.batch_size,
            c.pad_id,
            r.data.pad_to_multiple,
            t.seed,
            r.data.bucket_size,
            start_epoch=start_epoch,
            skip=skip,
        )

    def per_step(self, n: int) -> str:
        """Packed, a step holds ``n`` rows of several examples each: say both."""
        if self.packing == "off":
            return super().per_step(n)
        c = self.components
        rows = packed_epoch(c.train_set, self.packing, self.pack_length, self.recipe.train.seed, 0)
        per_row = len(c.train_set) / max(len(rows), 1)
        return f"{n} packed rows/step (about {n * per_row:.0f} examples)"

    def batches_per_epoch(self) -> int:
        t, c = self.recipe.train, self.components
        if self.packing != "off":
            rows = packed_epoch(c.train_set, self.packing, self.pack_length, t.seed, 0)
            return math.ceil(len(rows) / t.batch_size)
        return math.ceil(len(c.train_set) / t.batch_size)

    def eval_batches(self):
        r = self.recipe
        return eval_batches(
            self.components.valid_set,
            r.eval.batch_size or r.train.batch_size,
            self.components.pad_id,
            r.data.pad_to_multiple,
            r.eval.max_batches,
        )
