"""Fused training kernels, behind fixed entry points.

``linear_cross_entropy(hidden, weight, targets, ...)`` is the LM head and the cross-entropy in
one call. Each tier computes the same thing: "reference" is the naive MLX form (it builds the
[N, V] logits), the tier every other one is tested against; "chunked" is portable MLX that
never builds them (see chunked.py).
"""

from __future__ import annotations

import os

import mlx.core as mx

from .chunked import linear_cross_entropy_chunked
from .flash import attention_chunked, attention_reference
from .reference import linear_cross_entropy_reference

IMPLS = {"reference": linear_cross_entropy_reference, "chunked": linear_cross_entropy_chunked}
ATTENTION_IMPLS = {"reference": attention_reference, "chunked": attention_chunked}


def available_impls() -> list[str]:
    """Tiers of linear_cross_entropy that run on this machine."""
    return list(IMPLS)


def best_impl() -> str:
    """The tier ``impl=None`` uses on this device."""
    return "chunked"


def _pick(impl: str | None, impls: dict = IMPLS, what: str = "linear_cross_entropy") -> str:
    impl = impl or os.environ.get("MLXTUNE_KERNELS") or best_impl()
    if impl not in impls:
        raise ValueError(f"{what} impl {impl!r} is not available here; choose from {list(impls)}")
    return impl


def linear_cross_entropy(
    hidden: mx.array,
    weight: mx.array,
    targets: mx.array,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    reduction: str = "sum",
    impl: str | None = None,
    weight_grad: bool = True,
) -> tuple[mx.array, mx.array]:
    # impl: None (MLXTUNE_KERNELS, else the best tier here), "reference" or "chunked".
    """Cross-entropy of ``hidden @ weight.T`` against ``targets``: (loss, n_valid).

    hidden [N, D], weight [V, D] (the LM head), targets [N] int. Targets equal to
    ``ignore_index`` contribute nothing. ``reduction="sum"`` gives the loss summed over valid
    tokens; "mean" divides by their count; "none" gives [N] per-token losses (0 where ignored).
    ``label_smoothing`` mixes the one-hot target with the uniform distribution; ``softcap``
    applies ``c * tanh(z / c)`` to the logits first. Accumulates in fp32 whatever the dtype.
    ``weight_grad=False`` says the head is frozen: tiers that compute gradients themselves skip
    the head's (it comes back as zeros), saving a matmul per chunk in the backward.
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if hidden.ndim != 2 or weight.ndim != 2 or targets.ndim != 1:
        raise ValueError("expected hidden [N, D], weight [V, D] and targets [N]")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shapes do not match: hidden {hidden.shape}, weight {weight.shape}, targets {targets.shape}"
        )
    fn = IMPLS[_pick(impl)]
    losses, valid = fn(
        hidden, weight, targets, ignore_index, label_smoothing, softcap, weight_grad=weight_grad
    )
    n_valid = valid.sum()
    if reduction == "none":
        return losses, n_valid
    total = losses.sum()
    if reduction == "mean":
        total = total / mx.maximum(n_valid, 1).astype(total.dtype)
    return total, n_valid


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool = True,
    segment_ids: mx.array | None = None,
    impl: str | None = None,
) -> mx.array:
    """Scaled dot-product attention, [B, Hq, T, Dh] out.

    q [B, Hq, T, Dh], k and v [B, Hkv, T, Dh] with Hq a multiple of Hkv (grouped-query attention).
    ``segment_ids`` [B, T] keeps packed sequences apart: a query sees only keys of its own segment
    (and, with ``causal``, not after itself). The chunked tier saves the per-row logsumexp and
    recomputes probabilities block by block in the backward, never building [T, T] scores.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            f"expected q [B, Hq, T, Dh] and k, v [B, Hkv, T, Dh]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {q.shape} does not fit k/v {k.shape} (Hq must be a multiple of Hkv)")
    if segment_ids is not None and segment_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"segment_ids must be [B, T] = {(q.shape[0], q.shape[2])}, got {segment_ids.shape}"
        )
    fn = ATTENTION_IMPLS[_pick(impl, ATTENTION_IMPLS, "attention")]
    return fn(q, k, v, scale, causal, segment_ids)


__all__ = ["attention", "available_impls", "linear_cross_entropy"]
