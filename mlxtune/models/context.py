"""The forward context: what one forward pass needs that mlx-lm's module calls do not carry
(packed segment ids, the key adapter dropout draws from), set by ``with`` blocks and read by
the code mlxtune puts inside a model (the patched attention, adapter dropout, checkpointed
blocks).

It lives in a ``contextvars.ContextVar``: each thread (and each asyncio task) sees its own,
and every ``with`` block puts back exactly what it found, also when blocks nest. It is Python
state read while a function runs, so in a function traced by ``mx.compile`` it is read at trace
time: enter the blocks inside the traced function.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx


class DropoutKeys:
    """The key adapter dropout draws from inside one ``dropout_key`` block. Each draw advances
    it in place, so that blocks entered inside that one (``segments``) share its sequence."""

    def __init__(self, key: mx.array):
        self.key = key

    def next(self) -> mx.array:
        """A fresh subkey; the key advances."""
        self.key, sub = mx.random.split(self.key)
        return sub


@dataclass(frozen=True)
class ForwardContext:
    """What the current forward pass carries besides its inputs.

    ``segment_ids``: [B, T], each position's packed example (0: padding), or None.
    ``dropout_keys``: where adapter dropout draws its masks from, or None (the global random
    state).
    ``quantized``: layers prepared for quantization-aware training compute with their weights
    fake-quantized (``mlxtune.qat``).
    """

    segment_ids: mx.array | None = None
    dropout_keys: DropoutKeys | None = None
    quantized: bool = False


_EMPTY = ForwardContext()
# None until a block sets it: a thread that never set one reads _EMPTY
_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "mlxtune_forward_context", default=None
)


def current() -> ForwardContext:
    """The forward context of this thread (or task) now."""
    return _CONTEXT.get() or _EMPTY


@contextmanager
def _holding(**changes) -> Iterator[ForwardContext]:
    """The current context with ``changes`` inside the block, and what it was after it."""
    ctx = replace(current(), **changes)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def segments(ids: mx.array | None):
    """While active, training attention keeps packed examples apart: ``ids`` [B, T] gives each
    position's example (0: padding). Needs ``kernel_attention`` active around the model.

    With rotary position embeddings an attention score depends only on the distance between
    query and key, so within a segment the scores (and the logits) are those of the example on
    its own: positions restart per segment in effect, without rotating anything twice.
    """
    return _holding(segment_ids=ids)


def dropout_key(key: mx.array | None):
    """While active, adapter dropout draws its masks from ``key`` (a random key array) instead
    of the global random state, so that running a block twice draws the same masks: gradient
    checkpointing runs it again in the backward pass. ``None`` leaves the global state in use."""
    return _holding(dropout_keys=None if key is None else DropoutKeys(key))


def quantizing(on: bool = True):
    """While active (``on``), layers ``mlxtune.qat`` prepared compute with their (merged)
    weights fake-quantized; outside it, and by default, with the weights as they are.
    Gradient checkpointing runs a block again in the backward pass as its forward ran."""
    return _holding(quantized=on)
