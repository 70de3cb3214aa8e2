"""The recipe's optimizer and schedule sections (part of the schema; see ``schema``): the
optimizer by name with each one's own settings, and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AdafactorConfig:
    """Adafactor's own settings (MLX's Adafactor, driven by the recipe's lr and schedule)."""

    eps: list[float] = field(default_factory=lambda: [1e-30, 1e-3])
    """Added to the squared gradients, and the floor of a weight's RMS when scale_parameter."""
    clip_threshold: float = 1.0
    """The update's RMS is clipped to this before the learning rate applies."""
    decay_rate: float = -0.8
    """The second moment's decay at step t is 1 - t^decay_rate."""
    beta1: float | None = None
    """A first moment (momentum over the updates) with this decay; null: none (less memory)."""
    scale_parameter: bool = False
    """Scale each weight's step by its RMS (at least eps[1]). Off by default, as for fine-tuning
    at an explicit lr: on, a LoRA B that starts at zero steps at lr x eps[1] and barely moves
    (measured: 0% on quickstart-lora at 10x AdamW's lr)."""


@dataclass
class MuonConfig:
    """Muon's own settings (name: muon): Muon (MLX's) trains the 2-D weight matrices inside the
    transformer blocks, AdamW (the recipe's lr, betas, eps, weight_decay) everything else."""

    lr_scale: float = 5.0
    """Muon's learning rate as a multiple of optimizer.lr (the schedule shapes both). An
    orthogonalised update is small per entry (RMS 1 / sqrt(the larger dimension)), so Muon
    needs a larger lr than AdamW: 5 measured best on the quickstart at lr 2e-3."""
    weight_decay_scale: float = 1.0
    """Muon's matrices decay by optimizer.weight_decay x this (decoupled, at Muon's lr)."""
    momentum: float = 0.95
    """Muon's momentum."""
    nesterov: bool = True
    """Nesterov momentum."""
    ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalise each update."""
    adapters: bool = True
    """LoRA's A and B under Muon too (each orthogonalised as the [out, in] matrix it acts as);
    false trains them with AdamW, which makes a LoRA run's Muon an AdamW run. Measured on
    quickstart-lora: both reach the target in the same steps (the optimizer table in docs/recipes.md)."""


@dataclass
class SophiaConfig:
    """Sophia-G's own settings (name: sophia; SFT only: its curvature estimate draws labels
    from the model's own next-token predictions)."""

    betas: list[float] = field(default_factory=lambda: [0.965, 0.99])
    """The momentum's decay and the curvature average's."""
    rho: float = 0.04
    """Each entry steps by lr x min(|m| / (rho x h), 1): larger rho, smaller steps where the
    curvature is large."""
    k: int = 10
    """Steps between curvature estimates (one extra forward and backward each, over the
    step's first micro-batch, with the [tokens, vocabulary] logits built to draw labels)."""
    eps: float = 1.0e-12
    """The floor of rho x h."""


@dataclass
class OptimizerConfig:
    """The optimizer. Weight decay applies to matrices only, never to norms or biases."""

    name: Literal["adamw", "adamw8bit", "adam", "sgd", "lion", "adafactor", "muon", "sophia"] = (
        "adamw"
    )
    """"adamw" (decoupled weight decay), "adamw8bit" (AdamW with its moments stored as 8-bit
    codes in blocks of 256, a quarter of the state), "adam", "sgd" (with momentum), "lion" (the sign of
    an interpolated momentum; betas default [0.9, 0.99] for it) or "adafactor" (factored second
    moments: a row and a column a matrix), "muon" (orthogonalised momentum on the blocks'
    weight matrices, AdamW on the rest) or "sophia" (Sophia-G: momentum over a diagonal
    Gauss-Newton curvature estimate, clipped)."""
    lr: float = 1e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's beta1 and beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    bias_correction: bool = True
    """Adam's bias correction of the moment estimates (as in the Adam paper and PyTorch)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Decoupled weight decay (every optimizer but adam), applied to weights with two or more
    dimensions: each step shrinks them by lr * weight_decay, apart from the gradient and its
    momentum."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; null turns clipping off (grad_norm is still
    reported)."""
    adafactor: AdafactorConfig = field(default_factory=AdafactorConfig)
    """Adafactor's settings (name: adafactor)."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's settings (name: muon)."""
    sophia: SophiaConfig = field(default_factory=SophiaConfig)
    """Sophia's settings (name: sophia)."""


@dataclass
class ScheduleConfig:
    """The learning-rate schedule, as a function of the optimizer step."""

    name: Literal["constant", "linear", "cosine", "warmup_cosine", "warmup_stable_decay"] = "cosine"
    """"constant", "linear" (decay to min_lr), "cosine" (to min_lr), "warmup_cosine" (cosine
    with a warmup of 5% of the steps unless warmup_steps is set), or "warmup_stable_decay"
    (WSD: warmup, lr held, then a linear decay to min_lr over the last decay_fraction of the
    steps; the warmup never reaches into the decay)."""
    decay_fraction: float = 0.1
    """warmup_stable_decay: the share of the steps the final decay takes."""
    warmup_steps: int | None = None
    """Linear warmup from 0 to lr over this many optimizer steps."""
    min_lr: float = 0.0
    """The learning rate the decaying schedules end at."""
