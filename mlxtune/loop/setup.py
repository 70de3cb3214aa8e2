"""Where a run is built: its run directory (new, resumed, a dry run's scratch folder, or a
data-parallel rank's), and the agreement of every rank that the set-up went through."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from .. import distributed
from ..checkpoint import named
from ..errors import TrainingError, UserInputError
from ..rundir import RunDir, holds_a_run


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


def watchdog(world, timeout, run_dir, context):
    """The data-parallel ranks' watchdog (``distributed.Watchdog``): ``context()`` gives the
    step, the last checkpoint and the resume command its line says; rank 0 logs the line."""

    def on_fire(line: str):
        if world.main:
            run_dir.log(line)

    return distributed.Watchdog(world, timeout, context, on_fire, distributed.heartbeats_folder())


__all__ = ["all_ranks_set_up", "rank_folder", "run_folders", "watchdog"]
