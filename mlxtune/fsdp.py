"""Fully sharded data parallelism: each rank holds 1/N of every parameter, gathered for the
forward and the backward of one unit at a time, on MLX's distributed engine.

A unit is a module (a transformer block) whose parameters are sharded together. Each
parameter's rows (axis 0) are cut into N equal runs, the last padded with zero rows; rank r
holds run r as the unit's parameter, so the optimizer, its state and the gradients are 1/N of
the unsharded ones on every rank. Any shape shards, a scalar included (as one row); a piece
keeps its parameter's number of dimensions, so what an optimizer decides by it (weight decay
on matrices only) is decided as for the whole parameter. The padding is at most N - 1 rows a
parameter, and stays zero: its gradient is zero.

Calling a unit gathers its pieces (``all_gather``: one collective for its trainable
parameters, one for its frozen ones), puts the whole parameters in, runs the module and puts
the pieces back: the whole parameters live as long as the computation that uses them. Under
``mx.grad`` the gather of the trainable pieces has its own backward: the whole gradients are
summed over ranks and each rank keeps its piece. Where the backend has ``sum_scatter`` (JACCL,
NCCL) that is one reduce-scatter; where it does not (ring, MPI) it is an ``all_sum`` of the
whole gradients followed by taking the rank's piece, which moves twice the bytes
(``scatter_kind``). Frozen pieces (a LoRA run's base) are gathered without a backward.

The gradients are summed over ranks, not averaged: as in data parallelism, each rank's loss is
already divided by the whole batch's count, so the sum is the one-process gradient.

MLX's own ``nn.fully_shard`` also shards along axis 0, but axis 0 must divide by N and its
backward needs ``sum_scatter``; this module shards any shape and runs on every backend.
"""

from __future__ import annotations

import math
import re
from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .models.checkpointing import checkpoint_block, is_checkpointed, uncheckpoint


@cache
def scatter_kind(group: mx.distributed.Group | None = None) -> str:
    """ "sum_scatter" where the backend reduce-scatters, else "all_sum" (ring, MPI: the whole
    gradients are all-reduced and each rank keeps its piece, twice the bytes moved)."""
    group = group or mx.distributed.init()
    try:
        mx.eval(mx.distributed.sum_scatter(mx.zeros((group.size(),)), group=group))
    except RuntimeError:
        return "all_sum"
    return "sum_scatter"


