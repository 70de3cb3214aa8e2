"""LoRA and DoRA layers, putting them into a model by layer name and layer range, and turning
them off for a while (the base model as a frozen reference, at no extra memory).

Parameter names and orientation follow mlx-lm (``lora_a`` [in, r], ``lora_b`` [r, out]), so an
adapter file mlxtune writes is an mlx-lm adapter file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .errors import UserInputError
from .models.context import current, dropout_key
from .models.moe import SWITCH as _SWITCH
from .models.quantize import DequantizingLinear, DequantizingSwitchLinear, dense_weight

__all__ = [
    "DoRALinear",
    "DoRASwitchLinear",
    "LoRALinear",
    "LoRASwitchLinear",
    "adapters_disabled",
    "apply_adapters",
    "dropout_input",
    "dropout_key",
    "lora_scale",
    "select_layers",
]


def _base_dims(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or QuantizedLinear."""
    out_dims, in_dims = base.weight.shape
    if isinstance(base, nn.QuantizedLinear):
        in_dims = in_dims * 32 // base.bits
    return in_dims, out_dims


def dropout_input(layer: nn.Dropout, x: mx.array) -> mx.array:
    """``layer(x)``, with the mask from the active dropout_key when there is one."""
    keys = current().dropout_keys
    if keys is None or not layer.training or layer._p_1 == 1:
        return layer(x)
    sub = keys.next()
    mask = mx.random.bernoulli(layer._p_1, x.shape, key=sub)
    return (mask * x) * (1 / layer._p_1)


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """What LoRA's update is multiplied by: alpha / rank, or alpha / sqrt(rank) (rsLoRA: the
    update's size then stays put as the rank grows)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


class LoRALinear(nn.Module):
    """y = base(x) + scale * dropout(x) @ A @ B, with A random and B zero (so y starts = base(x))."""

    @classmethod
    def from_base(
        cls,
        base: nn.Module,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        rslora: bool = False,
    ):
        in_dims, out_dims = _base_dims(base)
        layer = cls(in_dims, out_dims, rank, alpha, dropout, rslora)
        layer.linear = base
        return layer

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        rslora: bool = False,
    ):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = lora_scale(alpha, rank, rslora)
        bound = 1.0 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(in_dims, rank))
        self.lora_b = mx.zeros((rank, out_dims))

    # how many adapters_disabled blocks around this layer are open (0: the adapter is on)
    _disabled = 0

    def __call__(self, x):
        if self._disabled:
            return self.linear(x)
        y = self.linear(x)
        z = (dropout_input(self.dropout, x) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(
            x.dtype
        )
        return y + (self.scale * z).astype(y.dtype)

    def delta(self) -> mx.array:
        """The update to the base weight, [out, in]."""
        return self.scale * (self.lora_b.T @ self.lora_a.T)

    def merged(self) -> mx.array:
        """The base weight with the update merged in, in the base's dtype (de-quantized when
        the base is quantized): what a fused export writes, and what QAT quantizes."""
        w = dense_weight(self.linear)
        return (w.astype(mx.float32) + self.delta()).astype(w.dtype)

    def fused(self) -> nn.Linear:
        """A plain Linear with the adapter merged in (de-quantized when the base was quantized)."""
        w = self.merged()
        fused = nn.Linear(w.shape[1], w.shape[0], bias="bias" in self.linear)
        fused.weight = w
        if "bias" in self.linear:
            fused.bias = self.linear.bias
        return fused


class DoRALinear(LoRALinear):
    """Weight-decomposed LoRA: y = m * (W + dW) x / ||W + dW||_row, m starting at ||W||_row."""

    @classmethod
    def from_base(cls, base: nn.Module, *args, **kw):
        """LoRALinear.from_base's layer, with the magnitude m = ||W||_row."""
        layer = super().from_base(base, *args, **kw)
        layer.m = mx.linalg.norm(dense_weight(base).astype(mx.float32), axis=1)
        return layer

    def __call__(self, x):
        if self._disabled:
            return self.linear(x)
        w = dense_weight(self.linear)
        y = x @ w.T
        z = (dropout_input(self.dropout, x) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(
            x.dtype
        )
        out = y + (self.scale * z).astype(y.dtype)
        adapted = w.astype(mx.float32) + self.delta()
        out = out * (self.m / mx.linalg.norm(adapted, axis=1)).astype(out.dtype)
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out

    def merged(self) -> mx.array:
        w = dense_weight(self.linear)
        adapted = w.astype(mx.float32) + self.delta()
        adapted = adapted * (self.m / mx.linalg.norm(adapted, axis=1))[:, None]
        return adapted.astype(w.dtype)


def _switch_weight(base: nn.Module) -> mx.array:
    """A SwitchLinear's [experts, out, in] weight (de-quantized when it is quantized)."""
    if isinstance(base, QuantizedSwitchLinear):
        return mx.dequantize(
            base.weight,
            base.scales,
            base.get("biases"),
            group_size=base.group_size,
            bits=base.bits,
            mode=base.mode,
        )
    return base.weight


class LoRASwitchLinear(LoRALinear):
    """LoRA on a mixture of experts' stacked projections (mlx-lm's ``SwitchLinear``, quantized or
    not): each expert has its own pair, ``lora_a`` [experts, r, in] and ``lora_b``
    [experts, out, r] (mlx-lm's names and layout), and a token's update comes from the experts
    the router picked for it."""

    @classmethod
    def from_base(cls, base, rank=8, alpha=16.0, dropout=0.0, rslora=False):
        layer = cls(
            base.input_dims, base.output_dims, base.num_experts, rank, alpha, dropout, rslora
        )
        layer.linear = base
        return layer

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        experts: int,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        rslora: bool = False,
    ):
        nn.Module.__init__(self)
        self.linear = SwitchLinear(in_dims, out_dims, experts, bias=False)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = lora_scale(alpha, rank, rslora)
        bound = 1.0 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(experts, rank, in_dims))
        self.lora_b = mx.zeros((experts, out_dims, rank))

    def _factors(self) -> tuple[mx.array, mx.array]:
        """(A, B) as the update reads them."""
        return self.lora_a, self.lora_b

    def _update(self, x, indices, sorted_indices):
        a, b = self._factors()
        z = mx.gather_mm(
            dropout_input(self.dropout, x),
            a.swapaxes(-1, -2).astype(x.dtype),
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        )
        return mx.gather_mm(
            z,
            b.swapaxes(-1, -2).astype(x.dtype),
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        )

    def __call__(self, x, indices, sorted_indices=False):
        y = self.linear(x, indices, sorted_indices=sorted_indices)
        if self._disabled:
            return y
        z = self._update(x, indices, sorted_indices)
        return y + (self.scale * z).astype(y.dtype)

    def delta(self) -> mx.array:
        """The update to each expert's weight, [experts, out, in]."""
        return self.scale * (self.lora_b @ self.lora_a)

    def merged(self) -> mx.array:
        """Each expert's weight with its update merged in, [experts, out, in]."""
        w = _switch_weight(self.linear)
        return (w.astype(mx.float32) + self.delta()).astype(w.dtype)

    def fused(self) -> nn.Module:
        """A SwitchLinear with the adapter merged in (de-quantized when the base was quantized)."""
        w = self.merged()
        bias = "bias" in self.linear
        fused = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=bias)
        fused.weight = w
        if bias:
            fused.bias = self.linear.bias
        return fused


