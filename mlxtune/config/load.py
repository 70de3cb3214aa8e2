"""Reading a recipe: YAML with ``safe_load`` semantics only, ``key.sub=value`` overrides, and
type checks against the schema; every problem is a ``UserInputError`` naming the file, line and
key (or the override that set it).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, NoReturn, Union

import yaml

from ..errors import UserInputError
from .rules import check_values, show_value
from .schema import OBJECTIVE_CONFIGS, ObjectiveConfig, Recipe

# --------------------------------------------------------------------------------------------
# YAML with line numbers (safe: compose builds nodes, never Python objects)


class _Lines:
    """Maps a dotted key path to the line it was written on."""

    def __init__(self, source: str, text: str):
        self.source = source
        self.lines: dict[str, int] = {}
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            node = None
        if node is not None:
            self._walk(node, "")

    def _walk(self, node, prefix: str):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                self.lines[key] = k.start_mark.line + 1
                self._walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                key = f"{prefix}[{i}]"
                self.lines[key] = v.start_mark.line + 1
                self._walk(v, key)

    def where(self, key: str) -> str:
        k = key
        while k:
            if k in self.lines:
                return f"{self.source}:{self.lines[k]}: {key}"
            k = k.rsplit(".", 1)[0] if "." in k else ""
        return f"{self.source}: {key}"


class _Overrides:
    """Remembers which keys came from the command line, to blame them properly."""

    def __init__(self, keys: dict[str, str]):
        self.keys = keys

    def lookup(self, key: str, written: bool = True) -> str | None:
        """The override that set ``key``, or (``written`` false: the file has no such key) made
        it as a section on the way to its own key."""
        for k, raw in self.keys.items():
            if key == k or key.startswith(k + ".") or key.startswith(k + "["):
                return f"override {raw!r}: {key}"
            if not written and k.startswith(key + "."):
                return f"override {raw!r}: {key}"
        return None


# --------------------------------------------------------------------------------------------
# Validation


class _Validator:
    """Builds the schema's dataclasses from plain data, checking every key and type, and
    remembers which dotted keys the data wrote."""

    def __init__(self, lines: _Lines, overrides: _Overrides):
        self.lines = lines
        self.overrides = overrides
        self.explicit: set[str] = set()

    def where(self, key: str) -> str:
        written = key in self.lines.lines
        return self.overrides.lookup(key, written) or self.lines.where(key)

    def fail(self, key: str, msg: str) -> NoReturn:
        raise UserInputError(msg, self.where(key))

    def build(self, cls: type, data: Any, key: str):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.fail(key or "recipe", f"expected a mapping of keys, got {show_value(data)}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        kwargs = {}
        for k, v in data.items():
            sub = f"{key}.{k}" if key else str(k)
            if k not in fields:
                close = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                allowed = ", ".join(fields)
                self.fail(sub, f"unknown key{hint} (known here: {allowed})")
            kwargs[k] = self.check(hints[k], v, sub)
            self.explicit.add(sub)
        return cls(**kwargs)

    def build_objective(self, data: Any, key: str) -> ObjectiveConfig:
        """The objective section, read as the class registered for its type."""
        name = ObjectiveConfig.type
        if isinstance(data, dict) and "type" in data:
            name = self.check(str, data["type"], f"{key}.type")
        cls = OBJECTIVE_CONFIGS.get(name)
        if cls is None:
            known = list(OBJECTIVE_CONFIGS)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            self.fail(
                f"{key}.type", f"unknown objective {name!r}{hint} (registered: {', '.join(known)})"
            )
        return self.build(cls, data, key)

    def check(self, tp, value, key: str):
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return value
        if origin in (Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            non_none = [a for a in args if a is not type(None)]
            if len(non_none) == 1:
                return self.check(non_none[0], value, key)
            for a in non_none:  # first that fits
                try:
                    return self.check(a, value, key)
                except UserInputError:
                    continue
            self.fail(key, f"unexpected value {show_value(value)}")
        if value is None:
            self.fail(key, "a value is required here (got null)")
        if tp is ObjectiveConfig:  # the registered class for objective.type, not the base
            return self.build_objective(value, key)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, key)
        if origin is Literal:
            if isinstance(value, bool):  # YAML 1.1 reads a bare off/no as false, on/yes as true
                words = ("on", "yes", "true") if value else ("off", "no", "false")
                value = next((w for w in words if w in args), value)
            if value not in args:
                close = [str(a) for a in args if str(a).lower() == str(value).lower()]
                close = close or difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                choices = ", ".join(repr(a) for a in args)
                self.fail(key, f"{show_value(value)} is not one of {choices}{hint}")
            return value
        if origin is list:
            if not isinstance(value, list):
                self.fail(key, f"expected a list, got {show_value(value)}")
            return [self.check(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
        if tp is dict:
            if not isinstance(value, dict):
                self.fail(key, f"expected a mapping, got {show_value(value)}")
            return value
        if tp is bool:
            if not isinstance(value, bool):
                self.fail(key, f"expected true or false, got {show_value(value)}")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(key, f"expected an integer, got {show_value(value)}")
            return value
        if tp is float:
            if isinstance(value, str):  # YAML 1.1 reads 1e-4 as a string
                try:
                    value = float(value)
                except ValueError:
                    self.fail(key, f"expected a number, got {show_value(value)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.fail(key, f"expected a number, got {show_value(value)}")
            try:
                value = float(value)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                self.fail(key, "expected a finite number")
            return value
        if tp is str:
            if not isinstance(value, str):
                self.fail(key, f"expected a string, got {show_value(value)}")
            return value
        raise TypeError(f"recipe schema: unsupported type {tp} at {key}")


def parse_override(raw: str) -> tuple[str, Any]:
    """``train.batch_size=8`` -> ("train.batch_size", 8); the value is read as YAML."""
    if "=" not in raw:
        raise UserInputError(f"expected key.sub=value, got {raw!r}", "override")
    key, _, text = raw.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserInputError(f"bad key in {raw!r}", "override")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise UserInputError(f"value of {raw!r} is not valid YAML: {problem}", "override") from None
    return key, value


FILE_KEYS = ("data.train", "data.valid", "data.test", "adapter.init_from", "objective.reward_model")
"""Keys that name a file or folder: given as an override, a relative one is taken from the
directory the command was typed in (in the recipe file, from the recipe's folder)."""
FILE_OR_ID_KEYS = ("model.path", "tokenizer.path")
"""Keys that name a folder or a Hub id: an override is taken from the current directory when
that folder exists there (else it stays as given)."""


def _from_here(key: str, value: Any) -> Any:
    """An override's value with a relative path made absolute from the current directory, for
    the keys that hold paths (``FILE_KEYS``, ``FILE_OR_ID_KEYS``)."""
    if not isinstance(value, str) or not value or value.startswith("package:"):
        return value
    path = Path(value).expanduser()
    if path.is_absolute() or key not in FILE_KEYS + FILE_OR_ID_KEYS:
        return value
    here = Path.cwd() / path
    if key in FILE_OR_ID_KEYS and not here.exists():
        return value
    return str(here)


def apply_overrides(data: dict, overrides: list[str]) -> dict[str, str]:
    """Set each ``key.sub=value`` into ``data`` in place (making sections as needed), a relative
    path taken from the current directory (``_from_here``); returns the raw override text by
    dotted key, to name it in messages."""
    applied = {}
    for raw in overrides:
        key, value = parse_override(raw)
        value = _from_here(key, value)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise UserInputError(
                    f"{part!r} is not a section, cannot set {key}", f"override {raw!r}"
                )
            node = node[part]
        node[parts[-1]] = value
        applied[key] = raw
    return applied


def recipe_from_dict(
    data: dict, source: str = "<recipe>", text: str = "", overrides: dict[str, str] | None = None
) -> Recipe:
    """Validate a recipe given as a dict (already loaded) and return it.

    ``text`` is the YAML the dict came from (for line numbers) and ``overrides`` the raw
    override by dotted key (see ``apply_overrides``). The recipe's ``explicit`` holds every
    dotted key ``data`` wrote; a dict without an ``objective`` section trains sft.
    """
    v = _Validator(_Lines(source, text), _Overrides(overrides or {}))
    recipe = v.build(Recipe, data, "")
    recipe.source = source if source != "<recipe>" else None
    recipe.explicit = frozenset(v.explicit)
    check_values(recipe, v)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe file."""
    path = Path(path)
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserInputError("recipe file not found", src) from None
    except UnicodeDecodeError as e:
        raise UserInputError(f"not UTF-8 text ({e.reason} at byte {e.start})", src) from None
    except OSError as e:
        raise UserInputError(f"cannot read recipe: {e.strerror}", src) from None
    data = parse_yaml(text, src)
    applied = apply_overrides(data, list(overrides))
    return recipe_from_dict(data, src, text, applied)


def parse_yaml(text: str, source: str) -> dict:
    """A recipe's YAML text as a dict (``safe_load``: plain data, never Python objects)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e)
        raise UserInputError(f"YAML does not parse: {problem}", where) from None
    if data is None:
        raise UserInputError("the recipe is empty", source)
    if not isinstance(data, dict):
        raise UserInputError(
            "a recipe is a mapping of sections (model:, data:, train:, ...)", source
        )
    _no_key_twice(yaml.compose(text, Loader=yaml.SafeLoader), source, "")
    return data


def _no_key_twice(node, source: str, prefix: str) -> None:
    """Refuse a mapping that gives a key twice (YAML would keep the last one silently)."""
    if isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _no_key_twice(v, source, f"{prefix}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for k, v in node.value:
        key = f"{prefix}.{k.value}" if prefix else str(k.value)
        line = k.start_mark.line + 1
        if key in seen and k.tag != "tag:yaml.org,2002:merge":
            raise UserInputError(
                f"given twice (first on line {seen[key]})", f"{source}:{line}: {key}"
            )
        seen[key] = line
        _no_key_twice(v, source, key)


def dump_yaml(data: dict) -> str:
    """YAML text for plain data, keys in their order."""
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
