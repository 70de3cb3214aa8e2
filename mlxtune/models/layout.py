"""The Hugging Face layout of a model's weights, found by inverting mlx-lm's own ``sanitize``.

mlx-lm reads a checkpoint through each family's ``Model.sanitize``, which turns the published
layout into the one its modules hold: a mixture's experts stacked into one ``switch_mlp`` tensor
per projection, depthwise conv weights as MLX's ``[channels, kernel, 1]``, a ``(1 + w)`` norm
stored as ``w + 1``. A model saved as held loads back in mlx-lm, but transformers (and any tool
of the field) reads the published layout only.

Each candidate layout is built from the held weights by the few rewrites the families'
sanitize functions undo (experts one by one under the names families use, a gate/up pair
concatenated, conv weights transposed, a projection named after its module made that module's
own weight, the ``model.`` prefix taken off), and a candidate counts
only when the family's own ``sanitize`` turns it back into exactly the held weights. The one
per-family table (``_PREFIXES``) names what no round trip can tell: which of several forms a
sanitize reads is the published one (GPT-NeoX's). Offsets sanitize adds
(the ``+ 1`` of a shifted norm) are read off that same round trip and taken back out.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .moe import SWITCH

# expert projection names under switch_mlp -> the names published checkpoints use per expert
_EXPERT_NAMES = (
    {},  # gate_proj / up_proj / down_proj (Qwen, DeepSeek, OLMoE, ...)
    {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},  # Mixtral, PhiMoE
    {"fc1": "up_proj", "fc2": "down_proj"},  # Nemotron-H
)


def _by_expert_layer(weights: dict, stacked: dict):
    """(key, array, (block, projection, module path, leaf) or None) for every weight: the
    stacked expert layers' weights with where they sit, the rest with None."""
    for k, v in weights.items():
        module, _, leaf = k.rpartition(".")
        place = stacked.get(module)
        yield k, v, (*place, module, leaf) if place else None


def _unstacked(weights: dict, stacked: dict, names: dict) -> dict | None:
    """Each expert's projection under ``<block>.experts.<e>.<name>``."""
    out = {}
    for k, v, place in _by_expert_layer(weights, stacked):
        if place is None:
            out[k] = v
            continue
        block, proj, _, leaf = place
        for e in range(v.shape[0]):
            out[f"{block}.experts.{e}.{names.get(proj, proj)}.{leaf}"] = v[e]
    return out


def _concatenated(weights: dict, stacked: dict) -> dict | None:
    """Experts as one ``input_linear`` (gate and up, joined on the output axis) and one
    ``output_linear`` tensor (Granite MoE)."""
    out = {}
    for k, v, place in _by_expert_layer(weights, stacked):
        if place is None:
            out[k] = v
            continue
        block, proj, module, leaf = place
        if proj == "gate_proj":
            up = weights.get(f"{module.rpartition('.')[0]}.up_proj.{leaf}")
            if up is None:
                return None
            out[f"{block}.input_linear.{leaf}"] = mx.concatenate([v, up], axis=1)
        elif proj == "down_proj":
            out[f"{block}.output_linear.{leaf}"] = v
        elif proj != "up_proj":
            return None
    return out


def _sanitized(model: nn.Module, weights: dict) -> dict | None:
    """The family's ``sanitize`` of ``weights``, run on fresh handles: some sanitize in place
    (Falcon-H1's ``param *= multiplier``), which would change the arrays held (and leaves the
    handle the same object, so identity says nothing about what it did)."""
    try:
        return dict(model.sanitize({k: mx.array(v) for k, v in weights.items()}))
    except (KeyError, ValueError, IndexError, TypeError, AttributeError):
        return None


