"""Errors that mlxtune reports to the user as one clear line."""

from __future__ import annotations


class MlxtuneError(Exception):
    """Base class of every error mlxtune raises on purpose."""


class UserInputError(MlxtuneError):
    """Bad input: a recipe, a data file, an argument or a model directory.

    The CLI prints the message alone (no traceback) and exits with code 2. ``where`` names the
    file (and line) or the recipe key the problem was found at.
    """

    def __init__(self, message: str, where: str | None = None):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


class TrainingError(MlxtuneError):
    """Training could not go on (for example the loss became NaN); exit code 1."""


class Interrupted(MlxtuneError):
    """SIGINT or SIGTERM: the step finished and a checkpoint was saved; exit code 130."""
