"""Run tracking: what a run writes to metrics.jsonl and samples.jsonl, and its resolved recipe,
sent on to TensorBoard or Weights & Biases as it is written (``report: [tensorboard, wandb]``).

Each is an optional extra (``pip install 'mlxtune[tensorboard]'``, ``'mlxtune[wandb]'``); only
rank 0 of a data-parallel run reports. A resumed run goes on with the same record:

- TensorBoard: event files in RUN_DIR/tensorboard, each attempt's starting with a session-start
  event (a resumed run's at the step after its checkpoint), which TensorBoard's loaders take as
  "drop what an earlier file holds from this step on": the steps the interrupted run wrote after
  its checkpoint are read once, as the resumed run wrote them.
- W&B: ``wandb.init`` in the mode the environment sets (``WANDB_MODE=offline`` needs no
  network), files under RUN_DIR/wandb, the run's id kept in RUN_DIR/wandb.json. A resumed run
  continues that id (``resume="allow"``) and skips the rows the interrupted run had logged
  already (they are the same rows: resuming is exact), so no step is logged twice. Offline, W&B
  cannot look the earlier attempt up: each attempt is its own ``offline-run-*`` folder with the
  same id, and ``wandb sync`` uploads them in order of start time.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import time
from pathlib import Path

from ..errors import UserInputError

NAMES = ("tensorboard", "wandb")
"""What ``report`` may list."""

ID_CHARS = string.ascii_lowercase + string.digits
"""What a W&B run id is made of."""


def scalars(row: dict) -> dict[str, float]:
    """A metrics row's numbers by tag: ``eval/...`` for evaluation and exact-match fields,
    ``train/...`` for the rest (step and time are the record's own)."""
    out = {}
    for k, v in row.items():
        if k in ("step", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if k.startswith("eval_"):
            out["eval/" + k[5:]] = float(v)
        elif k.startswith("exact_match"):
            out["eval/" + k] = float(v)
        else:
            out["train/" + k] = float(v)
    return out


def samples_text(step: int, samples: list[dict]) -> str:
    """Generation samples as Markdown: each prompt and its completion."""
    parts = [f"**step {step}**"]
    for s in samples:
        parts.append(
            f"**prompt:** {s.get('prompt', '')}\n\n**completion:** {s.get('completion', '')}"
        )
    return "\n\n---\n\n".join(parts)


class Reporter:
    """Where a run's records go besides its own files."""

    def row(self, row: dict) -> None:
        """A metrics.jsonl row (training, evaluation or exact match)."""

    def samples(self, step: int, samples: list[dict]) -> None:
        """The generation samples written at ``step``."""

    def close(self, failed: bool = False) -> None:
        """The run ended (``failed``: by an exception)."""


def _wait_past(folder: Path) -> None:
    """An event file is named after the second it was opened in, and TensorBoard reads a run's
    files in name order: a resumed run's file must come after the earlier ones'."""
    seconds = [p.name.split(".")[3] for p in folder.glob("events.out.tfevents.*")]
    latest = max((int(s) for s in seconds if s.isdigit()), default=0)
    time.sleep(min(2.0, max(0.0, latest + 1 - time.time())))  # at most 2 s, whatever the clock


class TensorBoardReporter(Reporter):
    """Event files in ``folder``: scalars, the recipe and samples as text."""

    def __init__(self, folder: Path, config: str, resumed_at: int | None):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        folder.mkdir(parents=True, exist_ok=True)
        _wait_past(folder)
        self._event = event_pb2
        self._writer = EventFileWriter(str(folder))
        # Every attempt starts with a session start at its first step. TensorBoard's loaders take
        # each one after the first as a restart: what earlier files hold from that step on is
        # dropped (the app's loader ignores the first, so a new run writes one too).
        start = 0 if resumed_at is None else resumed_at + 1
        log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._add(event_pb2.Event(step=start, wall_time=time.time(), session_log=log))
        self._text("config", f"```\n{config}\n```", start)
        self._writer.flush()

    def _add(self, event) -> None:
        self._writer.add_event(event)

    def _text(self, tag: str, text: str, step: int) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text import metadata

        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        value = summary_pb2.Summary.Value(
            tag=tag, metadata=metadata.create_summary_metadata(tag, ""), tensor=tensor
        )
        summary = summary_pb2.Summary(value=[value])
        self._add(self._event.Event(step=step, wall_time=time.time(), summary=summary))

    def row(self, row: dict) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(row).items()
        ]
        if values:
            summary = summary_pb2.Summary(value=values)
            when = float(row.get("time", time.time()))
            self._add(self._event.Event(step=int(row["step"]), wall_time=when, summary=summary))
            self._writer.flush()

    def samples(self, step: int, samples: list[dict]) -> None:
        self._text("samples", samples_text(step, samples), step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class WandbReporter(Reporter):
    """A W&B run in the mode the environment sets, its id and what it has logged kept in
    ``state`` (RUN_DIR/wandb.json) so that a resumed run continues it."""

    def __init__(self, run_dir: Path, name: str, config: dict, resumed: bool):
        import wandb

        self._wandb = wandb
        self._state_file = run_dir / "wandb.json"
        state = json.loads(self._state_file.read_text()) if self._state_file.exists() else {}
        self._id = state.get("id") or "".join(secrets.choice(ID_CHARS) for _ in range(8))
        # rows the interrupted run logged: (its last step, how many rows at that step)
        self._done = (state.get("step", -1), state.get("rows", 0)) if resumed else (-1, 0)
        self._at = (-1, 0)
        try:  # what init is given wins over the environment: only defaults are set here
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "mlxtune"),
                name=os.environ.get("WANDB_NAME", name),
                id=self._id,
                resume="allow",
                dir=str(run_dir),
                config=config,
            )
        except wandb.errors.Error as e:  # not logged in, no server: before the first step
            raise UserInputError(
                f"W&B could not start its run ({e}); log in with `wandb login`, or set "
                "WANDB_MODE=offline to record it here and `wandb sync` it later",
                "report",
            ) from None
        self._save()

    def _save(self) -> None:
        step, rows = max(self._done, self._at)
        tmp = self._state_file.with_name(self._state_file.name + ".tmp")
        tmp.write_text(json.dumps({"id": self._id, "step": step, "rows": rows}))
        os.replace(tmp, self._state_file)  # a kill mid-write leaves the old file whole

    def _fresh(self, step: int) -> bool:
        """Counts a record at ``step``; whether the interrupted run had not logged it."""
        at, n = self._at
        self._at = (step, n + 1 if step == at else 1)
        return self._at > self._done

    def row(self, row: dict) -> None:
        step = int(row["step"])
        if self._fresh(step):
            self._run.log(scalars(row), step=step)
            self._save()

    def samples(self, step: int, samples: list[dict]) -> None:
        if self._fresh(step):
            cols = ["step", "prompt", "completion"]
            data = [[step, s.get("prompt", ""), s.get("completion", "")] for s in samples]
            self._run.log({"samples": self._wandb.Table(columns=cols, data=data)}, step=step)
            self._save()

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


def open_reporters(recipe, run_dir: Path, config_text: str, resumed_at: int | None):
    """The reporters ``recipe.report`` asks for, opened for a run in ``run_dir`` (resumed after
    step ``resumed_at``, or new when None); ``config_text``: the resolved recipe as YAML."""
    out: list[Reporter] = []
    for n in recipe.report:
        if n == "tensorboard":
            out.append(TensorBoardReporter(run_dir / "tensorboard", config_text, resumed_at))
        elif n == "wandb":
            out.append(
                WandbReporter(run_dir, run_dir.name, recipe.to_dict(), resumed_at is not None)
            )
    return out
