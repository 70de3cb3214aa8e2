"""Runs on disk: the run directory and its fixed places (``rundir``), checkpoints, written,
checked, found, pruned and resumed from (``checkpoint``), and what ``generate`` and ``chat`` load
(``generation``). Import the submodules."""
