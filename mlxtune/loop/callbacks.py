"""Hooks into a run (``Callback``) and what they are shown after each step (``StepEvent``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # annotations only: the loop imports this module
    from ..engine.steps import StepResult
    from ..loop import Trainer


@dataclass(eq=False)
class StepRecord:
    """One optimizer step as the loop queued it: what the host knows, the device's results
    (lazy until read), and, once read, their values."""

    step: int
    n: int
    """What the step's loss counted (for SFT its target tokens), known on the host."""
    targets: int
    """Target tokens the step trained on."""
    result: StepResult
    scale: mx.array
    """The loss scale the step multiplied by."""
    lr: mx.array
    """The learning rate it used."""
    read: bool = False
    loss: float = math.nan
    grad_norm: float = math.nan
    lr_value: float = math.nan
    applied: bool = True
    tokens_seen: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    host: dict[str, list[float]] = field(default_factory=dict)
    """The objective's host-made metrics for this step: name -> [sum, weight]."""


class StepEvent:
    """What a callback sees after every optimizer step.

    Steps are queued ahead of the device, so the step may still be running when ``on_step`` is
    called. ``step``, ``epoch`` and ``step_time_s`` (the host's seconds since the previous step)
    are plain numbers; reading ``loss``, ``lr``, ``grad_norm``, ``tokens_seen`` or ``metrics``
    waits for the step to finish (a callback that reads them every step makes every step
    wait)."""

    def __init__(self, step: int, epoch: float, step_time_s: float, record: StepRecord, read):
        self.step, self.epoch, self.step_time_s = step, epoch, step_time_s
        self._record, self._read = record, read

    def _value(self, name: str):
        if not self._record.read:
            self._read()
        if not self._record.read:  # only when the run ended with this step still queued
            raise RuntimeError(f"step {self.step}'s results were never read: the run ended first")
        return getattr(self._record, name)

    @property
    def loss(self) -> float:
        """Mean loss over what the step counted (its target tokens)."""
        return self._value("loss")

    @property
    def lr(self) -> float:
        return self._value("lr_value")

    @property
    def grad_norm(self) -> float:
        """Before clipping; not finite for a step whose update was skipped."""
        return self._value("grad_norm")

    @property
    def tokens_seen(self) -> int:
        """Target tokens trained on so far, this step included (skipped steps' not counted)."""
        return self._value("tokens_seen")

    @property
    def metrics(self) -> dict[str, float]:
        """The objective's own metrics for this step, each divided by the step's count."""
        return self._value("metrics")

    def __repr__(self) -> str:
        return f"StepEvent(step={self.step}, epoch={self.epoch:.4f})"


class Callback:
    """Hooks into a run. Override what you need; ``trainer.request_stop()`` and
    ``trainer.request_save()`` steer the run from any hook."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step(self, trainer: Trainer, event: StepEvent) -> None: ...

    def on_eval(self, trainer: Trainer, metrics: dict) -> None: ...

    def on_train_end(self, trainer: Trainer, summary: dict) -> None: ...


class FunctionCallback(Callback):
    """A plain function ``fn(trainer, event)`` called after every step."""

    def __init__(self, fn):
        self.fn = fn

    def on_step(self, trainer, event):
        self.fn(trainer, event)
