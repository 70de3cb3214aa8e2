"""Patches of mlx-lm's model modules, active inside a ``with`` block: attention through
mlxtune's kernel tiers (packed segments kept apart), the gated delta rule of hybrid models
chunkwise (``kernels.delta``), the CPU's faster swiglu, and the mixtures whose training code
cannot be compiled in a form that can."""

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
    the chunkwise form, its state restarting where a packed example starts; Mamba-2's
    ``ssm_update`` (Nemotron-H, Falcon-H1, Granite 4 hybrids, PLaMo 2) becomes
    ``kernels.delta.ssd_update``, the same form without the delta correction.

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
            id(mod): {
                name: _unpatched(getattr(mod, name, None))
                for name in ("scaled_dot_product_attention", "swiglu", *RECURRENCES)
            }
            for mod in self.modules
        }
        self._saved: list[list] = []  # what each __enter__ found, for its __exit__
        self._conv_classes: list[list] = []
        self._mixture_classes: list[list] = []
        # the short causal convolutions (before the gated delta rule or the SSD, or alone as
        # in LFM2): packed examples kept apart in them too
        self.convs = [m for _, m in model.named_modules() if isinstance(m, nn.Conv1d)]
        # mixtures whose training forward reads the routing on the host (see COMPILABLE)
        self.mixtures = [
            m for _, m in model.named_modules() if _compilable_class(type(m)) is not None
        ]

    @property
    def restarts(self) -> bool:
        """Whether the model's recurrence (the gated delta rule, Mamba-2's SSD, Bailing's
        linear attention) is routed to the chunkwise form, which restarts its state where a
        packed example starts."""
        return any(f[n] is not None for f in self.originals.values() for n in RECURRENCES)

    @property
    def active(self) -> bool:
        """Whether any of the model's modules calls an attention or a recurrence this context
        routes."""
        return (
            self.restarts
            or bool(self.mixtures)
            or any(f["scaled_dot_product_attention"] is not None for f in self.originals.values())
        )

    def __enter__(self):
        graph = flash.graph_layers(self.layers)
        graph.__enter__()
        self._graphs.append(graph)
        self._saved.append([(mod, dict(vars(mod))) for mod in self.modules])
        self._conv_classes.append([conv.__class__ for conv in self.convs])
        for conv in self.convs:
            conv.__class__ = SegmentedConv1d
        self._mixture_classes.append([m.__class__ for m in self.mixtures])
        for m in self.mixtures:
            m.__class__ = _compilable_class(type(m))
        for mod in self.modules:
            found = self.originals[id(mod)]
            for name, chunked in RECURRENCES.items():
                if found[name] is not None:
                    setattr(mod, name, chunked(found[name]))
            if found["scaled_dot_product_attention"] is not None:
                mod.scaled_dot_product_attention = _routed(
                    found["scaled_dot_product_attention"], self.impl
                )
            original_swiglu = found["swiglu"]
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
        for m, cls in zip(self.mixtures, self._mixture_classes.pop(), strict=True):
            m.__class__ = cls
        for mod, found in self._saved.pop():
            for name in ("scaled_dot_product_attention", "swiglu", *RECURRENCES):
                if found.get(name) is not None:
                    setattr(mod, name, found[name])
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


def _chunked_ssd(original):
    """mlx-lm's ``ssm_update`` computed chunkwise, packed examples kept apart; a call with
    ``lengths`` (batched generation) keeps mlx-lm's."""

    def update(x, A_log, B, C, D, dt, dt_bias, state=None, limit=(0.001, 100.0), mask=None,
               lengths=None, **kwargs):  # fmt: skip
        args = (x, A_log, B, C, D, dt, dt_bias, state)
        if lengths is not None or kwargs:
            return original(*args, limit, mask, lengths, **kwargs)
        return delta.ssd_update(*args, limit, mask, segment_ids=current().segment_ids)

    update._mlxtune_original = original
    return update


