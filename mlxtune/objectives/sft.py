"""Supervised fine-tuning: next-token cross-entropy over the target tokens (the completion, the
assistant's turns, or every token of plain text), in length-bucketed batches or packed rows."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import SFTConfig
from ..data import Batch, eval_batches, iterate_batches, iterate_packed, packed_epoch
from ..errors import UserInputError
from ..models.moe import experts_per_token, load_balancing_loss, router_logits, router_paths
from .base import Objective


class SFT(Objective):
    """Summed cross-entropy over target tokens, counted in tokens; evaluation gives the
    token-weighted validation loss and its perplexity."""

    name = "sft"
    Config = SFTConfig

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        d = recipe.data
        self.packing = d.packing
        self.pack_length = d.pack_length or d.max_length
        if self.packing != "off":
            self.refuse_packing_the_model_cannot_keep_apart()
        self.dft = getattr(self.config, "loss", "ce") == "dft"
        if self.dft and recipe.train.label_smoothing:
            raise UserInputError(
                "dft scales each token's cross-entropy by the token's probability; a smoothed "
                "cross-entropy is no log-probability: use one or the other",
                "train.label_smoothing",
            )
        self.aux_coef = getattr(self.config, "router_aux_loss_coef", 0.0)
        if self.aux_coef:
            self.routers = router_paths(components.model)
            self.top_k = experts_per_token(components.model)
            if not self.routers or self.top_k is None:
                raise UserInputError(
                    "a router load-balancing loss needs a mixture-of-experts model"
                    + (" (no router found)" if not self.routers else " (no num_experts_per_tok)"),
                    "objective.router_aux_loss_coef",
                )

    def arrays(self, batch: Batch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        if self.aux_coef:  # the positions that hold tokens (not padding): the routers' load
            if batch.segments is not None:
                read = batch.segments > 0
            else:
                read = np.arange(batch.tokens.shape[1])[None, :] < np.array(batch.lengths)[:, None]
            out["read"] = read.astype(np.int32)
        return out

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        smoothing = self.recipe.train.label_smoothing
        if not self.aux_coef:
            return self._cross_entropy(model, batch, smoothing)
        with router_logits(model, self.routers) as logits:
            h = self.hidden(batch)
        loss, n, metrics = self._cross_entropy(model, batch, smoothing, hidden=h)
        aux = load_balancing_loss(logits, self.top_k, batch["read"][:, :-1])
        # the step divides by the token count: the mean cross-entropy + coef x aux; evaluation
        # (the model in eval mode) keeps the cross-entropy alone, its perplexity a perplexity
        weighted = aux * n.astype(mx.float32)
        if model.training:
            loss = loss + self.aux_coef * weighted
        return loss, n, {**metrics, "router_aux_loss": weighted}

    def _cross_entropy(self, model, batch, smoothing, hidden=None):
        """(loss sum, target count, metrics): the summed cross-entropy, or with ``loss: dft``
        while training each token's scaled by its detached probability, with the plain sum
        logged as ``nll`` (evaluation keeps the plain sum)."""
        if not (self.dft and model.training):
            loss, n = self.token_losses(batch, label_smoothing=smoothing, hidden=hidden)
            return loss, n, {}
        per, n = self.token_losses(batch, reduction="none", hidden=hidden)
        p = mx.stop_gradient(mx.exp(-per))  # off-target positions: loss 0, so they add 0
        return mx.sum(p * per), n, {"nll": mx.stop_gradient(mx.sum(per))}

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
        if getattr(c.train_set, "streamed", False):  # from where its state says
            return c.train_set.batches(
                t.batch_size,
                c.pad_id,
                r.data.pad_to_multiple,
                t.seed,
                r.data.bucket_size,
                self.packing,
                self.pack_length,
                r.data.mask_boundary_loss,
            )
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
        if getattr(c.train_set, "streamed", False):
            return f"{n} packed rows/step"
        rows = packed_epoch(c.train_set, self.packing, self.pack_length, self.recipe.train.seed, 0)
        per_row = len(c.train_set) / max(len(rows), 1)
        return f"{n} packed rows/step (about {n * per_row:.0f} examples)"

    def batches_per_epoch(self) -> int | None:
        t, c = self.recipe.train, self.components
        if getattr(c.train_set, "streamed", False):
            return None  # known once the stream has been read
        if self.packing != "off":
            rows = packed_epoch(c.train_set, self.packing, self.pack_length, t.seed, 0)
            return self.epoch_batches(len(rows))
        return self.epoch_batches(len(c.train_set))

    def eval_batches(self):
        return self.padded_eval_batches(eval_batches)
