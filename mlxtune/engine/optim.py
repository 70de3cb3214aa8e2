"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_map


class _MatrixDecay:
    """Decoupled weight decay on matrices only (ndim >= 2; never norms, biases or DoRA
    magnitudes): a matrix steps to ``w - lr * matrix_decay * w - u(w)``, ``u`` the step the
    optimizer it is mixed into takes. The optimizer's own decay is left at 0. Mixed in first,
    before a class that defines ``apply_single`` (a class defining its own would hide this)."""

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


class MuonMatrices(_MatrixDecay, optim.Muon):
    """Muon (MLX's): momentum, its Nesterov look-ahead, orthogonalised by Newton-Schulz, at lr x
    sqrt(max(1, out / in)); a decoupled decay ``lr * weight_decay * w`` (MLX's own adds an L2
    term to the gradient instead). ``transposed``: the weights are stored [in, out] (LoRA's A
    [in, r] and B [r, out]), so the rate's shape factor reads them the other way round (the
    orthogonalisation itself does not depend on it)."""

    def __init__(self, learning_rate, cfg, weight_decay: float = 0.0, transposed: bool = False):
        super().__init__(
            learning_rate,
            momentum=cfg.momentum,
            weight_decay=0.0,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
        )
        self.matrix_decay = weight_decay
        self.transposed = transposed

    def init_single(self, parameter: mx.array, state: dict):
        super().init_single(parameter.T if self.transposed else parameter, state)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        if not self.transposed:
            return super().apply_single(gradient, parameter, state)
        return super().apply_single(gradient.T, parameter.T, state).T


_IN_A_BLOCK = re.compile(r"(^|\.)\d+\.")
"""A path through a numbered list of modules: a transformer block's (embeddings and the LM head
sit outside the list)."""


def block_matrix(path: str, weight) -> bool:
    """A matrix inside a transformer block: what Muon trains. Embeddings, the head, norms,
    biases, DoRA magnitudes and 3-D expert stacks go to AdamW."""
    return weight.ndim == 2 and bool(_IN_A_BLOCK.search(path))


def is_lora(path: str) -> bool:
    """LoRA's A or B (stored [in, r] and [r, out])."""
    return path.rsplit(".", 1)[-1] in ("lora_a", "lora_b")


class Sophia(optim.Optimizer):
    """Sophia-G: a momentum ``m`` divided by a diagonal curvature estimate ``h``, each entry's
    step clipped to the learning rate: ``w <- w - lr * sign(m) * min(|m| / max(rho * h, eps),
    1)``. ``h`` is an average of Gauss-Newton-Bartlett estimates (``update_curvature``) taken
    every ``curvature_every`` steps by the engine."""

    def __init__(self, learning_rate, cfg):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.betas, self.rho, self.eps = tuple(cfg.betas), cfg.rho, cfg.eps
        self.curvature_every = cfg.k

    def init_single(self, parameter: mx.array, state: dict):
        state["m"] = mx.zeros_like(parameter)
        state["h"] = mx.zeros_like(parameter)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        b1 = self.betas[0]
        m = b1 * state["m"] + (1 - b1) * gradient
        state["m"] = m
        ratio = mx.minimum(mx.abs(m) / mx.maximum(self.rho * state["h"], self.eps), 1.0)
        lr = self.learning_rate.astype(gradient.dtype)
        return parameter - lr * mx.sign(m) * ratio

    def update_curvature(self, grads: dict, count: mx.array, ok: mx.array) -> None:
        """One Gauss-Newton-Bartlett estimate into ``h``: ``count * g * g``, ``g`` the gradient
        of the mean loss against labels drawn from the model's own predictions over ``count``
        targets; ``h <- beta2 h + (1 - beta2) count g^2``, left as it was unless ``ok``."""
        b2 = self.betas[1]

        def one(g, state):
            new = b2 * state["h"] + (1 - b2) * count.astype(g.dtype) * mx.square(g)
            state["h"] = mx.where(ok, new, state["h"])

        tree_map(one, grads, self.state)


class SophiaMatrices(_MatrixDecay, Sophia):
    """Sophia-G with a decoupled weight decay on matrices only."""

    def __init__(self, learning_rate, cfg, weight_decay: float = 0.0):
        super().__init__(learning_rate, cfg)
        self.matrix_decay = weight_decay


