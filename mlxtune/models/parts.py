"""A model split into its backbone and LM head, so the loss never needs the full logits."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UserInputError
from .common import SUPPORTED
from .quantize import dense_weight, is_quantized


@dataclass
class LMParts:
    """What the loss needs from a model: hidden states, the head weight, and a softcap."""

    model: nn.Module

    def hidden(self, inputs: mx.array) -> mx.array:
        """Final hidden states [B, T, D] (after the last norm), before the LM head."""
        return self.model.model(inputs)

    def head_weight(self) -> mx.array:
        """The LM head as a [V, D] matrix (de-quantized when the head is quantized)."""
        m = self.model
        head = getattr(m, "lm_head", None)
        if head is None:
            head = m.model.embed_tokens
        return dense_weight(head)

    @property
    def softcap(self) -> float | None:
        return getattr(self.model, "final_logit_softcapping", None)


def lm_parts(model: nn.Module) -> LMParts:
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in SUPPORTED or not hasattr(getattr(model, "model", None), "embed_tokens"):
        raise UserInputError(
            f"model type {model_type!r} is not supported for training yet; supported: {', '.join(SUPPORTED)}",
            "model",
        )
    return LMParts(model)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; a quantized layer counts its weight's logical
    entries (not its packed words, scales and offsets)."""
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    for _, m in model.named_modules():
        if is_quantized(m):
            packed = m.weight.size + m.scales.size + (m.biases.size if "biases" in m else 0)
            total += m.weight.size * 32 // m.bits - packed
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return trainable, total
