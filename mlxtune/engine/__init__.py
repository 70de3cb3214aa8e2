"""The step: the compiled steps that make and apply gradients (``steps``, the one place they are
made), mixed precision (``precision``), what a run carries from step to step (``state``), and the
optimizers and learning-rate schedules (``optim``). Import the submodules."""
