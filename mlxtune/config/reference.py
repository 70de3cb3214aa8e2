"""The recipe reference (docs/recipe.md), written from the schema: every section and key with
its type, default and the docstring under its field, and one section per registered objective.

    mlxtune keys                  # the whole reference, as Markdown
    mlxtune keys data             # one section
    mlxtune keys --write docs/recipe.md

The schema is the one source: a test fails when docs/recipe.md is not what this writes.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from .schema import OBJECTIVE_CONFIGS, Recipe, field_docs

HEADER = """# Recipe reference

Every key a recipe may set, section by section, with its type, its default and what it does.
This page is written by `mlxtune keys --write docs/recipe.md` from the docstrings under the
schema's fields (`mlxtune/config/schema.py`, `mlxtune/config/optimizers.py` and each
objective's section); a test fails when it is stale. A key left out takes its default; a key
that has no effect in the recipe's setting is named when the run starts (`mlxtune validate`
lists them too).
"""


INTERNAL = ("source", "explicit")
"""Recipe fields the loader fills in (the file it read, the keys it set), not keys."""


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    return _yaml(value)


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _kind(annotation: str) -> str:
    """An annotation as a reader writes the values: Literal['a', 'b'] as a | b."""
    return re.sub(
        r"Literal\[([^\]]*)\]",
        lambda m: " | ".join(x.strip().strip("'\"") for x in m.group(1).split(",")),
        annotation,
    )


def _nested(cls: type, name: str) -> type | None:
    """The dataclass a field of ``cls`` holds (directly or as ``X | None``), if any."""
    hint = typing.get_type_hints(cls).get(name)
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _table(cls: type, prefix: str, out: list[str], skip=()) -> list[tuple[str, type]]:
    """The rows of ``cls``'s keys under ``prefix``; returns its nested sections."""
    docs = field_docs(cls)
    nested = []
    out.append("| key | type | default | what it does |")
    out.append("| --- | --- | --- | --- |")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        inner = _nested(cls, f.name)
        kind = _kind(str(f.type)).replace("|", "\\|")
        doc = docs.get(f.name, "").replace("|", "\\|")
        if inner is not None:
            nested.append((f"{prefix}{f.name}", inner))
            doc += f" (keys below: `{prefix}{f.name}`)"
        out.append(f"| `{prefix}{f.name}` | `{kind}` | `{_default(f)}` | {doc} |")
    return nested


def _section(title: str, cls: type, prefix: str, out: list[str], skip=()) -> None:
    out.append(f"\n## {title}\n")
    if cls.__doc__:
        out.append(" ".join(cls.__doc__.split()) + "\n")
    for sub, inner in _table(cls, prefix, out, skip):
        _section(f"`{sub}`", inner, f"{sub}.", out)


def sections() -> list[str]:
    """The recipe's top-level section names, in the schema's order."""
    return [f.name for f in dataclasses.fields(Recipe)]


def recipe_reference(only: str | None = None) -> str:
    """The reference as Markdown: every section, or the section ``only``."""
    out: list[str] = [] if only else [HEADER]
    top = {f.name: f for f in dataclasses.fields(Recipe)}
    if only is not None and only not in top:
        raise KeyError(only)
    plain = [f for f in dataclasses.fields(Recipe) if _nested(Recipe, f.name) is None]
    if only is None:
        out.append("\n## Top level\n")
        inner = [f.name for f in top.values() if f not in plain]
        _table(Recipe, "", out, skip=[*inner, *INTERNAL])
    for name, f in top.items():
        if f in plain or (only is not None and name != only):
            continue
        if name == "objective":
            out.append("\n## `objective`\n")
            out.append(
                "The objective's section: `objective.type` names it, and its other keys are "
                "that objective's.\n"
            )
            for kind, cls in OBJECTIVE_CONFIGS.items():
                _section(f"`objective.type: {kind}`", cls, "objective.", out)
            continue
        _section(f"`{name}`", _nested(Recipe, name), f"{name}.", out)
    if only is not None and not out:
        out.append(f"`{only}` is a key, not a section\n")
    return "\n".join(out).rstrip() + "\n"


__all__ = ["recipe_reference", "sections"]
