"""The automatic sizes (``train.batch_size``, ``train.grad_checkpointing`` and
``data.max_length`` set to ``auto``), chosen from the memory plan (``memory``) before the first
step."""

from __future__ import annotations

from dataclasses import replace

from .data.encode import fitted
from .engine.memory import GB
from .engine.optim import optimizer_for
from .engine.steps import Engine
from .errors import UserInputError
from .memory import Planned, estimate, longest_that_fits, run_budget, shape_of
from .models import checkpoint_layers

MARGIN = 0.9  # the share of the budget an automatic size may plan to use
LARGEST = 256  # the largest automatic batch


def resolve_sizes(recipe, built, objective, tiers, world, log) -> dict[str, str]:
    """Set the recipe's automatic sizes for what was ``built`` (the ``objective`` made, nothing
    trained): the largest batch (a power of two, at most the training examples) whose estimated
    peak fits ``MARGIN`` of the run's budget, gradient checkpointing only where it lets a larger
    batch fit, and ``data.max_length: auto``. Explicit values win. Each chosen value, by key,
    with why (the log and config_resolved.json show them); {} when the recipe asks for none."""
    r = recipe
    t = r.train
    parts = built.components
    auto_batch, auto_gc = t.batch_size == "auto", t.grad_checkpointing == "auto"
    context = built.auto_context
    if not (auto_batch or auto_gc or context):
        return {}
    if auto_batch and objective.micro_key is not None:
        raise UserInputError(
            f"auto sizes a step's examples, but {objective.name}'s passes are set by "
            f"{objective.micro_key}: give train.batch_size a number",
            "train.batch_size",
        )
    budget, what = run_budget(r)
    if auto_batch:
        t.batch_size = 1
    if auto_gc:
        t.grad_checkpointing = False
    # the plan counts the optimizer's state as allocated: a provisional one, replaced later
    optimizer = optimizer_for(r, 1)
    engine = Engine(parts.model, optimizer, objective, r, world)
    planned = Planned(r, built, objective, tiers, optimizer, engine)
    shape = shape_of(planned)
    chosen = {}
    if context:
        shape, chosen["data.max_length"] = _fit_length(planned, shape, budget, auto_gc, context)
    streamed = getattr(parts.train_set, "streamed", False)
    most = LARGEST if streamed else max(1, min(LARGEST, len(parts.train_set)))
    sizes = [1 << i for i in range(most.bit_length()) if 1 << i <= most] if auto_batch else [1]
    given = 1 if auto_batch else t.batch_size
    layers = [0, shape.layers] if auto_gc else [shape.checkpointed]
    fits = {}  # checkpointed layers -> (largest batch that fits, its estimate)
    for ck in layers:
        for b in sizes:
            batch = (b if auto_batch else given) * shape.rows_per_example
            total = estimate(replace(shape, batch=batch, checkpointed=ck))["total"]
            if total <= MARGIN * budget:
                fits[ck] = (b if auto_batch else given, total)
    if fits:  # the largest batch; no checkpointing where it fits as large a one
        ck = max(fits, key=lambda k: (fits[k][0], -k))
        b, total = fits[ck]
        why = f"its estimated peak {total / GB:.2f} GB fits {MARGIN:.0%} of {budget / GB:.2f} GB"
    else:  # nothing fits: the smallest; the memory plan then says what would
        ck, b = layers[-1], sizes[0] if auto_batch else given
        why = f"nothing fits {MARGIN:.0%} of {budget / GB:.2f} GB; the smallest setting"
    if auto_batch:
        t.batch_size = b
        tried = f"of {', '.join(map(str, sizes))}"
        chosen["train.batch_size"] = f"{b} (the largest {tried} whose step fits: {why}, {what})"
    if auto_gc:
        t.grad_checkpointing = bool(ck)
        chosen["train.grad_checkpointing"] = (
            f"{'true' if ck else 'false'} ("
            + (
                ("it lets a larger batch fit" if auto_batch else "the batch fits only with it")
                if ck
                else "the batch fits without it"
            )
            + f": {why}, {what})"
        )
        if ck:
            checkpoint_layers(parts.model, 1)
    for key, line in chosen.items():
        log(f"{key}: auto -> {line}")
    return chosen


def _fit_length(planned: Planned, shape, budget: float, auto_gc: bool, context: int):
    """data.max_length: auto, read up to ``context``: the longest example when a step of the
    recipe's batch (one example when the batch is automatic too) fits the budget (checkpointing
    too when that is automatic), else the longest length
    that does (halvings, then bisected to 64 tokens; at least 64), the datasets cut to it as
    ``data.overlong`` says.
    (the shape at that length, why)."""
    r, parts = planned.recipe, planned.built.components
    longest = r.data.max_length
    ck = shape.layers if auto_gc else shape.checkpointed
    examples = shape.batch // shape.rows_per_example  # the recipe's batch (1 when automatic)

    def fits(length: int) -> bool:
        s = replace(shape, length=length - 1, checkpointed=ck)
        return estimate(s)["total"] <= MARGIN * budget

    if fits(longest):
        return shape, f"{longest} (the longest example; the model reads {context})"
    m = longest_that_fits(longest, fits)
    if m is None:  # nothing fits: the shortest halving, which the memory plan then weighs
        m = longest
        while m // 2 >= 64:
            m //= 2
    datasets = {id(d): d for d in (parts.train_set, parts.valid_set, parts.test_set)}
    for ds in datasets.values():
        _cut(ds, m, r.data.overlong)
    r.data.max_length = m
    if not parts.train_set.examples:
        raise UserInputError(
            f"at {m} tokens, the longest that fits the memory budget, no example is left",
            "data.max_length",
        )
    return shape_of(planned), (
        f"{m} (the longest that fits to 64 tokens: the longest example, {longest}, does not fit "
        f"{examples} a step in {MARGIN:.0%} of "
        f"{budget / GB:.2f} GB; longer ones {'dropped' if r.data.overlong == 'drop' else 'cut'})"
    )


def _cut(ds, m: int, overlong: str) -> None:
    """The examples of ``ds`` longer than ``m`` tokens cut to it (or dropped: ``overlong``);
    the split's counts follow."""
    st = ds.stats
    ds.examples = [e for e in ds.examples if fitted(e, m, overlong, 0, st)]
    st.kept = len(ds.examples)
    st.tokens = sum(len(e.ids) for e in ds.examples)
    st.target_tokens = sum(e.n_targets for e in ds.examples)
