"""Training objectives, by the name a recipe's ``objective.type`` gives them.

>>> from mlxtune.objectives import Objective, register
>>> @register
... class Mine(Objective):
...     name = "mine"
...     ...

``register`` also registers the objective's ``Config`` (its recipe section), so the recipe
validates the objective's keys like any other section's.
"""

from __future__ import annotations

from ..config import register_objective_config, unregister_objective_config
from ..errors import UserInputError
from .base import Components, Objective, Usage, target_rows
from .cpo import CPO
from .distill import Distill
from .grpo import GRPO, RolloutBatch
from .kto import KTO
from .online_dpo import OnlineDPO
from .ppo import PPO
from .preference import DPO, ORPO, Preference, Reward
from .sft import SFT

OBJECTIVES: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Make ``cls`` the objective a recipe's ``objective.type: <cls.name>`` trains with, and
    ``cls.Config`` its recipe section (see ``mlxtune.config.register_objective_config``).
    Another class under a taken name is refused."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    taken = OBJECTIVES.get(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"objective {cls.name!r} is registered already, to {taken.__qualname__}")
    register_objective_config(cls.name, cls.Config)
    OBJECTIVES[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget the objective ``name`` and its recipe section."""
    unregister_objective_config(name)
    OBJECTIVES.pop(name, None)


def build_objective(recipe, components: Components) -> Objective:
    """The objective the recipe names, built over the run's components."""
    return objective_class(recipe)(recipe, components)


def objective_class(recipe) -> type[Objective]:
    """The class of the objective the recipe names."""
    name = recipe.objective.type
    if name not in OBJECTIVES:
        raise UserInputError(
            f"unknown objective {name!r}; known: {', '.join(sorted(OBJECTIVES))}",
            "objective.type",
        )
    return OBJECTIVES[name]


for _cls in (SFT, DPO, ORPO, CPO, Reward, KTO, Distill, GRPO, PPO, OnlineDPO):
    register(_cls)
del _cls

__all__ = [
    "Components",
    "CPO",
    "Distill",
    "DPO",
    "GRPO",
    "KTO",
    "ORPO",
    "OnlineDPO",
    "PPO",
    "Preference",
    "Reward",
    "RolloutBatch",
    "objective_class",
    "Objective",
    "OBJECTIVES",
    "SFT",
    "Usage",
    "build_objective",
    "register",
    "target_rows",
    "unregister",
]
