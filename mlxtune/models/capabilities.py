"""What a loaded model can do in training, read off the model itself rather than a list of
families: whether packed examples stay apart in it, which of its layers carry state along the
sequence, and the shape of its gated delta layers (for the memory plan)."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from ..kernels import delta
from . import patches
from .context import segments
from .parts import LMParts, family_name
from .patches import kernel_attention


def recurrent_caches(model: nn.Module) -> list[str]:
    """The kinds of cache the model keeps for layers that carry state along the sequence
    (conv or SSM state: anything but keys and values), by class name."""
    from mlx_lm.models.cache import ArraysCache

    make = getattr(model, "make_cache", None)
    if make is None:
        return []

    def leaves(c):  # a CacheList holds a layer's several caches
        inner = getattr(c, "caches", None)
        return [x for i in inner for x in leaves(i)] if isinstance(inner, (list, tuple)) else [c]

    kinds = [
        type(leaf).__name__
        for cache in make()
        for leaf in leaves(cache)
        if isinstance(leaf, ArraysCache)
    ]
    return sorted(set(kinds))


def packing_refusal(model: nn.Module, lm: LMParts, tier: str | None = None) -> str | None:
    """Why packed rows cannot train this model (None when they can): packed examples must
    give the hidden states each gives alone, which a layer carrying state along the sequence,
    or attention that does not go through mlxtune's routed function, would break. Checked on
    two short examples packed into one row. A layer carrying state passes where mlxtune
    restarts its state per example (the gated delta rule, Mamba-2's SSD, and their
    convolutions)."""
    family = family_name(model)
    state = recurrent_caches(model)
    carries = (
        f"{family} has layers that carry state along the sequence ({', '.join(state)}), "
        "which would flow from one packed example into the next"
    )
    route = kernel_attention(model, None if tier == "off" else tier)
    if not route.active:
        return (
            carries
            if state
            else f"{family}'s attention does not go through a function mlxtune can route"
        )
    a, b = [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9]
    was_training = model.training
    model.eval()
    try:
        with route:
            with segments(mx.array([[1] * len(a) + [2] * len(b)])):
                packed = lm.hidden(mx.array([a + b]))
            alone = mx.concatenate([lm.hidden(mx.array([a])), lm.hidden(mx.array([b]))], axis=1)
    finally:
        model.train(was_training)
    tol = 1e-4 if packed.dtype == mx.float32 else 5e-2
    packed, alone = packed.astype(mx.float32), alone.astype(mx.float32)
    err = mx.abs(packed - alone).max().item()
    if err > tol * max(mx.abs(alone).max().item(), 1e-6):
        if state and not route.restarts:  # a recurrence mlxtune does not restart per example
            return carries
        return (
            f"in {family}, packed examples do not give what each gives alone (its attention "
            "or its positions reach across them)"
        )
    return None


def kernel_attention_share(model: nn.Module, lm: LMParts) -> tuple[int, int]:
    """(attention calls of a training forward that mlxtune's kernel tier computes, all calls of
    mlx-lm's attention function in it). A family's own attention code (gemma2's soft-capped
    scores) counts in neither; calls with sinks or an explicit mask count only in the second."""
    calls = {"kernel": 0, "all": 0}
    kernel = patches.attention

    def counted(*a, **kw):
        calls["kernel"] += 1
        return kernel(*a, **kw)

    route = kernel_attention(model)
    was_training = model.training
    model.eval()
    patches.attention = counted
    try:
        with route:
            for mod in route.modules:
                routed = getattr(mod, "scaled_dot_product_attention", None)
                if getattr(routed, "_mlxtune_original", None) is None:
                    continue

                def spy(*a, _routed=routed, **kw):
                    calls["all"] += 1
                    return _routed(*a, **kw)

                mod.scaled_dot_product_attention = spy
            mx.eval(lm.hidden(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])))
    finally:
        patches.attention = kernel
        model.train(was_training)
    return calls["kernel"], calls["all"]


def delta_layout(model: nn.Module, cfg: dict) -> dict:
    """The Shape fields of a model's chunkwise recurrent layers (none: {}): the modules holding
    the decay rates (``A_log``, ``dt_bias``) in a family module that calls the gated delta rule
    or Mamba-2's SSD, and Bailing's linear attention layers; ``delta_token`` is their mean
    per-token count (``saved_per_token``)."""

    def calling(name):
        return [
            m
            for _, m in model.named_modules()
            if "A_log" in m
            and "dt_bias" in m
            and hasattr(sys.modules.get(type(m).__module__), name)
        ]

    per_layer = []
    layers = calling("gated_delta_update")
    lac = cfg.get("linear_attn_config") or {}  # Kimi-Linear's
    hv = int(
        lac.get("num_heads")
        or cfg.get("linear_num_value_heads")
        or cfg.get("num_attention_heads")
        or 0
    )
    dk = int(lac.get("head_dim") or cfg.get("linear_key_head_dim") or cfg.get("head_dim") or 0)
    dv = int(cfg.get("linear_value_head_dim") or dk)
    if layers and hv and dk:
        vector = layers[0]["dt_bias"].size > hv  # a rate per key dimension (Kimi-Linear)
        per_layer += [delta.saved_per_token(hv, dk, dv, vector)] * len(layers)
    for m in calling("ssm_update"):  # Mamba-2's SSD: heads of Dh x N states
        heads = m["A_log"].size
        n = getattr(m, "ssm_state_size", None) or getattr(m, "d_state", None)
        dh = getattr(m, "intermediate_size", 0) // heads
        if n and dh:
            per_layer.append(delta.saved_per_token(heads, int(n), dh, delta=False))
    for m in model.modules():  # Bailing's linear attention: a fixed decay a head
        mod = sys.modules.get(type(m).__module__)
        if hasattr(mod, "recurrent_gla") and hasattr(m, "_slope"):
            heads, dh = int(m.num_attention_heads), int(m.head_dim)
            per_layer.append(delta.saved_per_token(heads, dh, dh, delta=False))
    if not per_layer:
        return {}
    return {"delta_layers": len(per_layer), "delta_token": -(-sum(per_layer) // len(per_layer))}
