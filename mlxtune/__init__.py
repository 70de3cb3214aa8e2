"""mlxtune: fine-tune language models with MLX, from one YAML recipe.

import mlxtune
recipe = mlxtune.load_recipe("recipes/quickstart.yaml", ["train.max_steps=100"])
summary = mlxtune.Trainer(recipe, run_dir="runs/demo").run()
"""

from ._blas import setup_blas as _setup_blas
from ._malloc import setup_malloc as _setup_malloc
from ._schedule import setup_schedule as _setup_schedule

# Must run before mlx.core is first imported (see _blas.py).
_setup_blas()
# Before MLX allocates: freed buffers stay in the process (see _malloc.py).
_setup_malloc()
# Before MLX first evaluates: it reads its evaluation width once (see _schedule.py).
_setup_schedule()

from ._version import __version__ as __version__  # noqa: E402
from .config import Recipe, load_recipe, recipe_from_dict  # noqa: E402
from .errors import MlxtuneError, TrainingError, UserInputError  # noqa: E402
from .loop import Callback, StepEvent, Trainer  # noqa: E402


def run(recipe, run_dir=None, overrides=(), callbacks=()) -> dict:
    """Load (if given a path), build and train a recipe; returns the run summary."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, list(overrides))
    return Trainer(recipe, run_dir=run_dir, callbacks=callbacks).run()


__all__ = [
    "Callback",
    "MlxtuneError",
    "Recipe",
    "StepEvent",
    "Trainer",
    "TrainingError",
    "UserInputError",
    "load_recipe",
    "recipe_from_dict",
    "run",
]
