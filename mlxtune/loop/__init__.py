"""The training loop and what it keeps beside it.

- ``trainer``: ``Trainer``, the one loop: build, train, evaluate, checkpoint, export.
- ``callbacks``: what callbacks see (``Callback``, ``StepEvent``).
- ``meter``: the metrics window and a step's record.
- ``control``: signals and the dashboard's requests (``RUN_DIR/control/``).
- ``stopping``: early stopping.
- ``describe``: what a built run says about itself (derived figures, the header).
- ``report``: TensorBoard and Weights & Biases.
- ``setup``: the run's folders and ``set_up`` (what the recipe is made into: ``Run``, held as
  ``trainer.parts``).
- ``guard``: the lines a run that stops short ends with (failed write, lost step, watchdog).
- ``saving``: checkpoints, with the warning for memory that creeps.
- ``ending``: the best model restored, the exports, the summary, a dry run.
- ``records``: where metrics rows and samples go.

Nothing below the loop imports it: build, the objective, the engine and checkpoints are handed
a logger, not the Trainer.
"""

from __future__ import annotations

from .callbacks import Callback, StepEvent
from .trainer import Trainer

__all__ = ["Callback", "StepEvent", "Trainer"]