class DoRASwitchLinear(LoRASwitchLinear):
    """DoRA on a mixture of experts' projections: each expert's rows rescaled to a trained
    magnitude ``m`` [experts, out], as DoRALinear does for one matrix."""

    @classmethod
    def from_base(cls, base, *args, **kw):
        layer = super().from_base(base, *args, **kw)
        layer.m = mx.linalg.norm(_switch_weight(base).astype(mx.float32), axis=-1)
        return layer

    def __call__(self, x, indices, sorted_indices=False):
        if self._disabled:
            return self.linear(x, indices, sorted_indices=sorted_indices)
        w = _switch_weight(self.linear)
        y = mx.gather_mm(
            x,
            w.swapaxes(-1, -2).astype(x.dtype),
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        )
        out = y + (self.scale * self._update(x, indices, sorted_indices)).astype(y.dtype)
        norms = mx.linalg.norm(w.astype(mx.float32) + self.delta(), axis=-1)  # [experts, out]
        ratio = (self.m / norms)[indices]  # [..., k, out] for each token's experts
        out = out * mx.expand_dims(ratio, -2).astype(out.dtype)
        if "bias" in self.linear:
            out = out + mx.expand_dims(self.linear.bias[indices], -2)
        return out

    def merged(self) -> mx.array:
        w = _switch_weight(self.linear)
        adapted = w.astype(mx.float32) + self.delta()
        adapted = adapted * (self.m / mx.linalg.norm(adapted, axis=-1))[..., None]
        return adapted.astype(w.dtype)


