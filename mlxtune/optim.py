"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim


class _MatrixDecay:
    """Decoupled weight decay on matrices only (ndim >= 2; never norms, biases or DoRA
    magnitudes): a matrix steps to ``w - lr * matrix_decay * w - u(w)``, ``u`` the step the
    optimizer it is mixed into takes. The optimizer's own decay is left at 0."""

    matrix_decay: float = 0.0

    def apply_single(self, gradient: mx.array, parameter: mx.array, state):
        out = super().apply_single(gradient, parameter, state)
        if parameter.ndim >= 2 and self.matrix_decay:
            lr = self.learning_rate.astype(gradient.dtype)
            out = out - lr * self.matrix_decay * parameter
        return out


class AdamWMatrices(_MatrixDecay, optim.Adam):
    """AdamW whose decoupled weight decay touches matrices only (Adam's step, the decay here:
    AdamW's own would add a multiply by 1 for every other weight)."""

    def __init__(self, learning_rate, weight_decay: float = 0.0, **adam):
        super().__init__(learning_rate, **adam)
        self.matrix_decay = weight_decay


class SGDMatrices(_MatrixDecay, optim.SGD):
    """SGD (with momentum) whose decoupled weight decay touches matrices only: with velocity
    ``v <- momentum * v + g``, a matrix steps to ``w * (1 - lr * weight_decay) - lr * v``.

    Decoupled as in AdamW: the decay never enters the velocity, so ``weight_decay`` shrinks a
    weight by the same ``lr * weight_decay`` a step whatever the momentum (an L2 term in the
    gradient would be amplified by the momentum, about 1 / (1 - momentum) times).
    """

    def __init__(self, learning_rate, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(learning_rate, momentum=momentum, weight_decay=0.0)
        self.matrix_decay = weight_decay


class LionMatrices(_MatrixDecay, optim.Lion):
    """Lion (MLX's) whose decoupled weight decay touches matrices only: a matrix steps to
    ``w * (1 - lr * weight_decay) - lr * sign(beta1 m + (1 - beta1) g)``."""

    def __init__(self, learning_rate, betas, weight_decay: float = 0.0):
        super().__init__(learning_rate, betas=list(betas), weight_decay=0.0)
        self.matrix_decay = weight_decay


class AdafactorMatrices(_MatrixDecay, optim.Adafactor):
    """Adafactor (MLX's) at the schedule's learning rate (not its own relative step), with a
    decoupled weight decay on matrices only, ``lr * weight_decay * w`` at the schedule's lr and
    the weight before the step (MLX's own decay would scale it by the weight's RMS and touch
    norms and biases too)."""

    def __init__(self, learning_rate, cfg, weight_decay: float = 0.0):
        super().__init__(
            learning_rate=learning_rate,
            eps=tuple(cfg.eps),
            clip_threshold=cfg.clip_threshold,
            decay_rate=cfg.decay_rate,
            beta_1=cfg.beta1,
            weight_decay=0.0,
            scale_parameter=cfg.scale_parameter,
            relative_step=False,
        )
        self.matrix_decay = weight_decay


LION_BETAS = (0.9, 0.99)
"""Lion's betas where the recipe sets none (its paper's; Adam's default would be wrong for it)."""

WARMED = ("warmup_cosine", "warmup_stable_decay")
"""Schedules whose warmup defaults to 5% of the steps (the others: none unless asked)."""


def make_schedule(
    name: str,
    lr: float,
    total_steps: int,
    warmup_steps: int | None,
    min_lr: float,
    decay_fraction: float = 0.1,
):
    """A function of the optimizer step (0-based) giving the learning rate. The warmup rises
    linearly to lr over its steps (its last step at lr); the decay starts after it, never
    during it, and the last step runs at min_lr."""
    if name == "warmup_stable_decay":
        return _wsd(lr, total_steps, warmup_steps, min_lr, decay_fraction)
    if warmup_steps is None:
        warmup_steps = max(1, int(0.05 * total_steps)) if name in WARMED else 0
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - 1 - warmup_steps, 1)  # the last step runs at min_lr

    def schedule(step):
        step = (
            mx.array(step, dtype=mx.float32)
            if not isinstance(step, mx.array)
            else step.astype(mx.float32)
        )
        warm = lr * (step + 1) / max(warmup_steps, 1)
        t = mx.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        if name == "constant":
            after = mx.array(lr, dtype=mx.float32)
        elif name == "linear":
            after = lr + (min_lr - lr) * t
        else:  # cosine, warmup_cosine
            after = min_lr + 0.5 * (lr - min_lr) * (1 + mx.cos(math.pi * t))
        return mx.where(step < warmup_steps, warm, after) if warmup_steps else after

    return schedule


def _wsd(lr: float, total: int, warmup: int | None, min_lr: float, fraction: float):
    """Warmup, stable, decay: the last ``fraction`` of the steps (at least one) decay linearly
    to min_lr (the first of them already below lr, the last at min_lr); the warmup (5% of the
    steps by default) ends before the decay starts, cut short if it would reach into it."""
    decay = max(1, round(fraction * total))
    start = max(total - decay, 0)  # the first decaying step
    if warmup is None:
        warmup = max(1, int(0.05 * total))
    warmup = min(warmup, start)

    def schedule(step):
        step = (
            mx.array(step, dtype=mx.float32)
            if not isinstance(step, mx.array)
            else step.astype(mx.float32)
        )
        warm = lr * (step + 1) / max(warmup, 1)
        t = mx.clip((step - start + 1) / decay, 0.0, 1.0)
        after = mx.where(step < start, lr, lr + (min_lr - lr) * t)
        return mx.where(step < warmup, warm, after) if warmup else after

    return schedule


def build_optimizer(cfg, schedule, explicit=frozenset()):
    if cfg.name == "adamw":
        return AdamWMatrices(
            learning_rate=schedule,
            betas=list(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            bias_correction=cfg.bias_correction,
        )
    if cfg.name == "adam":
        return optim.Adam(
            learning_rate=schedule,
            betas=list(cfg.betas),
            eps=cfg.eps,
            bias_correction=cfg.bias_correction,
        )
    if cfg.name == "lion":
        betas = cfg.betas if "optimizer.betas" in explicit else LION_BETAS
        return LionMatrices(schedule, betas=betas, weight_decay=cfg.weight_decay)
    if cfg.name == "adafactor":
        return AdafactorMatrices(schedule, cfg.adafactor, weight_decay=cfg.weight_decay)
    return SGDMatrices(learning_rate=schedule, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
