"""Tensor parallelism: each rank holds its share of every block's attention heads and MLP
columns, with MLX's sharded linear layers, and every rank computes on the whole batch.

In each block the projections that read the block's input (``q_proj``, ``k_proj``,
``v_proj``, ``gate_proj``, ``up_proj``) become all-to-sharded layers (rank r holds rows r of
their weights: its heads, its MLP columns; their backward sums the input's gradient over
ranks), and those that write back (``o_proj``, ``down_proj``) sharded-to-all ones (rank r
holds the matching columns; the forward sums their outputs over ranks). Quantized layers (a
QLoRA base) split the same way, through MLX's quantized forms.

LoRA splits with its base: over an all-to-sharded layer, B's columns are split with the
layer's rows and A stays whole on every rank (its gradient, a sum of every rank's part, is
summed over ranks in the backward, as is the adapter's input gradient); over a sharded-to-all
layer, A's rows are split with the layer's columns, the low-rank product is summed over ranks
(r values a token) and B stays whole. A mixture's experts split by their columns the same
way (the router whole). What stays whole but is used on one rank's share only (those factors,
a router, per-head norms) has its gradient summed over ranks in the backward; the rest that
stays whole (norms, the residual stream's) gets the same gradient on every rank, so nothing
is all-reduced after the backward: a step's only collectives are the layers' own.

The LM head (a tied embedding too) is split by vocabulary rows (``split_head``): the loss
joins each rank's log-sum-exp and target logit (``split_cross_entropy``) and never gathers
the logits; logits the model computes itself are gathered whole.

A sharded parameter's axis is kept on its module (``_tp_axes``), so a checkpoint is written
whole (each sharded parameter gathered along its axis) and read back at any world size or
strategy, and ``unshard`` builds the ordinary layers again for exports.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    shard_linear,
    sum_gradients,
)
from mlx.utils import tree_flatten, tree_unflatten

from .adapters import DoRALinear, DoRASwitchLinear, LoRALinear, LoRASwitchLinear, dropout_input
from .kernels import linear_cross_entropy
from .models import module_at

TO_SHARDED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections that read a block's input: split by their output rows."""
FROM_SHARDED = ("o_proj", "down_proj")
"""Projections that write back into the residual stream: split by their input columns."""
_HEADS = ("n_heads", "n_kv_heads")


