"""The run's kernel tiers measured (``kernels.autotune``): the shapes a step calls attention and
the loss at, each tier's time there (``kernels.tune``) and its step's estimated peak against the
memory budget; ``auto`` takes the fastest that fits, a named tier is kept (with a warning when it
measured more than 2x slower). The table goes to the log and config_resolved.json."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from .. import kernels
from ..engine.memory import GB
from ..errors import UserInputError
from ..gguf.file import GGUFModelFile, is_gguf
from ..kernels.tune import Case, TimeCache, Tuned, cached_clock, decide
from ..memory import Shape, estimate
from ..models.configs import text_config
from ..models.gguf.configs import gguf_config

ATTENTION = ("native", "chunked")
"""The attention tiers timed everywhere (a GPU's kernels join them where they passed their
check): MLX's own fused attention and the slabs that never build the scores."""
LOSS = ("reference", "chunked")
"""The loss tiers timed everywhere: the plain logits (as mlx-lm computes them) and the chunks
that never build them."""

SMALLEST = 64
"""The shortest length timed: a bucketed run's lengths are timed at each power of two from it
up to its longest, a call running in the tier of the next length up."""


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


def recorded_times(config_resolved: Path) -> dict[tuple[str, str], float]:
    """The times a run measured, by (shape, tier), from its config_resolved.json ({} where it
    has none): a resumed run decides as the run it continues did."""
    try:
        table = json.loads(config_resolved.read_text()).get("kernels", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {
        (row["shape"], tier): ms / 1e3
        for op in ("attention", "loss")
        for row in table.get(op, [])
        for tier, ms in row.get("ms", {}).items()
        if ms is not None
    }


def measure_tiers(
    recipe,
    tiers: dict,
    shape: Shape,
    budget: float,
    head_grad: bool,
    log,
    seconds_of=None,
    recorded: dict | None = None,
) -> tuple[dict, dict]:
    """(the tiers the run's steps use, the table of what was measured) for a run whose static
    choice is ``tiers`` (``kernel_tiers``) and whose step is ``shape``. Nothing is measured where
    ``kernels.autotune`` is false, MLXTUNE_KERNELS names the tier, or attention is off.
    ``seconds_of(tier, case)``: the clock (by default each case timed here, through the cache
    of earlier runs); ``recorded``: times by (shape, tier) read first (``recorded_times``)."""
    k = recipe.kernels
    if not k.autotune or os.environ.get("MLXTUNE_KERNELS"):
        return tiers, {}
    cache = None
    if seconds_of is None:
        cache = TimeCache()
        seconds_of = cached_clock(cache)
    clock = seconds_of
    if recorded:

        def seconds_of(tier, case):
            known = recorded.get((case.label(), tier))
            return known if known is not None else clock(tier, case)

    shapes = cases(shape, recipe.model.dtype, recipe.data.packing != "off", head_grad)
    out, table = dict(tiers), {}
    for op, choice in (("attention", k.attention), ("loss", k.loss)):
        if choice == "off":
            continue
        named = None if choice == "auto" else choice
        tried = candidates(op)
        if named is not None and named not in tried:
            tried.append(named)
        decisions = [
            decide(
                c,
                tried,
                seconds_of,
                lambda t, c: step_peak(shape, t, c),
                budget,
                named,
                default=tiers.get(op),
            )
            for c in shapes[op]
        ]
        table[op] = [d.to_dict() for d in decisions]
        for line in table_lines(op, table[op]):
            log(line)
        for d in decisions:  # what the memory budget kept out, and where nothing fitted
            for r in d.rows:
                if r.seconds is None and r.note == "over the memory budget":
                    log(
                        f"kernels.{op}: {r.tier} left out at {d.case.label()}: its step would "
                        f"need about {r.peak / GB:.2f} GB of the {budget / GB:.2f} GB budget"
                    )
            if "leanest" in d.why:
                log(f"kernels.{op}: {d.case.label()} runs in {d.tier}, {d.why}")
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
        table["cache"] = {"path": str(cache.path), "read_back": clock.hits}
    return out, table


def table_lines(op: str, rows: list[dict]) -> list[str]:
    """The lines a table of ``op``'s decisions (``Decision.to_dict``) prints as."""
    out = [f"kernels: {op}, forward and backward compiled, ms (* the tier each shape runs in):"]
    for row in rows:
        cells = []
        for tier, ms in row["ms"].items():
            value = f"{ms:.2f}" if ms is not None else row["notes"].get(tier, "")
            cells.append(f"{tier} {value}{'*' if tier == row['chosen'] else ''}")
        out.append(f"  {row['shape']}: " + ", ".join(cells))
    return out


DOCTOR_LENGTHS = (512, 2048)
"""The row lengths ``doctor --kernels`` times a model's shapes at (batch 1)."""

SMOLLM2 = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
}
"""The shapes ``doctor --kernels`` times without a model: SmolLM2-135M's."""


def model_shapes(path: str | None) -> tuple[dict, str]:
    """(the text model's config, what it is) of a model folder or GGUF file, or SmolLM2-135M's
    shapes when ``path`` is None."""
    if path is None:
        return SMOLLM2, "SmolLM2-135M's shapes"
    p = Path(path)
    if is_gguf(p):
        return text_config(gguf_config(GGUFModelFile(p))), str(p)
    if not (p / "config.json").is_file():
        raise UserInputError("not a recipe, a model folder (config.json) or a GGUF file", str(p))
    try:
        return text_config(json.loads((p / "config.json").read_text())), str(p)
    except ValueError as e:
        raise UserInputError(f"config.json is not JSON: {e}", str(p / "config.json")) from None


def measure_model(cfg: dict, dtype: str, echo, lengths=DOCTOR_LENGTHS, seconds_of=None) -> dict:
    """Time every tier of both ops at a model's shapes (batch 1, each of ``lengths``, causal and
    packed), without a memory plan: every tier is a candidate. Prints the tables through
    ``echo``; returns them by op."""
    hidden = int(cfg.get("hidden_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv = int(cfg.get("num_key_value_heads") or heads)
    vocab = int(cfg.get("vocab_size") or 0)
    if not (hidden and vocab):
        raise UserInputError("the config names no hidden_size or vocab_size", "config.json")
    cache = None
    if seconds_of is None:
        cache = TimeCache()
        seconds_of = cached_clock(cache)
    shapes = {
        "attention": [
            Case("attention", (1, heads, kv, t, head_dim), dtype, segments=packed)
            for t in lengths
            for packed in (False, True)
        ],
        "loss": [Case("loss", (t, vocab, hidden), dtype) for t in lengths],
    }
    out = {}
    for op, cs in shapes.items():
        rows = [decide(c, candidates(op), seconds_of, lambda t, c: 0.0, 1.0).to_dict() for c in cs]
        out[op] = rows
        for line in table_lines(op, rows):
            echo(line)
    if cache is not None:
        cache.save()
        echo(f"times kept in {cache.path} ({seconds_of.hits} read back)")
    return out
