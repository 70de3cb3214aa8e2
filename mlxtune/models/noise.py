"""NEFTune: uniform noise added to the token embeddings while training (Jain et al., 2023), which
makes instruction tuning less prone to memorising its answers' exact wording.

Each entry of a [B, T, D] embedding output gets ``alpha / sqrt(T D) x U(-1, 1)``, ``T`` the
batch's row length (padding and packing included, as Hugging Face's trainers count it). Only in
training mode: evaluation, generation and exports see the embeddings as they are. The draws come
from the forward context's key where the engine sets one (data-parallel ranks: a key of their
own), else from MLX's global random state, which checkpoints keep.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserInputError
from .context import current
from .parts import lm_parts, module_at


class _Noisy:
    """Mixed into an embedding's class: its output, plus NEFTune's noise while training."""

    neftune_alpha: float

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        if not self.training or y.ndim < 2:
            return y
        t, d = y.shape[-2], y.shape[-1]
        bound = self.neftune_alpha / math.sqrt(t * d)
        keys = current().dropout_keys
        key = None if keys is None else keys.next()
        noise = mx.random.uniform(-bound, bound, y.shape, dtype=mx.float32, key=key)
        return (y.astype(mx.float32) + noise).astype(y.dtype)


def add_embedding_noise(model: nn.Module, alpha: float, path: str | None = None) -> nn.Module:
    """Turn NEFTune on for ``model``'s token embedding (at ``named_modules`` path ``path``;
    by default the one its forward pass reads the tokens with), in place; the embedding keeps
    its weights and their names. Returns the embedding."""
    if path is None:
        path = lm_parts(model).embed_path
    if path is None:
        raise UserInputError(
            "NEFTune needs a token embedding, and this model reads none",
            "train.neftune_noise_alpha",
        )
    emb = module_at(model, path)
    cls = type(emb)
    if not issubclass(cls, _Noisy):
        emb.__class__ = type(f"Noisy{cls.__name__}", (_Noisy, cls), {})
    emb.neftune_alpha = float(alpha)
    return emb


def has_embedding_noise(model: nn.Module) -> bool:
    """Whether ``model``'s forward draws NEFTune noise (in training mode)."""
    return any(isinstance(m, _Noisy) for _, m in model.named_modules())


__all__ = ["add_embedding_noise", "has_embedding_noise"]
