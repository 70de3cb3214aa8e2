"""Where a run is built: its run directory (new, resumed, a dry run's scratch folder, or a
data-parallel rank's), what the recipe names (``set_up``), and the agreement of every rank that
the set-up went through."""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim

from .. import _blas, tensor
from ..autosize import resolve_sizes
from ..build import Built, build
from ..config import Recipe, dump_yaml, inert_notes
from ..engine.memory import described, keep_resident, stage
from ..engine.optim import optimizer_for
from ..engine.state import LoopPosition
from ..engine.steps import Engine
from ..errors import TrainingError, UserInputError
from ..export import peft_refusal
from ..fsdp import scatter_kind, shard_blocks
from ..kernels.selection import kernel_tiers
from ..memory import Planned, plan, run_budget, shape_of
from ..models import VisionLM, checkpointed_layers
from ..objectives import Objective
from ..runs.checkpoint import named, restore
from ..runs.rundir import RunDir, holds_a_run
from . import describe
from .tiers import measure_tiers, recorded_times


def run_folders(
    recipe, run_dir, resume, dry_run: bool, world, scratch
) -> tuple[RunDir, RunDir | None]:
    """(the folder this rank writes, the run a resumed run's checkpoints are read from or None).
    ``scratch``: the rank's temporary folder (a dry run, a rank other than 0), or None."""
    if dry_run:
        return RunDir(scratch, create=True), None
    if resume is not None:
        path = Path(run_dir or recipe.run_dir or "")
        if not run_dir and not recipe.run_dir:
            raise UserInputError("--resume needs the run's directory (--run-dir)", "--resume")
        if not holds_a_run(path):
            raise UserInputError("no run to resume here", str(path))
        if resume != "latest":
            named(path, resume)  # before anything is loaded or logged
        source = RunDir(path, create=False)
        return (source if world.main else rank_folder(path, scratch)), source
    if world.main:
        return RunDir(run_dir, create=True), None
    return RunDir(scratch, create=True), None


@dataclass(frozen=True)
class Run:
    """What a recipe was made into before the first step, as one value: the loop trains with
    it and changes none of it (the loop's own position starts as ``start``)."""

    recipe: Recipe
    """The recipe as resolved: a copy of the one given (which stays as it was written), each
    ``auto`` replaced by what it came to."""
    blas: _blas.BlasStatus
    tiers: dict
    """The kernel tier of the loss and of attention: a tier's name, or what was measured
    fastest by shape (``kernels.tune.Tuned``)."""
    kernel_table: dict
    """What the tiers measured at the step's shapes ({} where nothing was measured)."""
    built: Built
    """The model, tokenizer and data (``built.components``), and what they came from."""
    objective: Objective
    auto_sizes: dict[str, str]
    """Each automatic size the recipe asked for: its key, the value chosen, and why."""
    batches_per_epoch: int | None
    """None for a stream (not known before it is read)."""
    total_steps: int
    optimizer: optim.Optimizer
    engine: Engine
    memory_estimate: dict[str, float]
    start: LoopPosition
    """Where the loop starts: step 0, or where a resumed run stopped."""
    resumed: bool
    stages: dict
    """Each stage's time and memory so far (``engine.memory.stage``): load, then the
    checkpoints and exports as they happen; summary.json's ``stages``."""


