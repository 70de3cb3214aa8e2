"""Mixture-of-experts routers: finding them in any mlx-lm model, seeing their logits on a forward
pass, and the load-balancing loss over them (Switch Transformer's, as transformers computes it
for Mixtral and Qwen-MoE)."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ..errors import UserInputError
from .parts import module_at

SWITCH = (SwitchLinear, QuantizedSwitchLinear)
"""mlx-lm's layers holding a mixture's experts (their projections stacked)."""

_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mlxtune_router_logits", default=None
)


def router_paths(model: nn.Module) -> list[str]:
    """``named_modules`` paths of the model's routers: in each transformer block, the linear
    layers of a module holding experts whose output is one logit an expert."""
    found = set()
    for block in model.layers:
        for _, mod in block.named_modules():
            experts = {m.num_experts for _, m in mod.named_modules() if isinstance(m, SWITCH)}
            if not experts:
                continue
            for _, m in mod.named_modules():
                if not isinstance(m, SWITCH) and "linear" not in m and _out_dims(m) in experts:
                    found.add(id(m))
                elif isinstance(m.get("linear"), nn.Module) and _out_dims(m) in experts:
                    found.add(id(m))  # an adapter around a router: the adapter's output
    paths = [p for p, m in model.named_modules() if id(m) in found]
    # a router inside an adapter is seen through the adapter
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths)]


def _out_dims(m: nn.Module) -> int | None:
    """A linear layer's output size (an adapter's base layer's), else None."""
    if isinstance(m.get("linear"), nn.Module):
        m = m["linear"]
    w = m.get("weight")
    return int(w.shape[0]) if isinstance(w, mx.array) and w.ndim == 2 else None


def experts_per_token(model: nn.Module) -> int | None:
    """How many experts the config says each token is routed to."""
    args = getattr(model, "args", None)
    for where in (args, getattr(args, "text_config", None)):
        for key in ("num_experts_per_tok", "moe_topk", "top_k"):
            v = where.get(key) if isinstance(where, dict) else getattr(where, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


class _Seen:
    def __call__(self, x):
        y = super().__call__(x)
        seen = _SEEN.get()
        if seen is not None:
            seen.append(y)
        return y


_CLASSES: dict[type, type] = {}


@contextmanager
def router_logits(model: nn.Module, paths: list[str]):
    """Inside the block, each call of a router at ``paths`` appends its logits [..., experts]
    to the yielded list (in call order)."""
    mods = [module_at(model, p) for p in paths]
    classes = [type(m) for m in mods]
    seen: list = []
    token = _SEEN.set(seen)
    for m, cls in zip(mods, classes, strict=True):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Seen{cls.__name__}", (_Seen, cls), {})
        m.__class__ = _CLASSES[cls]
    try:
        yield seen
    finally:
        _SEEN.reset(token)
        for m, cls in zip(mods, classes, strict=True):
            m.__class__ = cls


def load_balancing_loss(logits: list[mx.array], k: int, valid: mx.array | None = None):
    """Switch Transformer's auxiliary loss over every router call's logits (each [B, T, E] or
    [B*T, E], ``valid`` [B, T] marking the positions that count), as transformers computes it:
    ``E * sum_e c_e * P_e``, ``c_e`` the tokens routed to expert e (among each token's top
    ``k``) per token, ``P_e`` the mean softmax probability of e, over all layers' tokens
    together. It is k when routing is uniform and grows as it concentrates."""
    if not logits:
        raise UserInputError("the model has no router logits to balance", "objective")
    flat = mx.concatenate([z.reshape(-1, z.shape[-1]).astype(mx.float32) for z in logits])
    e = flat.shape[-1]
    probs = mx.softmax(flat, axis=-1)
    top = mx.argpartition(-mx.stop_gradient(probs), k - 1, axis=-1)[:, :k]
    chosen = (mx.arange(e)[None, None, :] == top[:, :, None]).astype(mx.float32).sum(axis=1)
    if valid is None:
        w = mx.ones((flat.shape[0],), mx.float32)
    else:
        w = mx.tile(valid.reshape(-1).astype(mx.float32), len(logits))
    total = mx.maximum(w.sum(), 1.0)
    f = (chosen * w[:, None]).sum(axis=0) / total
    p = (probs * w[:, None]).sum(axis=0) / total
    return e * (f * p).sum()
