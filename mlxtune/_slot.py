"""A module-level value that a ``with`` block sets and puts back: how the trainer hands what a
forward pass needs (packed segment ids, dropout keys) to code deep inside mlx-lm's models."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any


class Slot:
    def __init__(self):
        self.value: Any = None

    @contextmanager
    def holding(self, value):
        """``self.value`` is ``value`` inside the block, and what it was before after it."""
        saved, self.value = self.value, value
        try:
            yield self
        finally:
            self.value = saved