class LoRAToSharded(LoRALinear):
    """LoRA over an all-to-sharded layer: this rank's columns of B, A whole."""

    def __call__(self, x):
        if self._disabled:
            return self.linear(x)
        y = self.linear(x)
        g = self._group
        # the input's and A's gradients are this rank's parts: summed over ranks backward
        xa = sum_gradients(g)(dropout_input(self.dropout, x))
        a = sum_gradients(g)(self.lora_a)
        z = (xa @ a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
        return y + (self.scale * z).astype(y.dtype)


class LoRAFromSharded(LoRALinear):
    """LoRA over a sharded-to-all layer: this rank's rows of A, B whole."""

    def __call__(self, x):
        if self._disabled:
            return self.linear(x)
        y = self.linear(x)
        low = dropout_input(self.dropout, x) @ self.lora_a.astype(x.dtype)
        z = mx.distributed.all_sum(low, group=self._group) @ self.lora_b.astype(x.dtype)
        return y + (self.scale * z).astype(y.dtype)


class SummedLinear(nn.Linear):
    """A whole linear layer (a mixture's router) whose input reaches it with its gradient
    split among the ranks: its weight's gradient, a sum of every rank's part, is summed over
    ranks in the backward."""

    def __call__(self, x):
        g = self._group
        y = x @ sum_gradients(g)(self["weight"]).T
        return y + sum_gradients(g)(self["bias"]) if "bias" in self else y


class SummedRMSNorm(nn.RMSNorm):
    """A whole RMS norm applied to this rank's heads only (Qwen3's q_norm and k_norm): its
    weight's gradient, a sum over every rank's heads, is summed over ranks in the backward."""

    def __call__(self, x):
        return mx.fast.rms_norm(x, sum_gradients(self._group)(self["weight"]), self.eps)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _per_head(attn: nn.Module) -> list[str]:
    """The attention's modules besides its projections that hold weights (per-head norms)."""
    return [
        k
        for k, m in attn.children().items()
        if k not in _PROJECTIONS and isinstance(m, nn.Module) and tree_flatten(m.parameters())
    ]


class LoRASwitchToSharded(LoRASwitchLinear):
    """LoRA over experts split by their output rows: this rank's rows of each B, A whole (its
    gradient summed over ranks)."""

    def _factors(self) -> tuple[mx.array, mx.array]:
        return sum_gradients(self._group)(self.lora_a), self.lora_b


class LoRASwitchFromSharded(LoRASwitchLinear):
    """LoRA over experts split by their input columns: this rank's columns of each A, B whole
    (its gradient summed over ranks); the block sums the outputs over ranks."""

    def _factors(self) -> tuple[mx.array, mx.array]:
        return self.lora_a, sum_gradients(self._group)(self.lora_b)


class _VocabSplit:
    """A head (or tied embedding) holding this rank's rows of the vocabulary, ``_offset`` the
    first one's id: the loss reads them as they are (``split_cross_entropy``); logits the
    model itself computes (generation) are gathered whole."""

    def reading(self, x: mx.array) -> mx.array:
        """``x`` as this rank's rows read it: its gradient, each rank's part, summed."""
        return sum_gradients(self._group)(x)

    def gather_logits(self, z: mx.array) -> mx.array:
        """Logits of this rank's rows, [..., V / N], joined with every rank's: [..., V]."""
        return _gather(z, z.ndim - 1, self._group)


class VocabSplitLinear(_VocabSplit, nn.Linear):
    def __call__(self, x):
        return self.gather_logits(super().__call__(self.reading(x)))


class VocabSplitEmbedding(_VocabSplit, nn.Embedding):
    def __call__(self, ids):
        """Each token's row, from the rank that holds it (summed over ranks)."""
        k = self["weight"].shape[0]
        local = ids - self._offset
        inside = (local >= 0) & (local < k)
        rows = self["weight"][mx.where(inside, local, 0)] * inside[..., None]
        return mx.distributed.all_sum(rows, group=self._group)

    def as_linear(self, x):
        return self.gather_logits(super().as_linear(self.reading(x)))


def split_head(model: nn.Module, head_path: str, softcap, group) -> str | None:
    """The LM head (a tied embedding: the input embedding too) split by vocabulary rows among
    the ranks of ``group``, in place; or why it stays whole."""
    head = module_at(model, head_path)
    n, r = group.size(), group.rank()
    if type(head) not in (nn.Linear, nn.Embedding):
        return f"a {type(head).__name__} head (quantized) is not split"
    if softcap is not None:
        return "a soft-capped head's label smoothing needs every logit"
    vocab = head.weight.shape[0]
    if vocab % n:
        return f"a vocabulary of {vocab} does not divide by {n} ranks"
    trains = _trainable_names(head)
    held = dict(tree_flatten(head.parameters()))
    head.update(tree_unflatten([(k, _rows(v, 0, n, r)) for k, v in held.items()]))
    object.__setattr__(head, "_tp_from", type(head))
    head.__class__ = VocabSplitLinear if type(head) is nn.Linear else VocabSplitEmbedding
    object.__setattr__(head, "_group", group)
    object.__setattr__(head, "_offset", r * (vocab // n))
    object.__setattr__(head, "_tp_axes", {k: 0 for k in held})
    head.freeze()
    if trains:
        head.unfreeze(keys=sorted(trains), strict=False)
    return None


def vocab_split(head: nn.Module) -> tuple | None:
    """(group, first row's id) of a head split by vocabulary, else None."""
    return (head._group, head._offset) if isinstance(head, _VocabSplit) else None


def split_cross_entropy(h, weight, targets, where: tuple, *, ignore_index, label_smoothing,
                        reduction, **kernel):  # fmt: skip
    """``linear_cross_entropy`` over a head whose vocabulary rows are split among ranks
    (``weight``: this rank's rows; ``where``: ``vocab_split``'s): each rank's kernel gives
    its rows' log-sum-exp (from the loss against a row it holds) and the target's logit where
    it holds it; the ranks' log-sum-exps meet in one, the target logits in one sum. The
    hidden states' gradient, each rank's part, is summed over ranks."""
    group, offset = where
    h = sum_gradients(group)(h)
    k = weight.shape[0]
    valid = targets != ignore_index
    local = targets - offset
    inside = valid & (local >= 0) & (local < k)
    safe = mx.where(valid, mx.where(inside, local, 0), ignore_index)
    mine, n = linear_cross_entropy(
        h, weight, safe, ignore_index=ignore_index, reduction="none", **kernel
    )
    picked = weight[mx.maximum(safe, 0)].astype(mx.float32)
    z = (h.astype(mx.float32) * picked).sum(-1)  # the logit of the row the kernel read
    lse = mx.logsumexp(mx.distributed.all_gather((mine + z)[None], group=group), axis=0)
    target = mx.distributed.all_sum(mx.where(inside, z, 0.0), group=group)
    per = lse - target
    if label_smoothing:  # against the uniform distribution: the mean logit over the vocabulary
        total = h.astype(mx.float32) @ weight.astype(mx.float32).sum(0)
        mean = mx.distributed.all_sum(total, group=group) / (k * group.size())
        per = (1 - label_smoothing) * per + label_smoothing * (lse - mean)
    per = mx.where(valid, per, 0.0)
    if reduction == "none":
        return per, n
    out = per.sum()
    return (out / mx.maximum(n, 1) if reduction == "mean" else out), n


def _base_axes(layer: nn.Module, prefix: str = "") -> dict[str, int]:
    """The axis each parameter of a sharded linear layer is split along (a sharded-to-all
    layer's bias is whole)."""
    to = isinstance(layer, (AllToShardedLinear, QuantizedAllToShardedLinear))
    names = [k for k, _ in tree_flatten(layer.parameters())]
    return {prefix + k: 0 if to else 1 for k in names if to or k != "bias"}


def _trainable_names(m: nn.Module) -> set[str]:
    return {k.rsplit(".", 1)[-1] for k, _ in tree_flatten(m.trainable_parameters())}


def _rows(a: mx.array, axis: int, n: int, r: int) -> mx.array:
    k = a.shape[axis] // n
    return mx.contiguous(mx.take(a, mx.arange(r * k, (r + 1) * k), axis=axis))


def _split(m: nn.Module, kind: str, group) -> nn.Module:
    """``m`` (a linear layer, or LoRA over one) as this rank's share (``kind``: all-to-sharded
    or sharded-to-all), trainable where ``m`` was."""
    n, r = group.size(), group.rank()
    trains = _trainable_names(m)
    if isinstance(m, LoRALinear):
        base = shard_linear(m.linear, kind, group=group)
        cls = LoRAToSharded if kind == "all-to-sharded" else LoRAFromSharded
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.linear, out.dropout, out.scale = base, m.dropout, m.scale
        if kind == "all-to-sharded":
            out.lora_a, out.lora_b = m.lora_a, _rows(m.lora_b, 1, n, r)
            axes = {**_base_axes(base, "linear."), "lora_b": 1}
        else:
            out.lora_a, out.lora_b = _rows(m.lora_a, 0, n, r), m.lora_b
            axes = {**_base_axes(base, "linear."), "lora_a": 0}
        if m._disabled:
            out._disabled = m._disabled
    else:
        out = shard_linear(m, kind, group=group)
        axes = _base_axes(out)
    object.__setattr__(out, "_group", group)
    object.__setattr__(out, "_tp_axes", axes)
    # the class to build again whole (a QLoRA base's own quantized layer)
    object.__setattr__(out, "_tp_from", type(m.linear if isinstance(m, LoRALinear) else m))
    out.freeze()
    if trains:
        out.unfreeze(keys=sorted(trains), strict=False)
    return out


_SWITCH_AXES = {"all-to-sharded": 1, "sharded-to-all": 2}
"""The axis of an expert stack's weight ([experts, out, in]) each kind splits."""


def _split_experts(m: nn.Module, kind: str, group) -> None:
    """An expert stack (mlx-lm's SwitchLinear, quantized or under LoRA) split in place: each
    expert's output rows (all-to-sharded) or input columns (sharded-to-all)."""
    n, r = group.size(), group.rank()
    axis = _SWITCH_AXES[kind]
    base = m.linear if isinstance(m, LoRASwitchLinear) else m
    names = [k for k, _ in tree_flatten(base.parameters())]
    axes = {k: axis for k in names if k != "bias" or kind == "all-to-sharded"}
    if isinstance(m, LoRASwitchLinear):
        axes = {f"linear.{k}": a for k, a in axes.items()}
        # lora_a [experts, r, in], lora_b [experts, out, r]
        axes.update({"lora_b": 1} if kind == "all-to-sharded" else {"lora_a": 2})
        m.__class__ = LoRASwitchToSharded if kind == "all-to-sharded" else LoRASwitchFromSharded
    held = dict(tree_flatten(m.parameters()))
    m.update(tree_unflatten([(k, _rows(held[k], a, n, r)) for k, a in axes.items()]))
    object.__setattr__(m, "_group", group)
    object.__setattr__(m, "_tp_axes", axes)


def _moe_refusal(mlp: nn.Module, i: int) -> str | None:
    """Why block ``i``'s mixture of experts cannot be split, or None."""
    experts = getattr(mlp, "switch_mlp", None)
    if experts is None or not hasattr(mlp, "sharding_group") or "gate" not in mlp:
        return f"block {i}'s mixture has no stack of experts and router mlxtune splits"
    if any(p not in experts for p in ("gate_proj", "up_proj", "down_proj")):
        return f"block {i}'s experts are not gate, up and down projections"
    if any(isinstance(experts[p], DoRASwitchLinear) for p in ("gate_proj", "up_proj", "down_proj")):
        return "DoRA's magnitude needs each row's whole norm: use lora"
    return None


def refusal(model: nn.Module, n: int) -> str | None:
    """Why ``model``'s blocks cannot be split among ``n`` ranks, or None."""
    blocks = list(getattr(model, "layers", None) or [])
    if not blocks:
        return "this model has no list of blocks to split"
    for i, b in enumerate(blocks):
        attn, mlp = getattr(b, "self_attn", None), getattr(b, "mlp", None)
        if attn is None or mlp is None:
            return f"block {i} has no self_attn and mlp to split"
        missing = [p for p in ("q_proj", "k_proj", "v_proj", "o_proj") if p not in attn]
        mixture = "switch_mlp" in mlp
        if mixture and (why := _moe_refusal(mlp, i)) is not None:
            return why
        if not mixture:
            missing += [p for p in ("gate_proj", "up_proj", "down_proj") if p not in mlp]
        missing += [h for h in _HEADS if not isinstance(getattr(attn, h, None), int)]
        if missing:  # an MoE block, MLA, a fused qkv: not the layout this splits
            return f"block {i} is not split as heads and MLP columns (no {', '.join(missing)})"
        odd = [k for k in _per_head(attn) if type(attn[k]) is not nn.RMSNorm]
        if odd:
            return f"block {i}'s attention holds weights mlxtune does not split ({', '.join(odd)})"
        dense = [] if mixture else [mlp[p] for p in TO_SHARDED[3:]]
        for m in [*(attn[p] for p in TO_SHARDED[:3]), *dense]:
            if isinstance(m, DoRALinear):
                return "DoRA's magnitude needs each row's whole norm: use lora"
        heads, kv = attn.n_heads, attn.n_kv_heads
        up = mlp["switch_mlp"]["gate_proj"] if mixture else mlp["gate_proj"]
        up = up.linear if isinstance(up, LoRALinear) else up
        width = up["scales" if "scales" in up else "weight"].shape[-2]
        if heads % n or kv % n:
            return f"{heads} attention heads and {kv} key/value heads do not divide by {n} ranks"
        if width % n:
            return f"an MLP of {width} columns does not divide by {n} ranks"
        group_size = getattr(up, "group_size", None)
        if group_size and (width // n) % group_size:
            return f"a quantized MLP of {width} columns, in groups of {group_size}, does not split in {n}"
    return None


def shard_tensors(model: nn.Module, group) -> int:
    """Every block's heads and MLP columns split among the ranks of ``group``, in place
    (``refusal`` first says whether they can be); the number of blocks."""
    n = group.size()
    blocks = list(model.layers)
    for b in blocks:
        attn, mlp = b.self_attn, b.mlp
        object.__setattr__(attn, "_tp_heads", (attn.n_heads, attn.n_kv_heads))
        for p in ("q_proj", "k_proj", "v_proj"):
            attn[p] = _split(attn[p], "all-to-sharded", group)
        attn["o_proj"] = _split(attn["o_proj"], "sharded-to-all", group)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // n, attn.n_kv_heads // n
        for k in _per_head(attn):  # whole, applied to this rank's heads
            attn[k].__class__ = SummedRMSNorm
            object.__setattr__(attn[k], "_group", group)
        if "switch_mlp" in mlp:  # each expert's columns split; the block sums over ranks
            for p in ("gate_proj", "up_proj"):
                _split_experts(mlp["switch_mlp"][p], "all-to-sharded", group)
            _split_experts(mlp["switch_mlp"]["down_proj"], "sharded-to-all", group)
            if type(mlp["gate"]) is nn.Linear:  # (a quantized router is frozen: no sum)
                mlp["gate"].__class__ = SummedLinear
                object.__setattr__(mlp["gate"], "_group", group)
            mlp.sharding_group = group
            continue
        for p in ("gate_proj", "up_proj"):
            mlp[p] = _split(mlp[p], "all-to-sharded", group)
        mlp["down_proj"] = _split(mlp["down_proj"], "sharded-to-all", group)
    return len(blocks)


def _split_modules(model: nn.Module):
    return [(p, m) for p, m in model.named_modules() if getattr(m, "_tp_axes", None)]


def sharded_axes(model: nn.Module) -> dict[str, int]:
    """Every split parameter's path, with the axis it is split along."""
    return {
        f"{path}.{k}": axis for path, m in _split_modules(model) for k, axis in m._tp_axes.items()
    }


def _group_of(model: nn.Module):
    found = _split_modules(model)
    return found[0][1]._group if found else None


def _gather(a: mx.array, axis: int, group) -> mx.array:
    """``a`` joined with every rank's along ``axis`` (in rank order)."""
    if axis == 0:
        return mx.distributed.all_gather(a, group=group)
    moved = mx.moveaxis(a, axis, 0)
    return mx.moveaxis(mx.distributed.all_gather(moved, group=group), 0, axis)


def _param_axis(key: str, axes: dict[str, int], shape: tuple) -> int | None:
    """The axis of the split parameter ``key`` belongs to (a parameter's path, or an entry of
    an optimizer's state for it), None when it is whole."""
    name = key
    while name:
        if name in axes:
            return axes[name] if len(shape) > axes[name] else None
        name = name.rpartition(".")[0]
    return None


def whole_tree(model: nn.Module, flat: dict[str, mx.array]) -> dict[str, mx.array]:
    """``flat`` (trainable parameters, an optimizer's state, fp32 masters) with every split
    value gathered whole along its axis. Lazy: each is one collective when computed, so every
    rank computes them all, in this order."""
    axes, group = sharded_axes(model), _group_of(model)
    out = {}
    for k, v in flat.items():
        axis = _param_axis(k, axes, v.shape) if group is not None else None
        out[k] = v if axis is None else _gather(v, axis, group)
    return out


def whole_trainable(model: nn.Module) -> dict[str, mx.array]:
    """What trains, whole (gathered: every rank calls it), under the model's own names."""
    return whole_tree(model, dict(tree_flatten(model.trainable_parameters())))


def pieces_of_whole(model: nn.Module, keys: list[str], whole: dict[str, mx.array]) -> dict:
    """This rank's values for ``keys`` from ``whole`` (written at any world size)."""
    axes, group = sharded_axes(model), _group_of(model)
    out = {}
    for k in keys:
        if k not in whole:
            continue
        v = whole[k]
        axis = _param_axis(k, axes, v.shape) if group is not None else None
        out[k] = v if axis is None else _rows(v, axis, group.size(), group.rank())
    return out


def put_whole_trainable(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Set what trains from whole values: each rank keeps its share of the split ones."""
    model.update(tree_unflatten(list(pieces_of_whole(model, list(weights), weights).items())))


def whole_shapes(model: nn.Module) -> dict[str, tuple]:
    """What trains, with each parameter's whole shape."""
    axes, group = sharded_axes(model), _group_of(model)
    out = {}
    for k, v in tree_flatten(model.trainable_parameters()):
        shape = list(v.shape)
        if k in axes and group is not None:
            shape[axes[k]] *= group.size()
        out[k] = tuple(shape)
    return out


def sharded_paths(model: nn.Module) -> set[str]:
    """The split parameters: their squares sum over ranks for a gradient norm."""
    return set(sharded_axes(model))


def _whole_linear(m: nn.Module, axes: dict[str, int], cls: type, group) -> nn.Module:
    """The ordinary layer (of class ``cls``) a split one came from, its parameters gathered
    along ``axes``."""
    held = dict(tree_flatten(m.parameters()))
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    if "scales" in held:
        layer.group_size, layer.bits, layer.mode = m.group_size, m.bits, m.mode
    for k, v in held.items():
        layer[k] = _gather(v, axes[k], group) if k in axes else v
    return layer


def _whole(m: nn.Module) -> nn.Module:
    group, trains, axes = m._group, _trainable_names(m), m._tp_axes
    if isinstance(m, LoRALinear):
        out = LoRALinear.__new__(LoRALinear)
        nn.Module.__init__(out)
        inner = {k.removeprefix("linear."): a for k, a in axes.items() if k.startswith("linear.")}
        out.linear = _whole_linear(m.linear, inner, m._tp_from, group)
        out.dropout, out.scale = m.dropout, m.scale
        a_axis, b_axis = axes.get("lora_a"), axes.get("lora_b")
        out.lora_a = m.lora_a if a_axis is None else _gather(m.lora_a, a_axis, group)
        out.lora_b = m.lora_b if b_axis is None else _gather(m.lora_b, b_axis, group)
        if m._disabled:
            out._disabled = m._disabled
    else:
        out = _whole_linear(m, axes, m._tp_from, group)
    out.freeze()
    if trains:
        out.unfreeze(keys=sorted(trains), strict=False)
    return out


def _whole_experts(m: nn.Module) -> None:
    """A split expert stack whole again, in place."""
    held = dict(tree_flatten(m.parameters()))
    m.update(tree_unflatten([(k, _gather(held[k], a, m._group)) for k, a in m._tp_axes.items()]))
    if isinstance(m, (LoRASwitchToSharded, LoRASwitchFromSharded)):
        m.__class__ = LoRASwitchLinear
    object.__delattr__(m, "_tp_axes")


def unshard_tensors(model: nn.Module) -> int:
    """Every split layer back to the ordinary one with whole parameters, and every attention
    back to its head counts, in place (every rank must call it: the gathers are collectives);
    the number of blocks."""
    for _, m in model.named_modules():  # a head split by vocabulary: whole, in place
        if isinstance(m, _VocabSplit):
            held = dict(tree_flatten(m.parameters()))
            m.update(tree_unflatten([(k, _gather(v, 0, m._group)) for k, v in held.items()]))
            m.__class__ = m._tp_from
            object.__delattr__(m, "_tp_axes")
    blocks = list(getattr(model, "layers", None) or [])
    n = 0
    for b in blocks:
        attn, mlp = getattr(b, "self_attn", None), getattr(b, "mlp", None)
        heads = getattr(attn, "_tp_heads", None) if attn is not None else None
        if heads is None:
            continue
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attn[p] = _whole(attn[p])
        if "switch_mlp" in mlp:
            for p in ("gate_proj", "up_proj", "down_proj"):
                _whole_experts(mlp["switch_mlp"][p])
            if type(mlp["gate"]) is SummedLinear:
                mlp["gate"].__class__ = nn.Linear
            mlp.sharding_group = None
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                mlp[p] = _whole(mlp[p])
        attn.n_heads, attn.n_kv_heads = heads
        for k in _per_head(attn):
            if type(attn[k]) is SummedRMSNorm:
                attn[k].__class__ = nn.RMSNorm
        object.__delattr__(attn, "_tp_heads")
        n += 1
    mx.eval(model.parameters())
    return n


def is_split(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is split among ranks."""
    return bool(_split_modules(model))


__all__ = [
    "FROM_SHARDED",
    "TO_SHARDED",
    "LoRAFromSharded",
    "LoRAToSharded",
    "is_split",
    "pieces_of_whole",
    "put_whole_trainable",
    "refusal",
    "shard_tensors",
    "split_cross_entropy",
    "split_head",
    "vocab_split",
    "sharded_axes",
    "sharded_paths",
    "unshard_tensors",
    "whole_shapes",
    "whole_trainable",
    "whole_tree",
]