def _chunked_gla(original):
    """mlx-lm's ``recurrent_gla`` (Bailing's linear attention: a fixed decay a head, no delta
    correction) computed chunkwise, packed examples kept apart. Its layout: q, k, v
    [B, H, T, D], the state h [B, H, Dk, Dv]; a padding ``mask`` [B, T] (Bailing-hybrid's)
    keeps the state where it is False and gives zeros there."""

    def update(q, k, v, g, scale, h=None, mask=None, **_chunk):
        if not (q.shape[1] == k.shape[1] == v.shape[1]):
            masked = {} if mask is None else {"mask": mask}
            return original(q, k, v, g, scale=scale, h=h, **masked)
        t = lambda x: mx.swapaxes(x, 1, 2)  # noqa: E731
        b, heads, length, _ = q.shape
        log_g = mx.broadcast_to(g.astype(mx.float32), (b, length, heads))
        beta = mx.ones((b, length, heads))
        if mask is not None:
            keep = mask.astype(mx.bool_)[..., None]
            log_g, beta = mx.where(keep, log_g, 0.0), mx.where(keep, beta, 0.0)
        state = None if h is None else mx.swapaxes(h, -1, -2)
        y, s = delta.chunked_gated_delta(
            t(q * scale), t(k), t(v), log_g, beta, state, current().segment_ids, delta=False
        )
        y = t(y).astype(q.dtype)
        if mask is not None:
            y = mx.where(mask[:, None, :, None], y, 0)
        return y, mx.swapaxes(s, -1, -2).astype(q.dtype if h is None else h.dtype)

    update._mlxtune_original = original
    return update


RECURRENCES = {
    "gated_delta_update": _chunked_delta,
    "ssm_update": _chunked_ssd,
    "recurrent_gla": _chunked_gla,
}
"""The recurrences of mlx-lm's family modules (module-level names) routed to the chunkwise
form while training, each with the state restarting per packed example."""


def _dbrx_mixture(self, x: mx.array) -> mx.array:
    """DBRX's mixture of experts (mlx-lm's ``SparseMoeBlock``) without reading the routing on
    the host: every expert runs on every token and its output is weighted by the token's
    normalised top-k score for it (zero where the router did not pick it). The same sum as
    mlx-lm's, at experts / top-k times its MLP compute (4x for DBRX's 16 experts, top 4), in a
    form a compiled step can hold; mlx-lm's gathers the picked tokens per expert through NumPy,
    which no compiled step can run."""
    k = self.num_experts_per_tok
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    gates = mx.softmax(self.router(x).astype(mx.float32), axis=-1)
    picked = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[:, :k])
    scores = mx.take_along_axis(gates, picked, axis=-1)
    scores = (scores / mx.linalg.norm(scores, ord=1, axis=-1, keepdims=True)).astype(x.dtype)
    y = None
    for e, expert in enumerate(self.experts):
        weight = (scores * (picked == e)).sum(axis=-1, keepdims=True)
        part = weight * expert(x)
        y = part if y is None else y + part
    return y.reshape(shape)


COMPILABLE = {("mlx_lm.models.dbrx", "SparseMoeBlock"): _dbrx_mixture}
"""(module, class) of mlx-lm's mixtures whose forward reads the routing on the host (NumPy,
``tolist``), which a compiled step cannot: the call that replaces theirs while training."""
_COMPILABLE_CLASSES: dict[type, type] = {}


def _compilable_class(cls: type) -> type | None:
    call = COMPILABLE.get((cls.__module__, cls.__name__))
    if call is None:
        return cls if cls in _COMPILABLE_CLASSES.values() else None
    if cls not in _COMPILABLE_CLASSES:
        _COMPILABLE_CLASSES[cls] = type(
            f"Compilable{cls.__name__}",
            (cls,),
            {"__call__": call, "__module__": cls.__module__, "__doc__": call.__doc__},
        )
    return _COMPILABLE_CLASSES[cls]


def _unpatched(fn):
    """mlx-lm's function behind a kernel_attention replacement (fn itself when it is not one)."""
    return getattr(fn, "_mlxtune_original", fn)