def plain_layer(mod: nn.Module) -> bool:
    """Whether a linear (or experts') layer computes its plain map: a family's subclass with a
    call of its own (one that splits its output into q, k and v, say) is left alone."""
    plain = (nn.Linear, nn.QuantizedLinear, DequantizingLinear, DequantizingSwitchLinear, *_SWITCH)
    return any(type(mod).__call__ is cls.__call__ for cls in plain)


@functools.cache
def _source(cls: type) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _weights_read_directly(block: nn.Module) -> set[int]:
    """ids of layers whose weight the family's code reads or sets itself
    (``self.coefs.weight``) instead of calling the layer: an adapter around one would not be
    seen there."""
    out: set[int] = set()
    for _, parent in block.named_modules():
        code = _source(type(parent))
        for leaf, child in parent.children().items():
            if isinstance(child, nn.Module) and f"self.{leaf}.weight" in code:
                out.add(id(child))
    return out


def _routers(block: nn.Module) -> set[int]:
    """ids of a block's mixture-of-experts routers: the linear layers of a module holding
    experts (SwitchLinear) whose outputs are one a expert, or one (a shared expert's gate)."""
    out: set[int] = set()
    for _, mod in block.named_modules():
        experts = {m.num_experts for _, m in mod.named_modules() if isinstance(m, _SWITCH)}
        if not experts:
            continue
        for _, m in mod.named_modules():
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] in experts | {
                1
            }:
                out.add(id(m))
    return out


def select_layers(n_layers: int, spec) -> list[int]:
    """Layer indices from the recipe's adapter.layers: None/all, N (last N), "a-b", or a list."""
    if spec is None or spec == "all":
        return list(range(n_layers))
    if isinstance(spec, int):
        if spec > n_layers:
            raise UserInputError(
                f"the model has {n_layers} layers, cannot adapt the last {spec}", "adapter.layers"
            )
        return list(range(n_layers - spec, n_layers))
    if isinstance(spec, str):
        a, b = (int(x) for x in spec.split("-"))
        idx = list(range(a, b + 1))
    else:
        idx = sorted(set(spec))
    bad = [i for i in idx if i >= n_layers]
    if bad:
        raise UserInputError(
            f"layer {bad[0]} does not exist (the model has {n_layers}: 0-{n_layers - 1})",
            "adapter.layers",
        )
    return idx


