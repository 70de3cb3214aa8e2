"""What a run says when it cannot go on as planned: a write that failed (a full disk, a
read-only folder) and a stop at once (a second signal inside a long step). Each is one line: what
happened, at which step, what is lost and what is intact, and the command that goes on."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from .errors import TrainingError

WRITE_FAILED = re.compile(r"\[(write|save\w*)\]|unable to write|no space left", re.IGNORECASE)
"""What MLX's writers say when a write fails (they raise RuntimeError, with no errno)."""


def resume_command(source: str | None, run_dir: Path) -> str:
    """The command that continues a run from its last checkpoint."""
    return f"mlxtune run {source or 'RECIPE.yaml'} --run-dir {run_dir} --resume"


def write_failed(
    what: str, e: BaseException, step: int, run_dir: Path, last: str, go_on: str
) -> str:
    """The one line a run that could not write ``what`` (into ``run_dir``) ends with: why, the
    space left there, the last checkpoint ``last`` intact, and ``go_on``."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    try:
        left = shutil.disk_usage(run_dir).free
        free = (
            f"; {left / 1e9:.2f} GB free there"
            if left > 1e9
            else f"; {left / 1e6:.1f} MB free there"
        )
    except OSError:
        free = ""
    return (
        f"could not write {what} at step {step} ({why}{free}): the last checkpoint ({last}) is "
        "intact (a checkpoint is written aside and renamed whole). Free space or make the "
        f"folder writable, then continue with: {go_on}"
    )


@contextlib.contextmanager
def writing(what: str, line):
    """Around writing ``what``: a failed write (OSError, or MLX's writer's RuntimeError) becomes
    a TrainingError of ``line(what, error)``; other errors pass."""
    try:
        yield
    except OSError as e:
        raise TrainingError(line(what, e)) from None
    except RuntimeError as e:
        if not WRITE_FAILED.search(str(e)):
            raise
        raise TrainingError(line(what, e)) from None


def lost_at_once(step: int, last: str, go_on: str) -> str:
    """What a stop at once says: the step it broke into (``step`` + 1), what is lost since the
    last checkpoint ``last``, and ``go_on``."""
    return (
        f"stopped at once by a second signal while step {step + 1} ran: the steps after the last "
        f"checkpoint ({last}) are lost, the checkpoint is intact. Resume with: {go_on}"
    )
