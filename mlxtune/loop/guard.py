"""What a run says when something stops it short: a write that failed, a stop at once inside a
long step, a data-parallel peer that went silent. Each line names the step, the last intact
checkpoint and the command that resumes the run (``failures`` words them)."""

from __future__ import annotations

import contextlib

from .. import distributed, failures
from ..runs.checkpoint import last_saved


class Guard:
    """The trainer's failure lines, read from its recipe, run directory and position."""

    def __init__(self, trainer):
        self._trainer = trainer

    def resume_command(self) -> str:
        t = self._trainer
        return failures.resume_command(t.recipe.source, t.run_dir.path)

    def write_failed(self, what: str, e: BaseException) -> str:
        """The one line a run that could not write ``what`` ends with."""
        t = self._trainer
        last, go_on = last_saved(t.run_dir), self.resume_command()
        return failures.write_failed(what, e, t.position.step, t.run_dir.path, last, go_on)

    def writing(self, what: str):
        """Around writing ``what`` into the run directory (``failures.writing``)."""
        return failures.writing(what, self.write_failed)

    def lost_at_once(self) -> str:
        """What a stop at once (a second signal inside a long step) says, and logs."""
        t = self._trainer
        last = last_saved(t.run_dir)
        line = failures.lost_at_once(t.position.step, last, self.resume_command())
        if t.world.main:
            t.run_dir.log(line)
        return line

    def watchdog(self):
        """The data-parallel ranks' watchdog (``distributed.Watchdog``), or nothing alone: its
        line gives the step, the last checkpoint and the resume command; rank 0 logs it."""
        t = self._trainer
        timeout = t.recipe.distributed.timeout_s
        if t.world.size == 1 or timeout is None or t.dry_run:
            return contextlib.nullcontext()

        def context():
            return t.position.step, last_saved(t.run_dir), self.resume_command()

        def on_fire(line: str):
            if t.world.main:
                t.run_dir.log(line)

        folder = distributed.heartbeats_folder()
        return distributed.Watchdog(t.world, timeout, context, on_fire, folder)


__all__ = ["Guard"]