def _undone(before: mx.array, after: mx.array):
    """What sanitize did to ``before`` (giving ``after``), as a way to take it back out of a
    held weight: ("shift", c) when it added one constant (a ``1 + w`` norm), ("scale", per row)
    when it scaled each row (Falcon-H1's multipliers folded into its weights), ("transpose",)
    when it transposed a matrix (GPT-2's Conv1D weights, published [in, out]); None for
    anything else."""
    a, b = before.astype(mx.float32), after.astype(mx.float32)
    if a.shape == b.shape and _equal(a, b):  # left as it was (most weights)
        return None
    if a.ndim == 2 and b.shape == a.shape[::-1] and _equal(b, a.T):
        return ("transpose",)
    if a.ndim == 0 or a.shape != b.shape:  # a scalar, or a reshape (a squeeze): no value changed
        return None
    if a.ndim == 1:
        shift = b - a
        c = shift[0].item()
        if c != 0 and mx.all(mx.abs(shift - c) <= 1e-6 * max(1.0, abs(c))).item():
            return ("shift", c)
    rows = a.reshape(a.shape[0], -1) if a.ndim > 1 else a[:, None]
    out = b.reshape(rows.shape)
    pick = mx.argmax(mx.abs(rows), axis=1, keepdims=True)  # each row's largest entry
    scale = mx.take_along_axis(out, pick, axis=1) / mx.take_along_axis(rows, pick, axis=1)
    if mx.all(mx.isfinite(scale)).item() and mx.allclose(rows * scale, out, rtol=1e-5, atol=1e-6):
        if not mx.allclose(scale, mx.ones_like(scale)).item():
            mx.eval(scale)
            return ("scale", scale)
    return None


def _take_out(op, held: mx.array) -> mx.array:
    """``held`` with ``op`` (from ``_undone``) taken back out."""
    if op[0] == "transpose":
        return held.T
    h = held.astype(mx.float32)
    if op[0] == "shift":
        return (h - op[1]).astype(held.dtype)
    rows = h.reshape(op[1].shape[0], -1)
    return (rows / op[1]).reshape(held.shape).astype(held.dtype)


def _source(k: str, candidate: dict) -> str | None:
    """The candidate's key that sanitize reads back as held key ``k``: the same, or without
    the ``model.`` prefix sanitize adds (GPT-2's)."""
    if k in candidate:
        return k
    bare = k.removeprefix("model.")
    return bare if bare in candidate else None


def _offsets(model: nn.Module, candidate: dict, held: dict) -> dict | None:
    """What sanitize does to ``candidate``'s weights that must be taken back out of the held
    ones (see ``_undone``): {candidate key: (held key, op)}; None when sanitize does not read
    ``candidate`` back to the held keys."""
    back = _sanitized(model, candidate)
    if back is None or back.keys() != held.keys():
        return None
    ops = {}
    for k in list(back):
        v = back.pop(k)  # one at a time: what was evaluated goes with it
        c = _source(k, candidate)
        if c is None:
            continue
        op = _undone(candidate[c], v)
        if op is not None:
            ops[c] = (k, op)
    return ops


def _round_trips(model: nn.Module, candidate: dict, held: dict) -> bool:
    back = _sanitized(model, candidate)
    if back is None or back.keys() != held.keys():
        return False
    for k in list(back):
        v = back.pop(k)  # one at a time: what was evaluated goes with it
        if v.shape != held[k].shape:
            return False
        b = held[k]
        top = max((mx.abs(b[r]).max().item() for r in _row_blocks(b)), default=0.0)
        atol = 1e-6 * (1 + top)
        for r in _row_blocks(v):
            a_r, b_r = v[r].astype(mx.float32), b[r].astype(mx.float32)
            if not mx.allclose(a_r, b_r, rtol=0, atol=atol).item():
                return False
    return True


_COMPARED = 1 << 22
"""The most elements a comparison of a weight with its read-back computes at once: the
search's stand-ins of a large weight cost nothing held, but an elementwise comparison of two
of them computes at the weight's full size (an 8B model's head: 4.7 GB of temporaries)."""