def apply_adapters(
    model: nn.Module,
    kind: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets,
    layers=None,
    rslora: bool = False,
) -> dict:
    """Freeze the base and put adapters in; for "full", everything trains. Returns a summary."""
    if kind == "full":
        model.unfreeze()
        return {"type": "full", "adapted": []}
    dora = kind == "dora"
    model.freeze()
    blocks = model.layers
    chosen = select_layers(len(blocks), layers)
    all_linear = "all-linear" in targets
    adapted = []
    seen_names = set()
    for i in chosen:
        block = blocks[i]
        replace = []
        routers = _routers(block)
        direct = _weights_read_directly(block)
        for name, mod in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            seen_names.add(leaf)
            if id(mod) in direct:
                continue
            if isinstance(mod, _SWITCH) and plain_layer(mod):
                cls = DoRASwitchLinear if dora else LoRASwitchLinear
            elif isinstance(mod, (nn.Linear, nn.QuantizedLinear)) and plain_layer(mod):
                cls = DoRALinear if dora else LoRALinear
            else:
                continue
            # a router stays as trained unless a target names it
            if leaf in targets or (all_linear and id(mod) not in routers):
                replace.append((name, cls.from_base(mod, rank, alpha, dropout, rslora)))
        if replace:
            block.update_modules(tree_unflatten(replace))
            adapted += [f"layers.{i}.{n}" for n, _ in replace]
    if not all_linear:
        missing = [t for t in targets if t not in seen_names]
        if missing:
            linear_names = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in blocks[0].named_modules()
                    if isinstance(m, (nn.Linear, nn.QuantizedLinear, *_SWITCH)) and plain_layer(m)
                }
            )
            raise UserInputError(
                f"no layer named {missing[0]!r} in this model; its linear layers are: {', '.join(linear_names)}",
                "adapter.targets",
            )
    if targets and not adapted:
        raise UserInputError("no linear layer matched adapter.targets", "adapter.targets")
    return {"type": kind, "adapted": adapted, "layers": chosen}


VISION_TARGETS = ("vision", "projector")
"""What ``adapter.targets`` names of a vision-language model's image side: "vision", every
linear layer of its vision tower outside the projector; "projector", those of its projector."""


def adapt_model(
    model: nn.Module,
    kind: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets,
    layers=None,
    rslora: bool = False,
) -> dict:
    """``apply_adapters`` on the language model; a vision-language model's tower and projector
    then frozen (full fine-tuning too trains the language model alone), with adapters where
    ``targets`` names them (``VISION_TARGETS``)."""
    tower = getattr(model, "tower_names", None) is not None
    lm_targets = [t for t in targets if not (tower and t in VISION_TARGETS)]
    info = apply_adapters(model, kind, rank, alpha, dropout, lm_targets, layers, rslora)
    if tower:
        model.freeze_tower()
        if kind != "full":
            info["adapted"] += _adapt_tower(model, kind, rank, alpha, dropout, targets, rslora)
    return info


def _adapt_tower(model, kind, rank, alpha, dropout, targets, rslora) -> list[str]:
    """LoRA/DoRA on the vision tower's and projector's linear layers ``targets`` names."""
    which = {t for t in targets if t in VISION_TARGETS}
    if not which:
        return []
    cls = DoRALinear if kind == "dora" else LoRALinear
    projectors = model.family.projectors
    replace = []
    for top in model.tower_names:
        for name, mod in model.vlm[top].named_modules():
            path = f"{top}.{name}" if name else top
            if not (isinstance(mod, (nn.Linear, nn.QuantizedLinear)) and plain_layer(mod)):
                continue
            is_projector = any(path == p or path.startswith(f"{p}.") for p in projectors)
            if ("projector" if is_projector else "vision") in which:
                replace.append((path, cls.from_base(mod, rank, alpha, dropout, rslora)))
    found = {"projector" if any(p.startswith(q) for q in projectors) else "vision"
             for p, _ in replace}  # fmt: skip
    if which - found:
        raise UserInputError(
            f"this {model.family.name} model's {sorted(which - found)[0]} has no linear layer "
            "an adapter can go in",
            "adapter.targets",
        )
    model.vlm.update_modules(tree_unflatten(replace))
    return [f"vlm.{p}" for p, _ in replace]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every LoRA/DoRA layer of ``model`` computes its base layer alone (no
    adapter branch, no dropout, no DoRA magnitude): the model is its base, a frozen reference
    policy that costs no extra memory. Gradients of a loss computed inside the block with
    respect to the adapters are zero. The layers are restored on exit, also when the block
    raises, and blocks nest.

    It is Python state that each layer reads when it runs, so under ``mx.compile`` it is read
    at trace time: enter it inside the traced function. Entered around a call of a function
    compiled already, it changes nothing that function computes.
    """
    layers = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m._disabled += 1
    try:
        yield model
    finally:
        for m in layers:
            m._disabled -= 1
