"""The run's kernel tiers measured (``kernels.autotune``): the shapes a step calls attention and
the loss at, each tier's time there (``kernels.tune``) and its step's estimated peak against the
memory budget; ``auto`` takes the fastest that fits, a named tier is kept (with a warning when it
measured more than 2x slower). The table goes to the log and config_resolved.json."""

from __future__ import annotations

import os
from dataclasses import replace

from .. import kernels
from ..kernels.tune import Case, Decision, TimeCache, Tuned, cached_clock, decide
from ..memory import Shape, estimate

ATTENTION = ("native", "chunked")
"""The attention tiers timed everywhere (a GPU's kernels join them where they passed their
check): MLX's own fused attention and the slabs that never build the scores."""
LOSS = ("reference", "chunked")
"""The loss tiers timed everywhere: the plain logits (as mlx-lm computes them) and the chunks
that never build them."""

SMALLEST = 64
"""The shortest length timed: a bucketed run's lengths are timed at each power of two from it
up to its longest, a call running in the tier of the next length up."""


def step_dtype(recipe) -> str:
    return recipe.model.dtype


def cases(shape: Shape, dtype: str, packed: bool, head_grad: bool) -> dict[str, list[Case]]:
    """The shapes a step calls each op at: its longest rows, and for bucketed batches (whose
    lengths vary) each power of two from SMALLEST below it."""
    longest = shape.length
    lengths = [longest]
    if not packed:
        t = SMALLEST
        while t < longest:
            lengths.append(t)
            t *= 2
    heads = max(shape.heads, 1)
    head_dim = shape.q_dim // heads
    kv_heads = shape.kv_dim // max(2 * head_dim, 1)
    b = shape.batch
    return {
        "attention": [
            Case("attention", (b, heads, kv_heads, t, head_dim), dtype, segments=packed)
            for t in sorted(lengths)
        ],
        "loss": [
            Case("loss", (b * t, shape.vocab, shape.hidden), dtype, head_grad=head_grad)
            for t in sorted(lengths)
        ],
    }


def step_peak(shape: Shape, tier: str, case: Case) -> float:
    """The step's estimated peak (bytes) with ``tier`` running ``case``'s op at its length."""
    if case.op == "attention":
        s = replace(
            shape,
            length=case.dims[3],
            attention_scores=tier == "reference",
            native_attention=tier == "native",
            chunked_attention=tier == "chunked",
        )
    else:
        s = replace(shape, length=case.dims[0] // shape.batch, logits_full=tier == "reference")
    return estimate(s)["total"]


def candidates(op: str) -> list[str]:
    """The tiers of ``op`` timed on this machine."""
    out = list(ATTENTION if op == "attention" else LOSS)
    gpu = kernels.gpu_backend()
    if gpu is not None and kernels.on_gpu() and kernels.self_check(gpu) is None:
        out.append(gpu)
    return out


def measure_tiers(
    recipe, tiers: dict, shape: Shape, budget: float, head_grad: bool, log, seconds_of=None
) -> tuple[dict, dict]:
    """(the tiers the run's steps use, the table of what was measured) for a run whose static
    choice is ``tiers`` (``kernel_tiers``) and whose step is ``shape``. Nothing is measured where
    ``kernels.autotune`` is false, MLXTUNE_KERNELS names the tier, or attention is off.
    ``seconds_of(tier, case)``: the clock (by default each case timed here, through the cache
    of earlier runs)."""
    k = recipe.kernels
    if not k.autotune or os.environ.get("MLXTUNE_KERNELS"):
        return tiers, {}
    cache = None
    if seconds_of is None:
        cache = TimeCache()
        seconds_of = cached_clock(cache)
    shapes = cases(shape, step_dtype(recipe), recipe.data.packing != "off", head_grad)
    out, table = dict(tiers), {}
    for op, choice in (("attention", k.attention), ("loss", k.loss)):
        if choice == "off":
            continue
        named = None if choice == "auto" else choice
        tried = candidates(op)
        if named is not None and named not in tried:
            tried.append(named)
        decisions = [
            decide(c, tried, seconds_of, lambda t, c: step_peak(shape, t, c), budget, named)
            for c in shapes[op]
        ]
        table[op] = [d.to_dict() for d in decisions]
        _log_table(op, decisions, log)
        if named is not None:
            for d in decisions:
                if "slower" in d.why:
                    log(
                        f"WARNING: kernels.{op}: {named} at {d.case.label()}: {d.why.split('; ')[1]}"
                    )
            continue
        chosen = {d.tier for d in decisions}
        out[op] = chosen.pop() if len(chosen) == 1 else Tuned(op, decisions)
        log(f"kernels.{op}: auto -> {out[op]}")
    if cache is not None:
        cache.save()
        table["cache"] = {"path": str(cache.path), "read_back": seconds_of.hits}
    return out, table


def _log_table(op: str, decisions: list[Decision], log) -> None:
    log(f"kernels: {op}, forward and backward compiled, ms (* the tier each shape runs in):")
    for d in decisions:
        cells = []
        for r in d.rows:
            mark = "*" if r.tier == d.tier else ""
            value = f"{1e3 * r.seconds:.2f}" if r.seconds is not None else r.note
            cells.append(f"{r.tier} {value}{mark}")
        log(f"  {d.case.label()}: " + ", ".join(cells))