def piece_shape(shape: tuple, n: int) -> tuple:
    """The shape of one of ``n`` pieces of a parameter of ``shape``: its rows (axis 0) cut in
    ``n`` equal runs, the last padded with zero rows; a scalar is one row of one value."""
    if not shape:
        return (1,)
    return (-(-shape[0] // n), *shape[1:])


def shard_of(a: mx.array, n: int, rank: int) -> mx.array:
    """Piece ``rank`` of ``n`` of ``a``: its rows ``rank * k`` to ``(rank + 1) * k``, ``k``
    rows a piece (``piece_shape``), zero rows past the end. A piece keeps the parameter's
    number of dimensions, so an optimizer that treats matrices apart (weight decay on
    matrices only) treats a matrix's piece as it treats the matrix."""
    shape = piece_shape(a.shape, n)
    rows = a.reshape(1) if a.ndim == 0 else a
    k = shape[0]
    if k * n != rows.shape[0]:
        pad = mx.zeros((k * n - rows.shape[0], *shape[1:]), a.dtype)
        rows = mx.concatenate([rows, pad])
    # a copy: a slice would be a view that keeps the whole parameter's buffer alive
    return mx.contiguous(rows[rank * k : (rank + 1) * k])


def _by_dtype(arrays: list[mx.array]) -> dict:
    """The indices of ``arrays`` by dtype, in order: one collective moves one dtype (codes of a
    quantized weight must not pass through a float)."""
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    return groups


def _gather_fn(group, shapes: list[tuple], with_backward: bool, kind: str):
    """gather(pieces) -> whole parameters of ``shapes``; its backward (``with_backward``) sums
    the whole gradients over ranks and returns this rank's pieces. Rows are contiguous in the
    row-major order, so a piece is a run of its parameter's flattened values: one row of the
    gathered table holds every piece of a rank (of one dtype), side by side."""
    n, rank = group.size(), group.rank()
    pieces = [piece_shape(s, n) for s in shapes]
    sizes = [math.prod(p) for p in pieces]

    def whole_of(run, i):
        s, p = shapes[i], pieces[i]
        rows = run.reshape(n * p[0], *p[1:])
        return rows[: s[0]] if s else rows.reshape(())

    def gather(held):
        out = [None] * len(held)
        for idx in _by_dtype(held).values():
            row = mx.concatenate([held[i].reshape(1, -1) for i in idx], axis=1)
            table = mx.distributed.all_gather(row, group=group)  # [n, the pieces' sizes]
            at = 0
            for i in idx:
                out[i] = whole_of(table[:, at : at + sizes[i]], i)
                at += sizes[i]
        return out

    if not with_backward:
        return lambda held: [mx.stop_gradient(w) for w in gather(held)]

    f = mx.custom_function(gather)

    @f.vjp
    def gather_vjp(held, cotangents, _):
        out = [None] * len(held)
        for idx in _by_dtype(cotangents).values():
            padded = []
            for i in idx:
                c, p = cotangents[i], pieces[i]
                rows = c.reshape(1) if c.ndim == 0 else c
                if p[0] * n != rows.shape[0]:
                    pad = mx.zeros((p[0] * n - rows.shape[0], *p[1:]), rows.dtype)
                    rows = mx.concatenate([rows, pad])
                padded.append(rows.reshape(n, -1))
            table = mx.concatenate(padded, axis=1)  # [n, the pieces' sizes]
            if kind == "sum_scatter":
                mine = mx.distributed.sum_scatter(table, group=group)
            else:
                mine = mx.distributed.all_sum(table, group=group)[rank : rank + 1]
            at = 0
            for i in idx:
                # a copy: a view would keep the unit's whole summed gradients alive until the
                # update
                piece = mine[0, at : at + sizes[i]].reshape(pieces[i]).astype(held[i].dtype)
                out[i] = mx.contiguous(piece)
                at += sizes[i]
        return out

    return f


class ShardedUnit(nn.Module):
    """``module`` with each parameter held as this rank's piece (``shard_of``); called, it
    gathers the whole parameters, runs the module and puts the pieces back."""

    def __init__(self, module: nn.Module, group: mx.distributed.Group | None = None):
        super().__init__()
        group = group or mx.distributed.init()
        n, rank = group.size(), group.rank()
        trainable = {k for k, _ in tree_flatten(module.trainable_parameters())}
        params = tree_flatten(module.parameters())
        self.module = module
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_trained", [(k, v.shape) for k, v in params if k in trainable])
        object.__setattr__(self, "_frozen", [(k, v.shape) for k, v in params if k not in trainable])
        object.__setattr__(self, "_shapes", {k: tuple(v.shape) for k, v in params})
        kind = scatter_kind(group)
        object.__setattr__(
            self,
            "_gathers",
            (
                _gather_fn(group, [s for _, s in self._trained], True, kind),
                _gather_fn(group, [s for _, s in self._frozen], False, kind),
            ),
        )
        # the pieces take the parameters' places (and their freezing, which goes by name)
        module.update(tree_unflatten([(k, shard_of(v, n, rank)) for k, v in params]))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the block's own attributes (its settings, its sublayers)
            if "module" not in self:
                raise
            return getattr(self["module"], name)

    def whole(self, frozen: bool = True) -> list[tuple[str, mx.array]]:
        """The module's whole parameters (gathered), by path; only what trains unless
        ``frozen``."""
        pieces = dict(tree_flatten(self.module.parameters()))
        out = []
        for spec, gather in zip((self._trained, self._frozen), self._gathers, strict=True):
            if spec and (frozen or spec is self._trained):
                fulls = gather([pieces[k] for k, _ in spec])
                out += [(k, w) for (k, _), w in zip(spec, fulls, strict=True)]
        return out

    def whole_shape(self, path: str) -> tuple:
        """The whole shape of the parameter at ``path`` inside the unit's module (with or
        without the leading ``module.``)."""
        return self._shapes[path.removeprefix("module.")]

    def whole_sizes(self) -> tuple[int, int]:
        """(the unit's parameters whole, in bytes as held; its trainable elements whole)."""
        dtypes = {k: v.dtype for k, v in tree_flatten(self.module.parameters())}
        held = sum(math.prod(s) * dtypes[k].size for k, s in self._shapes.items())
        return held, sum(math.prod(s) for _, s in self._trained)

    def __call__(self, *args, **kwargs):
        pieces = self.module.parameters()
        self.module.update(tree_unflatten(self.whole()))
        try:
            return self.module(*args, **kwargs)
        finally:
            self.module.update(pieces)

    def put_whole(self, weights: dict[str, mx.array]) -> None:
        """Set parameters of the module from whole values (by path; a checkpoint written at
        any world size): this rank keeps its pieces."""
        n, rank = self._group.size(), self._group.rank()
        self.module.update(tree_unflatten([(k, shard_of(v, n, rank)) for k, v in weights.items()]))

    def unsharded(self) -> nn.Module:
        """The module with its whole parameters back (every rank gathers: all must call it)."""
        self.module.update(tree_unflatten(self.whole()))
        return self.module


def _swap(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """``new`` in every list of the model's modules that holds ``old`` (``model.layers`` may
    be a copy: mlx-lm's pipelined families give a slice of their list of blocks)."""
    found = 0
    for _, m in model.named_modules():
        for v in m.values():
            if isinstance(v, list):
                for j, x in enumerate(v):
                    if x is old:
                        v[j], found = new, found + 1
    if not found:
        raise ValueError("a block of model.layers is in no list of the model's modules")


def shard_blocks(model: nn.Module, group: mx.distributed.Group | None = None) -> int:
    """Every block of ``model.layers`` as a ``ShardedUnit``, in place; the number of blocks.
    A block that recomputes its activations (gradient checkpointing) hands that to its unit:
    the recomputation then gathers the pieces again, so the backward keeps only the pieces of
    a block, never its whole parameters."""
    blocks = list(model.layers)
    for block in blocks:
        recomputed = is_checkpointed(block)
        if recomputed:
            uncheckpoint(block)
        unit = ShardedUnit(block, group)
        if recomputed:
            checkpoint_block(unit)
        _swap(model, block, unit)
    return len(blocks)


def unshard_blocks(model: nn.Module) -> int:
    """Every ``ShardedUnit`` of ``model.layers`` back to its block with whole parameters, in
    place (every rank must call it: the gathers are collectives); the number unsharded. What
    rank 0 alone then does with the model (exports, samples) needs no other rank."""
    n = 0
    for unit in list(model.layers):
        if isinstance(unit, ShardedUnit):
            recomputed = is_checkpointed(unit)
            block = unit.unsharded()
            if recomputed:
                checkpoint_block(block)
            _swap(model, unit, block)
            n += 1
    mx.eval(model.parameters())
    return n


_IN_UNIT = re.compile(r"(?:^|\.)layers\.(\d+)\.module\.")


def unsharded_name(path: str) -> str:
    """A parameter's path as the unsharded model names it (``layers.3.module.mlp...`` ->
    ``layers.3.mlp...``)."""
    return _IN_UNIT.sub(lambda m: m.group(0).removesuffix("module."), path, count=1)


def _unit_of(path: str, model: nn.Module) -> tuple[ShardedUnit, str] | None:
    """(the unit, the path inside its module) of a parameter held as a piece, else None."""
    m = _IN_UNIT.search(path)
    if m is None:
        return None
    block = model.layers[int(m.group(1))]
    return (block, path[m.end() :]) if isinstance(block, ShardedUnit) else None


def whole_trainable(model: nn.Module) -> dict[str, mx.array]:
    """What trains, whole and under the unsharded model's names: each block's pieces gathered
    (a collective: every rank calls it), the rest as held. What a checkpoint writes, so that
    it resumes at any world size."""
    out, gathered = {}, {}
    for k, v in tree_flatten(model.trainable_parameters()):
        found = _unit_of(k, model)
        if found is None:
            out[k] = v
            continue
        unit, inner = found
        if id(unit) not in gathered:
            gathered[id(unit)] = dict(unit.whole(frozen=False))
        out[unsharded_name(k)] = gathered[id(unit)][inner]
    return out


def put_whole_trainable(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Set what trains from whole values under the unsharded model's names (``whole_trainable``
    of a run at any world size): each rank keeps its pieces of a block's, the rest as given."""
    per_unit: dict[int, tuple[ShardedUnit, dict]] = {}
    plain = []
    for k, _ in tree_flatten(model.trainable_parameters()):
        name = unsharded_name(k)
        if name not in weights:
            continue
        found = _unit_of(k, model)
        if found is None:
            plain.append((k, weights[name]))
        else:
            unit, inner = found
            per_unit.setdefault(id(unit), (unit, {}))[1][inner] = weights[name]
    for unit, values in per_unit.values():
        unit.put_whole(values)
    if plain:
        model.update(tree_unflatten(plain))


def sharded_paths(model: nn.Module) -> set[str]:
    """The paths (as ``tree_flatten`` of the model's parameters names them) of the pieces:
    their gradients come summed over ranks already, and their squares sum over ranks for a
    gradient norm, where the other parameters' are the same on every rank."""
    return {k for k, _ in tree_flatten(model.parameters()) if _unit_of(k, model) is not None}


def _param_of(unit: ShardedUnit, inner: str) -> tuple[str, tuple] | None:
    """(the unit's parameter, its whole shape) that ``inner`` (a path inside the unit's module:
    a parameter's, or an entry of an optimizer's state for it) belongs to."""
    shapes = unit._shapes
    name = inner
    while name:
        if name in shapes:
            return name, shapes[name]
        name = name.rpartition(".")[0]
    return None


def whole_tree(model: nn.Module, flat: dict[str, mx.array]) -> dict[str, mx.array]:
    """``flat`` (``tree_flatten`` of what mirrors the trainable parameters: an optimizer's
    state, fp32 masters) with every piece gathered whole, under the unsharded model's names.
    Lazy: each whole value is one collective when it is computed, so every rank must compute
    them all, in the same order (rank 0 writes them, the others ``drain`` them)."""
    out = {}
    for k, v in flat.items():
        found = _unit_of(k, model)
        param = _param_of(*found) if found is not None else None
        if param is None or v.shape != piece_shape(param[1], found[0]._group.size()):
            out[unsharded_name(k) if found else k] = v  # a count, a scalar of the state
            continue
        unit = found[0]
        gather = _gather_fn(unit._group, [param[1]], False, scatter_kind(unit._group))
        out[unsharded_name(k)] = gather([v])[0]
    return out


def pieces_of_whole(model: nn.Module, keys: list[str], whole: dict[str, mx.array]) -> dict:
    """This rank's values for ``keys`` (the sharded names of an optimizer's state or masters)
    from ``whole`` (``whole_tree``'s, written at any world size): a piece where the key is
    held as one, the value itself otherwise. A key ``whole`` lacks is left out."""
    out = {}
    for k in keys:
        name = unsharded_name(k)
        if name not in whole:
            continue
        found = _unit_of(k, model)
        param = _param_of(*found) if found is not None else None
        v = whole[name]
        if param is not None and tuple(v.shape) == tuple(param[1]):
            g = found[0]._group
            v = shard_of(v, g.size(), g.rank())
        out[k] = v
    return out


def whole_shapes(model: nn.Module) -> dict[str, tuple]:
    """What trains, by the unsharded model's names, with each parameter's whole shape."""
    out = {}
    for k, v in tree_flatten(model.trainable_parameters()):
        found = _unit_of(k, model)
        out[unsharded_name(k)] = tuple(found[0]._shapes[found[1]]) if found else tuple(v.shape)
    return out


def drain(tensors: dict[str, mx.array]) -> None:
    """Compute each of ``tensors`` in order and drop it: what a rank that writes nothing does
    with the whole values rank 0 writes (their gathers are collectives)."""
    for k in list(tensors):
        mx.eval(tensors.pop(k))


def is_sharded(model: nn.Module) -> bool:
    """Whether any block of ``model`` is held as pieces."""
    layers = getattr(model, "layers", None) or []
    return any(isinstance(b, ShardedUnit) for b in layers)


__all__ = [
    "ShardedUnit",
    "drain",
    "is_sharded",
    "piece_shape",
    "pieces_of_whole",
    "put_whole_trainable",
    "scatter_kind",
    "shard_blocks",
    "shard_of",
    "sharded_paths",
    "unshard_blocks",
    "unsharded_name",
    "whole_shapes",
    "whole_trainable",
    "whole_tree",
]