def set_up(
    recipe,
    run_dir: RunDir,
    source: RunDir | None,
    world,
    log,
    *,
    rows=None,
    resume_from: str | None = None,
    dry_run: bool = False,
) -> Run:
    """Make what the recipe names, in order: BLAS, the kernel tiers, the model, tokenizer and
    data, the objective, what ``auto`` sizes resolve to, the step count, the optimizer, the
    engine, the memory plan, and a resumed run's position. ``source``: the run a resumed run
    reads (``resume_from``: its checkpoint, "latest" or a name); ``rows``: the console's
    progress rows while data is encoded. The recipe given is read, never written: the run's
    own copy (``Run.recipe``) takes what each ``auto`` resolves to."""
    r = recipe
    blas = _blas.setup_blas()
    log(f"BLAS: {blas.note}")
    for note in inert_notes(r):  # keys the recipe sets that these settings never read
        log(note)
    tiers = kernel_tiers(r, log)
    keep_resident(log)
    resuming = resume_from is not None
    stages: dict = {}
    with stage("load", stages):
        built = build(r, run_dir, tiers, resuming, log, rows)
    log(f"model, tokenizer and data loaded: {described(stages['load'])}")
    if "peft" in r.export.formats and (why := peft_refusal(built.components.model)) is not None:
        raise UserInputError(why, "export.formats")  # before training, not after it
    r = copy.deepcopy(recipe)  # the run's own: the lengths and sizes resolve into it
    r.data.max_length = built.max_length
    objective = built.kind(r, built.components)
    refuse_qat_generating(r, objective)
    shard_model(built.components.model, objective, world, log, r.distributed.strategy)
    auto_sizes = resolve_sizes(r, built, objective, tiers, world, log)
    batches_per_epoch = objective.batches_per_epoch()
    total_steps = _total_steps(r.train, batches_per_epoch)
    optimizer = optimizer_for(r, total_steps)
    engine = Engine(built.components.model, optimizer, objective, r, world)
    planned = Planned(r, built, objective, tiers, optimizer, engine)
    # the tiers measured at the step's shapes: the components read them from this same dict
    # (a resumed run reads the times the run it continues measured: the same tiers run)
    recorded = recorded_times(source.inside("config_resolved.json")) if resuming else None
    measured, kernel_table = measure_tiers(
        r, tiers, shape_of(planned), run_budget(r)[0], built.components.head_trains, log,
        recorded=recorded,
    )  # fmt: skip
    tiers.update(measured)
    # the plan before the objective's preparation: a run it refuses pays for no reference pass
    estimate = plan(shape_of(planned), r, log)
    objective.prepare(run_dir, source, log)
    start, resumed = LoopPosition(), False
    if resuming and not dry_run:
        state = restore(source, resume_from, r, engine, log, world.main, total_steps)
        start, resumed = state.position, True
    if getattr(built.components.train_set, "streamed", False):
        built.components.train_set.resume(start.data_stream)
    return Run(
        r,
        blas,
        tiers,
        kernel_table,
        built,
        objective,
        auto_sizes,
        batches_per_epoch,
        total_steps,
        optimizer,
        engine,
        estimate,
        start,
        resumed,
        stages,
    )


def refuse_qat_generating(r, objective: Objective) -> None:
    """train.qat with an objective that decodes while it trains or evaluates: refused."""
    if r.train.qat is not None and objective.generates():
        raise UserInputError(
            f"{objective.name} generates while it trains or evaluates, and generation computes "
            "with the unquantized weights: quantization-aware training covers objectives that "
            "score given text (SFT, preference, KTO, reward, distillation from a teacher's "
            "text)",
            "train.qat",
        )


