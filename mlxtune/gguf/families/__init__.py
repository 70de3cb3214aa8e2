"""Families whose GGUF facts sit in one module each: a family whose tensors follow the shared
name table (``names``) and need no conversion of their own is one module here (with a
``FACTS = FamilyFacts(...)``) plus its test; the export, the import and the refusals all read
``FACTS``. The families not moved yet are spread over names, the export's hparams, writers and
fixed, and the import's configs and whole."""

from __future__ import annotations

import importlib
import pkgutil

from ..family import FamilyFacts

FACTS: dict[str, FamilyFacts] = {}
"""mlx-lm's model type -> its facts, one module of this package each."""
for _module in pkgutil.iter_modules(__path__):
    _facts = importlib.import_module(f"{__name__}.{_module.name}").FACTS
    FACTS[_facts.model_type] = _facts