def _row_blocks(a: mx.array) -> list:
    """Slices of ``a``'s first axis of about ``_COMPARED`` elements each (all of a scalar)."""
    if a.ndim == 0 or a.size <= _COMPARED:
        return [...]
    step = max(1, _COMPARED // max(1, a.size // a.shape[0]))
    return [slice(i, i + step) for i in range(0, a.shape[0], step)]


def _equal(a: mx.array, b: mx.array) -> bool:
    """Whether two arrays of one shape are equal, compared a block of rows at a time."""
    return all(mx.array_equal(a[r], b[r]).item() for r in _row_blocks(a))


def _held_forms(model: nn.Module) -> tuple[dict, set]:
    """The stacked expert layers ({path: (block, projection)}) and conv layers of ``model``."""
    stacked, convs = {}, set()
    for path, m in model.named_modules():
        if isinstance(m, SWITCH):
            container, _, proj = path.rpartition(".")
            stacked[path] = (container.rpartition(".")[0], proj)
        elif isinstance(m, nn.Conv1d):
            convs.add(f"{path}.weight")
    return stacked, convs


def _renamed(weights: dict, names: dict) -> dict:
    """Every projection named ``names`` names it (dense MLPs as well as experts: LFM2-MoE)."""
    out = {}
    for k, v in weights.items():
        module, _, leaf = k.rpartition(".")
        parent, _, proj = module.rpartition(".")
        out[f"{parent}.{names[proj]}.{leaf}" if proj in names else k] = v
    return out


def _mla_joined(weights: dict) -> dict:
    """Multi-head latent attention's per-head ``embed_q`` ([heads, rank, nope]) and
    ``unembed_out`` ([heads, v, rank]) as the one ``kv_b_proj`` ([heads * (nope + v), rank])
    checkpoints publish (DeepSeek V2/V3, GLM-4 MoE Lite, Kimi, Mistral 4, ...)."""
    out = {}
    for k, v in weights.items():
        if k.endswith(".embed_q.weight"):
            prefix = k[: -len(".embed_q.weight")]
            up = weights.get(f"{prefix}.unembed_out.weight")
            if up is None:
                return weights
            kv = mx.concatenate([v.swapaxes(-1, -2), up], axis=1)
            out[f"{prefix}.kv_b_proj.weight"] = kv.reshape(-1, kv.shape[-1])
        elif not k.endswith(".unembed_out.weight"):
            out[k] = v
    return out


def _flattened(weights: dict) -> dict | None:
    """A projection named after the module holding it (Bailing's ``gate.gate_proj``) as that
    module's own weight (``gate.weight``), as checkpoints publish it; None without such."""
    out, changed = {}, False
    for k, v in weights.items():
        parts = k.split(".")
        if len(parts) >= 3 and parts[-2] == f"{parts[-3]}_proj":
            out[".".join([*parts[:-2], parts[-1]])] = v
            changed = True
        else:
            out[k] = v
    return out if changed else None


# model_type -> (held prefix, published prefix), the first that matches applied: the names a
# family's transformers class publishes where its sanitize reads several forms
_PREFIXES = {
    "gpt_neox": (
        ("model.h.", "gpt_neox.layers."),
        ("model.embed_out.", "embed_out."),
        ("model.", "gpt_neox."),
    )
}


def _prefixed(k: str, renames) -> str:
    for held, published in renames:
        if k.startswith(held):
            return published + k[len(held) :]
    return k


def _candidates(weights: dict, stacked: dict, convs: set, model_type: str | None = None):
    if stacked:
        layouts = [_unstacked(weights, stacked, n) for n in _EXPERT_NAMES]
        pairs = zip(layouts[1:], _EXPERT_NAMES[1:], strict=True)
        layouts += [_renamed(layout, n) for layout, n in pairs]
        layouts.append(_concatenated(weights, stacked))
    else:
        layouts = [weights] + [_renamed(weights, n) for n in _EXPERT_NAMES[1:]]
    mla = any(k.endswith(".embed_q.weight") for k in weights)
    for layout in layouts:
        if layout is not None:  # MLX's conv weight is [out, kernel, in]; torch's [out, in, kernel]
            layout = {k: v.swapaxes(1, 2) if k in convs else v for k, v in layout.items()}
            layout = _mla_joined(layout) if mla else layout
            yield layout
            flat = _flattened(layout)
            if flat is not None:
                yield flat
    if all(k.startswith("model.") for k in weights):
        # under the transformers model's own names, where sanitize reads more than one form
        # and so cannot tell which is published (GPT-NeoX's), then without the prefix (GPT-2's)
        renames = _PREFIXES.get(model_type)
        if renames:
            yield {_prefixed(k, renames): v for k, v in weights.items()}
        yield {k.removeprefix("model."): v for k, v in weights.items()}


def _scalars_unsqueezed(model: nn.Module, candidate: dict) -> dict | None:
    """``candidate`` with each 0-d weight that the family's ``sanitize`` squeezes from [1] (the
    learned scalars of Apertus' activation, [1] in torch) held as [1]; None without such."""
    scalars = [k for k, v in candidate.items() if v.ndim == 0]
    if not scalars:
        return None
    back = _sanitized(model, {**candidate, **{k: candidate[k].reshape(1) for k in scalars}})
    squeezed = [k for k in scalars if back is not None and k in back and back[k].ndim == 0]
    if not squeezed:
        return None
    return {**candidate, **{k: candidate[k].reshape(1) for k in squeezed}}


_REAL = 1 << 16
"""Weights of up to this many elements take part in finding the layout as they are; larger
ones through a stand-in (``_stand_ins``)."""


def _stand_ins(weights: dict) -> dict:
    """The weights as the layout search reads them, without computing the large ones (a
    model's weights may be lazy: de-quantized or fused, more than memory holds at once). A
    large floating-point weight is stood in for by a broadcast row of distinct values, held
    once whatever the weight's size: every rewrite the search tries (experts split off the
    first axis, pairs joined, axes swapped, a constant added, rows scaled) acts on it as on the
    weight, and each weight's row differs from every other's."""
    out = {}
    for i, (k, v) in enumerate(weights.items()):
        if v.size <= _REAL or not mx.issubdtype(v.dtype, mx.floating):
            out[k] = v
            continue
        n = v.shape[-1]
        row = 1.0 + mx.arange(n, dtype=mx.float32) / n + 0.5 * (i % 97) / 97
        out[k] = mx.broadcast_to(row, v.shape)
    return out


def _layouts(model: nn.Module, weights: dict, stacked: dict, convs: set):
    """Every candidate layout in the search's order."""
    model_type = getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )
    for found in _candidates(weights, stacked, convs, model_type):
        yield found
        yield _scalars_unsqueezed(model, found)


