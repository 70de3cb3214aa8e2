"""Fully sharded data parallelism: each rank holds 1/N of every parameter, gathered for the
forward and the backward of one unit at a time, on MLX's distributed engine.

A unit is a module (a transformer block) whose parameters are sharded together. Each
parameter is flattened, padded with zeros to a multiple of N and cut into N equal pieces;
rank r holds piece r, as the unit's parameter (a 1-D array), so the optimizer, its state and
the gradients are 1/N of the unsharded ones on every rank. Any shape shards, a scalar
included; the padding is at most N - 1 values a parameter.

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

MLX's own ``nn.fully_shard`` shards along axis 0 (which must divide by N) and its backward
needs ``sum_scatter``; this module shards any shape and runs on every backend.
"""

from __future__ import annotations

import math
import re
from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


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


def _piece_size(size: int, n: int) -> int:
    return -(-size // n)


def shard_of(a: mx.array, n: int, rank: int) -> mx.array:
    """Piece ``rank`` of ``n`` of ``a`` flattened and zero-padded to a multiple of ``n``."""
    k = _piece_size(a.size, n)
    flat = a.reshape(-1)
    if k * n != a.size:
        flat = mx.concatenate([flat, mx.zeros((k * n - a.size,), a.dtype)])
    return flat[rank * k : (rank + 1) * k]


def _gather_fn(group, shapes: list[tuple], with_backward: bool, kind: str):
    """gather(pieces) -> whole parameters of ``shapes``; its backward (``with_backward``) sums
    the whole gradients over ranks and returns this rank's pieces."""
    n, rank = group.size(), group.rank()
    whole = [math.prod(s) for s in shapes]
    sizes = [_piece_size(w, n) for w in whole]
    offsets = [0]
    for k in sizes:
        offsets.append(offsets[-1] + k)

    def gather(pieces):
        row = mx.concatenate([p.reshape(1, -1) for p in pieces], axis=1)
        table = mx.distributed.all_gather(row, group=group)  # [n, sum of piece sizes]
        return [
            table[:, offsets[i] : offsets[i + 1]].reshape(-1)[: whole[i]].reshape(shapes[i])
            for i in range(len(shapes))
        ]

    if not with_backward:
        return lambda pieces: [mx.stop_gradient(w) for w in gather(pieces)]

    f = mx.custom_function(gather)

    @f.vjp
    def gather_vjp(pieces, cotangents, _):
        padded = []
        for c, k in zip(cotangents, sizes, strict=True):
            flat = c.reshape(-1)
            if k * n != flat.size:
                flat = mx.concatenate([flat, mx.zeros((k * n - flat.size,), flat.dtype)])
            padded.append(flat.reshape(n, k))
        table = mx.concatenate(padded, axis=1)  # [n, sum of piece sizes]
        if kind == "sum_scatter":
            mine = mx.distributed.sum_scatter(table, group=group)
        else:
            mine = mx.distributed.all_sum(table, group=group)[rank : rank + 1]
        return [mine[0, offsets[i] : offsets[i + 1]].astype(p.dtype) for i, p in enumerate(pieces)]

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


def shard_blocks(model: nn.Module, group: mx.distributed.Group | None = None) -> int:
    """Every block of ``model.layers`` as a ``ShardedUnit``, in place; the number of blocks."""
    blocks = model.layers
    for i in range(len(blocks)):
        blocks[i] = ShardedUnit(blocks[i], group)
    return len(blocks)


def unshard_blocks(model: nn.Module) -> int:
    """Every ``ShardedUnit`` of ``model.layers`` back to its block with whole parameters, in
    place (every rank must call it: the gathers are collectives); the number unsharded. What
    rank 0 alone then does with the model (exports, samples) needs no other rank."""
    blocks, n = model.layers, 0
    for i in range(len(blocks)):
        if isinstance(blocks[i], ShardedUnit):
            blocks[i] = blocks[i].unsharded()
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


__all__ = [
    "ShardedUnit",
    "put_whole_trainable",
    "scatter_kind",
    "shard_blocks",
    "shard_of",
    "sharded_paths",
    "unshard_blocks",
    "unsharded_name",
    "whole_trainable",
]
