"""Gradient checkpointing of transformer blocks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .common import derived_class
from .context import current, dropout_key, quantizing, segments


def _plain_argument(a) -> bool:
    return a is None or isinstance(a, (mx.array, str, int, float))


def _run_block(block: nn.Module, call, key, quantized, params: dict, seg, *args, **kwargs):
    """The block's own forward with ``params`` in place, and the dropout key and packed segments
    of the original call: the backward pass runs this again and must see exactly the same. (The
    key is no input of the checkpointed function: nothing differentiates through a key.)"""
    held = block.trainable_parameters()
    block.update(params)
    try:
        with segments(seg), dropout_key(key), quantizing(quantized):
            return call(block, *args, **kwargs)
    finally:
        block.update(held)


def _checkpointed_call(self, *args, **kwargs):
    """A checkpointed block's call: its trainable parameters go in as inputs of the checkpointed
    function, so their gradients flow; the frozen ones are constants of the recomputation."""
    call = type(self)._mlxtune_block_call
    if not all(_plain_argument(a) for a in (*args, *kwargs.values())):
        return call(self, *args, **kwargs)  # generation with a KV cache: nothing to save
    key = None
    if self.training and any(isinstance(m, nn.Dropout) and m._p_1 < 1 for m in self.modules()):
        # adapter dropout draws its masks again in the backward pass: from the same key (from
        # the active dropout key when there is one, else from the global random state)
        keys = current().dropout_keys
        key = (
            keys.next()
            if keys is not None
            else mx.random.randint(0, 1 << 32, (2,), dtype=mx.uint32)
        )
    quantized = current().quantized  # (QAT) the backward's recomputation quantizes alike
    fn = mx.checkpoint(
        lambda params, seg, *a, **kw: _run_block(self, call, key, quantized, params, seg, *a, **kw)
    )
    return fn(self.trainable_parameters(), current().segment_ids, *args, **kwargs)


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if getattr(cls, "_mlxtune_block_call", None) is not None:
        return cls
    doc = f"{cls.__name__} that recomputes its activations in the backward pass."
    return derived_class(
        cls, _CHECKPOINTED, "Checkpointed", doc,
        __call__=_checkpointed_call, _mlxtune_block_call=cls.__call__,
    )  # fmt: skip


def checkpoint_layers(model: nn.Module, every: int = 1) -> int:
    """Gradient checkpointing: transformer blocks 0, every, 2*every, ... keep only their input
    for the backward pass and recompute their activations there (less memory, about a third
    more compute for those blocks). Only these instances change (each gets a subclass of its
    own class whose call is checkpointed); parameter names and values stay as they are, and
    generation with a KV cache runs the blocks as before. Returns how many blocks it covers.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer 1 or more, got {every!r}")
    blocks = model.layers
    chosen = range(0, len(blocks), every)
    for i in chosen:
        checkpoint_block(blocks[i])
    return len(chosen)


def checkpoint_block(block: nn.Module) -> None:
    """This block recomputes its activations in the backward pass (``checkpoint_layers``)."""
    block.__class__ = _checkpointed_class(type(block))


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` recomputes its activations in the backward pass."""
    return getattr(type(block), "_mlxtune_block_call", None) is not None


def uncheckpoint(block: nn.Module) -> None:
    """``block`` back to its own class: it keeps its activations again."""
    if is_checkpointed(block):
        block.__class__ = type(block).__bases__[0]


def checkpointed_layers(model: nn.Module) -> int:
    """How many transformer blocks of a model recompute their activations (checkpoint_layers)."""
    return sum(1 for b in model.layers if is_checkpointed(b))
