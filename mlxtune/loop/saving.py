"""The trainer's checkpoints: rank 0 saves the run's full state (``checkpoint.save``; in a
fully sharded run every rank gathers the pieces it writes), logs it,
warns once when the active memory creeps up from one checkpoint to the next, and keeps the
newest ``checkpoints.keep_last``."""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import distributed
from ..engine.memory import creeping, described, stage
from ..engine.state import TrainState
from ..fsdp import drain
from ..runs.checkpoint import prune, save


class Saver:
    """Saves ``trainer``'s checkpoints; its steps must have been read (``_read_steps``)."""

    def __init__(self, trainer):
        self._trainer = trainer
        self._active: list[tuple[int, float]] = []
        """(step, active memory) at each checkpoint: memory that creeps is warned of once."""
        self._warned_creep = False

    def save(self, name: str, extra: dict | None = None, prune_after: bool = True) -> None:
        t = self._trainer
        whole = None
        if t.engine.sharded:  # every rank gathers the pieces (collectives); rank 0 writes
            with distributed.collectives(t.world):
                whole = (t.engine.layout.whole_trainable(t.model), t.engine.checkpoint_arrays())
                if not t.world.main:
                    for tensors in (whole[0], *whole[1].values()):  # as rank 0 writes them
                        drain(tensors)
        if not t.world.main:  # rank 0 writes the run's checkpoints
            return
        state = TrainState(t.position, t.engine.host_state())
        with (
            t.guard.writing(f"checkpoints/{name}"),
            stage("checkpoint", t.parts.stages),
            distributed.collectives(t.world) if whole else contextlib.nullcontext(),
        ):
            save(t.run_dir, name, t.trained, t.recipe, t.engine, state, t.last_loss, extra, whole)
        took = described(t.parts.stages["checkpoint"])
        t.log(f"saved checkpoint checkpoints/{name} at step {t.position.step} ({took})")
        self._active.append((t.position.step, mx.get_active_memory()))
        warning = creeping(self._active) if not self._warned_creep else None
        if warning:
            self._warned_creep = True
            t.log(f"WARNING: {warning}")
        if prune_after:
            prune(t.run_dir, t.recipe.checkpoints.keep_last)


__all__ = ["Saver"]
