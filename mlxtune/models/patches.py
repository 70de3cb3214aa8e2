"""Patches of mlx-lm's model modules, active inside a ``with`` block: attention through
mlxtune's kernel tiers (packed segments kept apart), and the CPU's faster swiglu."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention, cpu
from .context import current


class kernel_attention:
    """Route a model's training attention through ``mlxtune.kernels.attention`` while active.

    mlx-lm's llama, qwen2, qwen3, gemma and phi3 modules call a module-level
    ``scaled_dot_product_attention``; inside this context that name is a wrapper that sends
    the training case (no KV cache, a plain causal mask, no sinks) to the kernel tier and every
    other call (generation with a cache, explicit masks) to mlx-lm's own function. mlx-lm's files
    are not edited, and the original is restored on exit. Families whose attention is their own
    code (gemma2's soft-capped scores) keep it.

    On the CPU, unless the tier is "reference", the modules' ``swiglu`` (llama, qwen2, qwen3,
    phi3) becomes ``kernels.cpu.swiglu`` too: the same function with an exponential that MLX's
    CPU backend vectorises (see kernels/cpu.py).
    """

    def __init__(self, model: nn.Module, impl: str | None = None):
        self.module = sys.modules[type(model).__module__]
        self.impl = impl
        # mlx-lm's own functions, also when another kernel_attention is active around this one
        self.original = _unpatched(getattr(self.module, "scaled_dot_product_attention", None))
        self.original_swiglu = _unpatched(getattr(self.module, "swiglu", None))
        self._saved: list[tuple] = []  # what each __enter__ found, for its __exit__

    @property
    def active(self) -> bool:
        return self.original is not None

    def __enter__(self):
        self._saved.append(
            (
                getattr(self.module, "scaled_dot_product_attention", None),
                getattr(self.module, "swiglu", None),
            )
        )
        if self.original is None:
            return self
        original, impl = self.original, self.impl

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            if cache is None and sinks is None and isinstance(mask, str) and mask == "causal":
                return attention(
                    queries,
                    keys,
                    values,
                    scale=scale,
                    causal=True,
                    segment_ids=current().segment_ids,
                    impl=impl,
                )
            seg = current().segment_ids
            if cache is None and seg is not None and mask is not None and not isinstance(mask, str):
                # an explicit mask (a sliding-window layer): packed examples stay apart there too
                same = (seg[:, :, None] == seg[:, None, :])[:, None]
                if mask.dtype == mx.bool_:
                    mask = mask & same
                else:  # additive
                    mask = mx.where(same, mask, mx.array(-mx.inf, dtype=mask.dtype))
            if sinks is None:
                return original(queries, keys, values, cache, scale=scale, mask=mask)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

        sdpa._mlxtune_original = original
        self.module.scaled_dot_product_attention = sdpa
        if self.original_swiglu is not None:
            if self.impl != "reference" and mx.default_device() == mx.cpu:

                def swiglu(gate, x):
                    return cpu.swiglu(gate, x)

                swiglu._mlxtune_original = self.original_swiglu
                self.module.swiglu = swiglu
            else:  # the naive tier keeps mlx-lm's, inside another kernel_attention too
                self.module.swiglu = self.original_swiglu
        return self

    def __exit__(self, *exc):
        sdpa, swiglu = self._saved.pop()
        if sdpa is not None:
            self.module.scaled_dot_product_attention = sdpa
        if swiglu is not None:
            self.module.swiglu = swiglu
        return False


def _unpatched(fn):
    """mlx-lm's function behind a kernel_attention replacement (fn itself when it is not one)."""
    return getattr(fn, "_mlxtune_original", fn)