def _search(model: nn.Module, weights: dict, stacked: dict, convs: set):
    """(index of the published layout among ``_layouts``, its ops from ``_offsets``), or None
    where no candidate reads back to ``weights`` through the family's sanitize."""
    # several layouts can read back alike (a sanitize that renames w1 -> gate_proj also keeps
    # gate_proj): the published one is the layout sanitize rewrites most, so take that
    stand_ins = _stand_ins(weights)
    found, most = None, -1
    for i, candidate in enumerate(_layouts(model, stand_ins, stacked, convs)):
        if candidate is None:
            continue
        ops = _offsets(model, candidate, stand_ins)
        if ops is None:
            continue
        fixed = {**candidate, **{c: _take_out(op, stand_ins[h]) for c, (h, op) in ops.items()}}
        if not _round_trips(model, fixed, stand_ins):
            continue
        rewritten = len(fixed.keys() - stand_ins.keys()) + sum(
            fixed[k] is not stand_ins.get(k) for k in fixed.keys() & stand_ins.keys()
        )
        if rewritten > most:
            found, most = (i, ops), rewritten
    return found


def _searchable(model: nn.Module, weights: dict):
    """(stacked expert layers, conv weights, whether a layout must be found), and whether a
    search can run at all (not over quantized weights, nor without a sanitize)."""
    stacked, convs = _held_forms(model)
    convs &= weights.keys()
    needs = bool(stacked or convs) or any(k.endswith(".embed_q.weight") for k in weights)
    can = not any(k.endswith(".scales") for k in weights) and hasattr(model, "sanitize")
    return stacked, convs, needs, can


def hf_weights(model: nn.Module, weights: dict) -> tuple[dict, bool]:
    """(weights in the published layout, True), or (``weights`` as held, False) when the
    model holds experts or conv layers and no rewrite round-trips through the family's
    ``sanitize``. Quantized experts stay stacked (mlx-lm's quantized checkpoints hold them so).
    The weights stay as lazy as they come: the search runs on stand-ins (``_stand_ins``), and
    the layout it finds is then built from the weights themselves."""
    stacked, convs, needs, can = _searchable(model, weights)
    found = _search(model, weights, stacked, convs) if can else None
    if found is None:
        return weights, not needs
    i, ops = found
    candidate = next(c for j, c in enumerate(_layouts(model, weights, stacked, convs)) if j == i)
    return {**candidate, **{c: _take_out(op, weights[h]) for c, (h, op) in ops.items()}}, True


def transposed_when_published(model: nn.Module, held: dict) -> set[str]:
    """The held weights the published layout holds transposed (GPT-2's Conv1D, [in, out])."""
    stacked, convs, _, can = _searchable(model, held)
    found = _search(model, held, stacked, convs) if can else None
    return {h for h, op in (found[1].values() if found else ()) if op[0] == "transpose"}


def published_names(model: nn.Module, held: dict) -> dict[str, str]:
    """Held parameter name -> its name in the published layout, for the parameters that layout
    keeps as they are under another name (LFM2-MoE's dense ``gate_proj`` is ``w1``); the rest
    keep theirs. ``held``: the model's plain weights (adapters' base weights at their paths)."""
    published, _ = hf_weights(model, held)
    by_value = {id(v): k for k, v in published.items()}
    return {k: by_value.get(id(v), k) for k, v in held.items()}


__all__ = ["hf_weights", "published_names", "transposed_when_published"]