def shard_model(model, objective: Objective, world, log, strategy: str = "fsdp") -> None:
    """``distributed.strategy`` fsdp or tensor: the weights of ``model`` divided among the
    ranks (``mlxtune.fsdp``: each holds its pieces of every block; ``mlxtune.tensor``: its
    heads and MLP columns), before the optimizer sees them; what cannot train so is refused by
    name. One process, or strategy data: nothing to divide."""
    if strategy == "data":
        return
    if world.size == 1:
        log(f"note: distributed.strategy: {strategy} has no effect in one process")
        return
    where = "distributed.strategy"
    if isinstance(model, VisionLM):
        raise UserInputError(
            f"{strategy} divides a language model's blocks; use data with a vision model", where
        )
    if objective.generates():
        raise UserInputError(
            f"{objective.name} generates while it trains or evaluates, each rank its own "
            f"prompts; {strategy}'s every forward is a collective of all ranks: use data",
            where,
        )
    if not list(getattr(model, "layers", None) or []):
        raise UserInputError("this model has no list of blocks to shard: use data", where)
    if strategy == "tensor":
        split_model(model, objective.components.lm, world, log)
        return
    n = shard_blocks(model, world.group)
    mx.eval(model.parameters())
    mx.clear_cache()  # the whole blocks' buffers go back
    log(
        f"fully sharded: each of {world.size} ranks holds 1/{world.size} of the {n} blocks' "
        "weights, gradients and optimizer state, gathered a block at a time"
    )
    if scatter_kind(world.group) == "all_sum":
        log(
            f"note: the {world.backend} backend has no reduce-scatter (sum_scatter): each "
            "block's gradients are all-reduced whole and each rank keeps its rows, twice the "
            "bytes a reduce-scatter moves"
        )
    if checkpointed_layers(model) < n:
        log(
            "note: blocks without train.grad_checkpointing keep their gathered weights for the "
            "backward: fsdp saves most with every block checkpointed"
        )


def split_model(model, lm, world, log) -> None:
    """``distributed.strategy: tensor``: each block's heads and MLP columns divided among the
    ranks (``mlxtune.tensor``), or the reason they cannot be, naming the family."""
    why = tensor.refusal(model, world.size)
    if why is not None:
        family = getattr(getattr(model, "args", None), "model_type", None) or type(model).__module__
        raise UserInputError(
            f"{family}: {why}; tensor parallelism splits attention heads and MLP columns "
            "(fsdp divides any block)",
            "distributed.strategy",
        )
    n = tensor.shard_tensors(model, world.group)
    whole = tensor.split_head(model, lm.head_path, lm.softcap, world.group)
    mx.eval(model.parameters())
    mx.clear_cache()
    log(
        f"tensor-parallel: each of {world.size} ranks holds 1/{world.size} of the attention "
        f"heads and MLP columns of the {n} blocks, and "
        + (f"the whole head ({whole})" if whole else f"1/{world.size} of the head's vocabulary")
        + "; every rank computes on the whole batch"
    )


def _total_steps(t, batches_per_epoch: int | None) -> int:
    """train.max_steps, or the steps train.epochs take."""
    if t.max_steps is not None:
        return t.max_steps
    return max(1, math.ceil(t.epochs * batches_per_epoch / t.grad_accumulation))


def record(trainer) -> None:
    """What a set-up run writes before it trains: ``recipe.yaml`` (the recipe as resolved) and
    ``config_resolved.json``."""
    trainer.run_dir.write_text("recipe.yaml", dump_yaml(trainer.recipe.to_dict()))
    trainer.run_dir.write_json("config_resolved.json", describe.resolved(trainer))


def rank_folder(path: Path, scratch) -> RunDir:
    """A rank other than 0 builds in its scratch folder; what building reads from the run (its
    trained or GGUF tokenizer) is copied there first."""
    out = RunDir(scratch, create=True)
    if (path / "tokenizer").is_dir():
        shutil.copytree(path / "tokenizer", out.path / "tokenizer")
    return out


@contextlib.contextmanager
def all_ranks_set_up(world):
    """Every rank builds the run; none goes on to train unless all of them could (a rank that
    refused the input would leave the others waiting on it for ever)."""
    if world.size == 1:
        yield
        return
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):  # (bad input, failed)
            world.agree([float(isinstance(e, UserInputError)), 1.0])
        raise
    refused, failed = world.agree([0.0, 0.0])
    if refused > 0:
        raise UserInputError(
            "another rank refused this run (its message says why)", f"rank {world.rank}"
        )
    if failed > 0:
        raise TrainingError("another rank could not set up this run (its message says why)")


__all__ = ["Run", "all_ranks_set_up", "rank_folder", "record", "run_folders", "set_up"]
