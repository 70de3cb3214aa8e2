"""Where a run is built: its run directory (new, resumed, a dry run's scratch folder, or a
data-parallel rank's), what the recipe names (``set_up``), and the agreement of every rank that
the set-up went through."""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path

import mlx.core as mx

from .. import _blas, memory
from ..build import build, kernel_tiers, optimizer_for
from ..config import dump_yaml, inert_notes
from ..engine.steps import Engine
from ..errors import TrainingError, UserInputError
from ..export import peft_refusal
from ..memory import plan, shape_of
from ..objectives import build_objective
from ..runs.checkpoint import named, restore
from ..runs.rundir import RunDir, holds_a_run
from . import autosize, describe


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


def set_up(trainer, source: RunDir | None) -> None:
    """Build what the trainer's recipe names onto it, in order: BLAS, the kernel tiers, the
    model, tokenizer and data (``built``), the objective, what ``auto`` sizes resolve to
    (``auto_sizes``), the step count (``total_steps``), the optimizer, the engine, the memory
    plan (``memory_estimate``), and a resumed run's state (``position``, ``resumed``). Writes
    ``recipe.yaml`` and ``config_resolved.json``. ``source``: the run a resumed run reads."""
    r, log = trainer.recipe, trainer.log
    trainer.blas = _blas.setup_blas()
    log(f"BLAS: {trainer.blas.note}")
    for note in inert_notes(r):  # keys the recipe sets that these settings never read
        log(note)
    trainer.tiers = kernel_tiers(r, log)
    wired = memory.wired_limit(mx.device_info(), mx.metal.is_available())
    if wired is not None:
        mx.set_wired_limit(wired)
        log(
            f"memory: wired limit {wired / memory.GB:.1f} GB (Metal's recommended working "
            "set: the weights and the step's buffers stay resident)"
        )
    resuming = trainer.resume_from is not None
    trainer.built = build(r, trainer.run_dir, trainer.tiers, resuming, log, trainer.console.rows)
    if "peft" in r.export.formats and (why := peft_refusal(trainer.model)) is not None:
        raise UserInputError(why, "export.formats")  # before training, not after it
    trainer.objective = build_objective(r, trainer.built.components)
    trainer.auto_sizes = autosize.resolve(trainer, optimizer_for)
    trainer.batches_per_epoch = trainer.objective.batches_per_epoch()
    t = r.train
    trainer.total_steps = (
        t.max_steps
        if t.max_steps is not None
        else max(1, math.ceil(t.epochs * trainer.batches_per_epoch / t.grad_accumulation))
    )
    trainer.optimizer = optimizer_for(r, trainer.total_steps)
    trainer.engine = Engine(trainer.model, trainer.optimizer, trainer.objective, r, trainer.world)
    # the plan first: a run it refuses pays for no reference pass
    trainer.memory_estimate = plan(shape_of(trainer), r, log)
    trainer.objective.prepare(trainer.run_dir, source, log)
    if resuming and not trainer.dry_run:
        which, steps, main = trainer.resume_from, trainer.total_steps, trainer.world.main
        state = restore(source, which, r, trainer.engine, log, main, steps)
        trainer.position, trainer.resumed = state.position, True
    if trainer.streamed:
        trainer.train_set.resume(trainer.position.data_stream)
    trainer.run_dir.write_text("recipe.yaml", dump_yaml(r.to_dict()))
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


__all__ = ["all_ranks_set_up", "rank_folder", "run_folders", "set_up"]
