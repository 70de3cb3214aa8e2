"""A frozen reference policy beside the one being trained (DPO's, and the KL term of GRPO):

- ``adapters_off``: the same model with its LoRA/DoRA adapters off (the base: no second copy in
  memory);
- ``copy``: the trainable weights as the run starts, kept aside and swapped in while the
  reference runs (for LoRA a copy of the adapters, for full fine-tuning of the weights).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..adapters import adapters_disabled
from ..kernels import forward_only
from ..models.context import quantizing


def reference_kind(asked: str, adapter_type: str) -> str:
    """What ``auto`` means for a run: the base with adapters off when there are adapters, a
    copy of the starting weights when the whole model trains."""
    if asked != "auto":
        return asked
    return "adapters_off" if adapter_type in ("lora", "dora") else "copy"


class ReferencePolicy:
    """The reference of ``kind`` (``adapters_off`` or ``copy``) for ``model``."""

    def __init__(self, kind: str, model: nn.Module):
        self.kind, self.model = kind, model
        self._start: dict | None = None

    def keep(self, log) -> None:
        """Take what the reference needs from the model as it is now (its starting weights)."""
        if self.kind == "copy":
            # copies of their own (numpy has no bfloat16: through fp32): the compiled steps
            # take the weights themselves as inputs
            self._start = {
                k: mx.array(np.array(v.astype(mx.float32))).astype(v.dtype)
                for k, v in tree_flatten(self.model.trainable_parameters())
            }
            mx.eval(self._start)
            log("reference: a copy of the starting trainable weights")
        else:
            log("reference: the base model (adapters off)")

    @property
    def bytes(self) -> int:
        """Memory the reference keeps: the copied weights."""
        if self.kind != "copy":
            return 0
        return sum(v.nbytes for _, v in tree_flatten(self.model.trainable_parameters()))

    @contextlib.contextmanager
    def active(self):
        """Inside the block the model is the reference (no dropout, nothing flows back, in
        full precision also in a quantization-aware run): enter it inside a traced function,
        like ``adapters_disabled``."""
        model = self.model
        with forward_only(), quantizing(False):
            if self.kind == "adapters_off":
                with adapters_disabled(model):
                    yield model
                return
            if self._start is None:
                raise RuntimeError("ReferencePolicy.keep() was not called")
            now = model.trainable_parameters()
            was = model.training
            model.update(tree_unflatten(list(self._start.items())))
            model.eval()
            try:
                yield model
            finally:
                model.update(now)
                model.train(was)


__all__ = ["ReferencePolicy", "reference_kind"]
