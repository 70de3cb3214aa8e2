"""Patches of mlx-lm's model modules, active inside a ``with`` block: attention through
mlxtune's kernel tiers (packed segments kept apart), the gated delta rule of hybrid models
chunkwise (``kernels.delta``), and the CPU's faster swiglu."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention, cpu, delta, flash
from .context import current


class kernel_attention:
    """Route a model's training attention through ``mlxtune.kernels.attention`` while active.

    mlx-lm's families call a module-level ``scaled_dot_product_attention`` (imported from
    ``mlx_lm.models.base`` into each family's module); inside this context that name, in every
    module the model's layers come from, is a wrapper that sends the training case (no KV
    cache, a plain causal mask, no sinks) to the kernel tier and every other call (generation
    with a cache, explicit masks, sinks) to mlx-lm's own function, packed segments kept apart
    there too. mlx-lm's files are not edited, and the originals are restored on exit. Families
    whose attention is their own code (gemma2's soft-capped scores) keep it.

    The families' ``gated_delta_update`` (Qwen3-Next, Qwen3.5, Kimi-Linear...: a loop of one
    step a position while training, in mlx-lm) becomes ``kernels.delta.gated_delta_update``,
    the chunkwise form, its state restarting where a packed example starts.

    On the CPU, unless the tier is "reference", the modules' ``swiglu`` becomes
    ``kernels.cpu.swiglu`` too: the same function with an exponential that MLX's CPU backend
    vectorises (see kernels/cpu.py).
    """

    def __init__(self, model: nn.Module, impl: str | None = None):
        names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
        self.modules = [sys.modules[n] for n in sorted(names) if n in sys.modules]
        self.impl = impl
        # the attention layers a step's graph holds (the chunked tier sizes its slabs by them)
        self.layers = len(getattr(model, "layers", None) or []) or None
        self._graphs: list = []
        # mlx-lm's own functions, also when another kernel_attention is active around this one
        self.originals = {
            id(mod): (
                _unpatched(getattr(mod, "scaled_dot_product_attention", None)),
                _unpatched(getattr(mod, "swiglu", None)),
                _unpatched(getattr(mod, "gated_delta_update", None)),
            )
            for mod in self.modules
        }
        self._saved: list[list] = []  # what each __enter__ found, for its __exit__
        self._conv_classes: list[list] = []
        # in a model whose recurrence is routed, its short convolutions (before the gated
        # delta rule): packed examples kept apart in them too
        routed = any(gdu is not None for _, _, gdu in self.originals.values())
        self.convs = [m for _, m in model.named_modules() if routed and isinstance(m, nn.Conv1d)]

    @property
    def active(self) -> bool:
        """Whether any of the model's modules calls an attention this context routes."""
        return any(sdpa is not None for sdpa, _, _ in self.originals.values())

    def __enter__(self):
        graph = flash.graph_layers(self.layers)
        graph.__enter__()
        self._graphs.append(graph)
        self._saved.append(
            [
                (
                    mod,
                    getattr(mod, "scaled_dot_product_attention", None),
                    getattr(mod, "swiglu", None),
                    getattr(mod, "gated_delta_update", None),
                )
                for mod in self.modules
            ]
        )
        self._conv_classes.append([conv.__class__ for conv in self.convs])
        for conv in self.convs:
            conv.__class__ = SegmentedConv1d
        for mod in self.modules:
            original, original_swiglu, original_delta = self.originals[id(mod)]
            if original_delta is not None:
                mod.gated_delta_update = _chunked_delta(original_delta)
            if original is not None:
                mod.scaled_dot_product_attention = _routed(original, self.impl)
            if original_swiglu is not None:
                if self.impl != "reference" and mx.default_device() == mx.cpu:

                    def swiglu(gate, x):
                        return cpu.swiglu(gate, x)

                    swiglu._mlxtune_original = original_swiglu
                    mod.swiglu = swiglu
                else:  # the naive tier keeps mlx-lm's, inside another kernel_attention too
                    mod.swiglu = original_swiglu
        return self

    def __exit__(self, *exc):
        self._graphs.pop().__exit__(*exc)
        for conv, cls in zip(self.convs, self._conv_classes.pop(), strict=True):
            conv.__class__ = cls
        for mod, sdpa, swiglu, gdu in self._saved.pop():
            if sdpa is not None:
                mod.scaled_dot_product_attention = sdpa
            if swiglu is not None:
                mod.swiglu = swiglu
            if gdu is not None:
                mod.gated_delta_update = gdu
        return False


def _routed(original, impl):
    """mlx-lm's ``scaled_dot_product_attention`` with the training case sent to the kernels."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        if (
            cache is None
            and sinks is None
            and not kwargs
            and isinstance(mask, str)
            and mask == "causal"
            and queries.shape[-1] == values.shape[-1]
        ):
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
        if cache is None and seg is not None:
            # packed examples stay apart here too: a causal or explicit mask (a sliding window)
            # gets the segments' block-diagonal added
            same = (seg[:, :, None] == seg[:, None, :])[:, None]
            t = queries.shape[-2]
            if isinstance(mask, str) or mask is None:
                causal = mx.tril(mx.ones((t, t), dtype=mx.bool_)) if mask == "causal" else True
                mask = same & causal
            elif mask.dtype == mx.bool_:
                mask = mask & same
            else:  # additive
                mask = mx.where(same, mask, mx.array(-mx.inf, dtype=mask.dtype))
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs)

    sdpa._mlxtune_original = original
    return sdpa


class SegmentedConv1d(nn.Conv1d):
    """A linear-attention layer's depthwise ``conv1d`` while its recurrence is routed: with
    packed segments in the forward context, its taps stay within each example
    (``kernels.delta.segmented_causal_conv``); otherwise it is the layer's own convolution."""

    def __call__(self, x):
        seg = current().segment_ids
        taps = self.weight.shape[1]
        if (
            seg is None
            or self.groups != self.weight.shape[0]
            or self.stride != 1
            or self.dilation != 1
            or self.padding != 0
            or x.shape[1] != seg.shape[1] + taps - 1
        ):
            return super().__call__(x)
        y = delta.segmented_causal_conv(x, self.weight, seg)
        return y + self.bias if "bias" in self else y


def _chunked_delta(original):
    """mlx-lm's ``gated_delta_update`` computed chunkwise, packed examples kept apart."""

    def update(*args, **kwargs):
        return delta.gated_delta_update(*args, segment_ids=current().segment_ids, **kwargs)

    update._mlxtune_original = original
    return update


def _unpatched(fn):
    """mlx-lm's function behind a kernel_attention replacement (fn itself when it is not one)."""
    return getattr(fn, "_mlxtune_original", fn)
