"""Mixed precision: fp32 master weights, loss scaling and guarded updates.

The model computes in ``model.dtype``. Every 16-bit trainable weight gets an fp32 master copy;
the optimizer updates the masters (so its state is fp32 too) and the model receives them cast
back. The loss is multiplied by ``scale / tokens`` before the backward pass, so the gradients
arrive already divided by the step's token count and scaled; they are unscaled in fp32 before
clipping. A step whose loss or gradients are not finite changes nothing: weights, masters and
optimizer state are selected back to their values before the step, inside the compiled graph.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

SIXTEEN_BIT = (mx.bfloat16, mx.float16)


def scaling_mode(precision, dtype: str) -> str:
    """ "dynamic", "static" or "none" for a recipe's precision section and model dtype."""
    if precision.loss_scale == "auto":
        return "dynamic" if dtype == "float16" else "none"
    return precision.loss_scale


def make_masters(params: dict, enabled: bool) -> dict | None:
    """fp32 copies of the 16-bit leaves of ``params`` (fp32 leaves are shared, not copied), or
    None when no copy is needed."""
    if not enabled or not any(v.dtype in SIXTEEN_BIT for _, v in tree_flatten(params)):
        return None
    return tree_map(lambda p: p.astype(mx.float32) if p.dtype in SIXTEEN_BIT else p, params)


def snapshot(tree):
    """New containers holding the same arrays, to put back with ``select_into``."""
    return tree_map(lambda x: x, tree)


def select_into(tree, old, ok: mx.array | None = None) -> None:
    """In place, leaf by leaf: ``where(ok, leaf, old_leaf)``, or the old leaf itself when ``ok``
    is None (a step that failed left the state pointing at results never computed). Leaves that
    ``old`` lacks (optimizer state created by the first step) are kept."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in list(items):
        o = old.get(k) if isinstance(old, dict) else (old[k] if k < len(old) else None)
        if isinstance(v, mx.array):
            if isinstance(o, mx.array):
                tree[k] = o if ok is None else mx.where(ok, v, o)
        elif isinstance(v, (dict, list)) and o is not None:
            select_into(v, o, ok)


def update_scale(
    scaler: dict, ok: mx.array, growth: float, backoff: float, interval: int, min_scale: float
) -> None:
    """Dynamic loss scaling, in place on ``{"scale", "good"}``: after ``interval`` finite steps in
    a row the scale grows by ``growth``; a non-finite step multiplies it by ``backoff`` (not
    below ``min_scale``) and starts the count again."""
    scale, good = scaler["scale"], scaler["good"]
    good = mx.where(ok, good + 1, 0)
    grow = good >= interval
    scaler["scale"] = mx.where(
        ok,
        mx.where(grow, scale * growth, scale),
        mx.maximum(scale * backoff, min_scale),
    ).astype(mx.float32)
    scaler["good"] = mx.where(grow, 0, good).astype(mx.int32)


def all_finite(loss: mx.array, sq_norm: mx.array) -> mx.array:
    """True when the loss and the squared gradient norm are finite (a NaN or inf anywhere in the
    gradients makes their squared norm non-finite)."""
    return mx.logical_and(mx.isfinite(loss), mx.isfinite(sq_norm))
