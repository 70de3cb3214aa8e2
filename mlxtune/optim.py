"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim


class AdamWMatrices(optim.AdamW):
    """AdamW whose decoupled weight decay touches matrices only (ndim >= 2), never norms,
    biases or DoRA magnitudes."""

    def apply_single(self, gradient: mx.array, parameter: mx.array, state):
        if parameter.ndim >= 2 and self.weight_decay:
            lr = self.learning_rate.astype(gradient.dtype)
            parameter = parameter * (1 - lr * self.weight_decay)
        return optim.Adam.apply_single(self, gradient, parameter, state)


class SGDMatrices(optim.SGD):
    """SGD (with momentum) whose decoupled weight decay touches matrices only: with velocity
    ``v <- momentum * v + g``, a matrix steps to ``w * (1 - lr * weight_decay) - lr * v``.

    Decoupled as in AdamW: the decay never enters the velocity, so ``weight_decay`` shrinks a
    weight by the same ``lr * weight_decay`` a step whatever the momentum (an L2 term in the
    gradient would be amplified by the momentum, about 1 / (1 - momentum) times).
    """

    def __init__(self, learning_rate, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(learning_rate, momentum=momentum, weight_decay=0.0)
        self.matrix_decay = weight_decay

    def apply_single(self, gradient: mx.array, parameter: mx.array, state):
        if parameter.ndim >= 2 and self.matrix_decay:
            lr = self.learning_rate.astype(gradient.dtype)
            parameter = parameter * (1 - lr * self.matrix_decay)
        return super().apply_single(gradient, parameter, state)


def make_schedule(name: str, lr: float, total_steps: int, warmup_steps: int | None, min_lr: float):
    """A function of the optimizer step (0-based) giving the learning rate."""
    if warmup_steps is None:
        warmup_steps = max(1, int(0.05 * total_steps)) if name == "warmup_cosine" else 0
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


def build_optimizer(cfg, schedule):
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
    return SGDMatrices(learning_rate=schedule, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