BLOCK = 256
"""Elements per quantization block of adamw8bit's moments (one fp32 scale each)."""
MIN_8BIT = 4096
"""Weights with fewer elements keep fp32 moments (norms, biases: little to save, much to lose)."""


def quantize_blocks(x: mx.array, signed: bool) -> tuple[mx.array, mx.array]:
    """``x`` in blocks of BLOCK, each as 8-bit codes and its largest magnitude ``s``, companded so
    that small values keep resolution (a fourth root: about 3% steps near s, a value 10^-4 x s
    still within 10%): signed (a momentum) ``round(127 sign(x) (|x| / s)^(1/4))`` as int8;
    unsigned (a second moment, >= 0) ``round(255 (x / s)^(1/4))`` as uint8, at least 1 for a
    positive value, so that none reads back as 0 (a step divided by it stays bounded)."""
    flat = x.reshape(-1).astype(mx.float32)
    pad = (-flat.size) % BLOCK
    if pad:
        flat = mx.concatenate([flat, mx.zeros((pad,), mx.float32)])
    blocks = flat.reshape(-1, BLOCK)
    scale = mx.max(mx.abs(blocks), axis=1, keepdims=True)
    u = mx.abs(blocks) / mx.maximum(scale, 1e-38)
    if signed:
        return (mx.round(127 * mx.sqrt(mx.sqrt(u))) * mx.sign(blocks)).astype(mx.int8), scale
    c = mx.round(255 * mx.sqrt(mx.sqrt(u)))
    return mx.where(u > 0, mx.maximum(c, 1), 0).astype(mx.uint8), scale


def dequantize_blocks(codes: mx.array, scale: mx.array, like: mx.array) -> mx.array:
    """The fp32 values ``quantize_blocks`` stored, in the shape of ``like``."""
    c = codes.astype(mx.float32)
    if codes.dtype == mx.int8:
        u = mx.sign(c) * mx.square(mx.square(c / 127))
    else:
        u = mx.square(mx.square(c / 255))
    return (u * scale).reshape(-1)[: like.size].reshape(like.shape)


class Adam8bit(optim.Optimizer):
    """Adam with its moments kept as blockwise-quantized 8-bit codes (``quantize_blocks``) for
    weights of MIN_8BIT elements or more: each step reads them back to fp32, takes Adam's step
    and stores them again, a quarter of fp32 Adam's state."""

    def __init__(self, learning_rate, betas, eps, bias_correction):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.betas, self.eps, self.bias_correction = tuple(betas), eps, bias_correction

    def init_single(self, parameter: mx.array, state: dict):
        if parameter.size < MIN_8BIT:
            state["m"] = mx.zeros_like(parameter)
            state["v"] = mx.zeros_like(parameter)
            return
        zero = mx.zeros(parameter.shape, mx.float32)
        state["m_q"], state["m_s"] = quantize_blocks(zero, True)
        state["v_q"], state["v_s"] = quantize_blocks(zero, False)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        b1, b2 = self.betas
        small = "m" in state
        if small:
            m, v = state["m"], state["v"]
        else:
            m = dequantize_blocks(state["m_q"], state["m_s"], parameter)
            v = dequantize_blocks(state["v_q"], state["v_s"], parameter)
        g = gradient.astype(mx.float32)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * mx.square(g)
        if small:
            state["m"], state["v"] = m, v
        else:
            state["m_q"], state["m_s"] = quantize_blocks(m, True)
            state["v_q"], state["v_s"] = quantize_blocks(v, False)
        lr = self.learning_rate.astype(mx.float32)
        if self.bias_correction:
            t = self.step.astype(mx.float32)
            m, v = m / (1 - b1**t), v / (1 - b2**t)
        step = lr * m / (mx.sqrt(v) + self.eps)
        return parameter - step.astype(parameter.dtype)


class AdamW8bit(_MatrixDecay, Adam8bit):
    """Adam8bit with a decoupled weight decay on matrices only."""

    def __init__(self, learning_rate, betas, eps, bias_correction, weight_decay: float = 0.0):
        super().__init__(learning_rate, betas, eps, bias_correction)
        self.matrix_decay = weight_decay


class Composed(optim.MultiOptimizer):
    """Optimizers over disjoint sets of weights (MLX's MultiOptimizer), reporting the last
    one's learning rate: the recipe's, where the first ones run at a multiple of it."""

    @property
    def curvature_every(self) -> int | None:
        """Steps between curvature estimates, when one of the optimizers takes them."""
        every = [getattr(o, "curvature_every", None) for o in self.optimizers]
        return next((k for k in every if k), None)

    def update_curvature(self, grads: dict, count: mx.array, ok: mx.array) -> None:
        for o, g in zip(self.optimizers, self._split_dictionary(grads), strict=True):
            if hasattr(o, "update_curvature"):
                o.update_curvature(g, count, ok)

    @property
    def learning_rate(self):
        return self.optimizers[-1].learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        raise AttributeError("set each of Composed.optimizers' learning rates")


LION_BETAS = (0.9, 0.99)
"""Lion's betas where the recipe sets none (its paper's; Adam's default would be wrong for it)."""

WARMED = ("warmup_cosine", "warmup_stable_decay")
"""Schedules whose warmup defaults to 5% of the steps (the others: none unless asked)."""


def _as_step(step) -> mx.array:
    """A schedule's step (a number or an array) as a float32 array."""
    if isinstance(step, mx.array):
        return step.astype(mx.float32)
    return mx.array(step, dtype=mx.float32)


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
        step = _as_step(step)
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
        step = _as_step(step)
        warm = lr * (step + 1) / max(warmup, 1)
        t = mx.clip((step - start + 1) / decay, 0.0, 1.0)
        after = mx.where(step < start, lr, lr + (min_lr - lr) * t)
        return mx.where(step < warmup, warm, after) if warmup else after

    return schedule


def build_optimizer(cfg, schedule, explicit=frozenset(), lora_plus_ratio: float | None = None):
    """The optimizer ``cfg`` names, over the learning-rate ``schedule``. Muon and LoRA+ compose
    several over disjoint sets of weights (the first that claims a weight trains it): LoRA's B
    at ``lora_plus_ratio`` x the lr, Muon on the blocks' matrices (LoRA's too when
    ``muon.adapters``), and the rest (AdamW for Muon) at the recipe's lr, the one reported."""
    rest = replace(cfg, name="adamw") if cfg.name == "muon" else cfg
    m = cfg.muon
    adapters = cfg.name == "muon" and m.adapters

    def muon(mult: float, transposed: bool = False):
        decay = cfg.weight_decay * m.weight_decay_scale
        return MuonMatrices(lambda step: mult * m.lr_scale * schedule(step), m, decay, transposed)

    groups = []
    if lora_plus_ratio is not None and lora_plus_ratio != 1:
        k = lora_plus_ratio
        b = muon(k, True) if adapters else _single(rest, lambda step: k * schedule(step), explicit)
        groups.append((lambda path, w: path.endswith(".lora_b"), b))
    if adapters:
        groups.append((lambda path, w: is_lora(path) and block_matrix(path, w), muon(1.0, True)))
    if cfg.name == "muon":
        groups.append((lambda path, w: not is_lora(path) and block_matrix(path, w), muon(1.0)))
    if not groups:
        return _single(cfg, schedule, explicit)
    optimizers = [o for _, o in groups] + [_single(rest, schedule, explicit)]
    return Composed(optimizers, [f for f, _ in groups])


def _single(cfg, schedule, explicit):
    """One optimizer over every weight (any name but muon)."""
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
    if cfg.name == "adamw8bit":
        return AdamW8bit(
            schedule, cfg.betas, cfg.eps, cfg.bias_correction, weight_decay=cfg.weight_decay
        )
    if cfg.name == "sophia":
        return SophiaMatrices(schedule, cfg.sophia, weight_decay=cfg.weight_decay)
    return SGDMatrices(learning_rate=schedule, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def optimizer_for(recipe, total_steps: int):
    """The optimizer the recipe names, driven by its learning-rate schedule."""
    s = recipe.schedule
    schedule = make_schedule(
        s.name, recipe.optimizer.lr, total_steps, s.warmup_steps, s.min_lr, s.decay_fraction
    )
    a = recipe.adapter
    ratio = a.lora_plus_ratio if a.type != "full" else None
    return build_optimizer(recipe.optimizer, schedule, recipe.explicit, ratio)
