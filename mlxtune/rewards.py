"""Reward functions for reinforcement learning: the built-ins a recipe names, and functions of the
user's own in a Python file beside the recipe.

A reward function is called once per batch of completions::

    def my_reward(prompts, completions, completion_ids, **fields) -> list[float | None]

``prompts`` and ``completions`` are lists of strings (a chat prompt: the text the model read,
template included), ``completion_ids`` the completions' token ids, and every other key of the
prompt rows (``answer`` and anything else) arrives as a list of the same length under its own
name. It returns one float per completion, or None where it does not apply (such a completion
gets nothing from this function). The weighted sum over the recipe's functions is the reward.

Built-ins:

- ``exact_match``: 1 where the completion (or the first group of ``extract``, a regex searched
  in it; the whole match when the pattern has no group) equals the row's ``answer``, whitespace
  normalised; 0 otherwise, and where ``extract`` finds nothing.
- ``regex``: 1 where ``pattern`` is found in the completion (``re.search``, ``.`` matching
  newlines: anchor it with ``^...$`` to ask for the whole completion), else 0.
- ``length``: ``max(0, 1 - |n - target| / target)`` for a completion of ``n`` tokens.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .errors import UserInputError


@dataclass
class RewardSpec:
    """One reward function and its weight: a built-in (``name``) or a function of yours
    (``function: file.py:name``, the file beside the recipe)."""

    name: Literal["exact_match", "regex", "length"] | None = None
    """A built-in: exact_match (against the row's answer), regex (pattern found), length
    (closeness to target tokens)."""
    function: str | None = None
    """FILE.py:FUNCTION, a file relative to the recipe: f(prompts, completions, completion_ids,
    **fields) -> list of float or None."""
    weight: float = 1.0
    """Its weight in the summed reward."""
    pattern: str | None = None
    """regex: the pattern a completion must contain."""
    extract: str | None = None
    """exact_match: a regex whose first group (or whole match) is the answer compared."""
    target: int | None = None
    """length: the completion length, in tokens, that scores 1."""


def _normalise(s: str) -> str:
    return " ".join(s.split())


def _compile(pattern: str, key: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise UserInputError(f"not a valid regular expression: {e}", key) from None


def exact_match_reward(extract: str | None = None, key: str = "extract") -> Callable:
    rx = _compile(extract, key) if extract else None

    def exact_match(prompts, completions, completion_ids, answer=None, **_):
        if answer is None:
            raise ValueError("the prompt rows have no 'answer' to compare with")
        out = []
        for c, a in zip(completions, answer, strict=True):
            if a is None:
                out.append(None)
                continue
            if rx is not None:
                m = rx.search(c)
                if m is None:
                    out.append(0.0)
                    continue
                c = m.group(1) if rx.groups else m.group(0)
            out.append(float(_normalise(c) == _normalise(str(a))))
        return out

    return exact_match


def regex_reward(pattern: str, key: str = "pattern") -> Callable:
    rx = _compile(pattern, key)

    def regex(prompts, completions, completion_ids, **_):
        return [float(rx.search(c) is not None) for c in completions]

    return regex


def length_reward(target: int) -> Callable:
    def length(prompts, completions, completion_ids, **_):
        return [max(0.0, 1.0 - abs(len(ids) - target) / target) for ids in completion_ids]

    return length


def _user_function(ref: str, recipe, key: str) -> Callable:
    return load_user(ref, recipe, key, "reward function")


def load_user(ref: str, recipe, key: str, what: str) -> Callable:
    """``FILE.py:NAME`` (the file relative to the recipe) imported: a function or class of the
    user's (``what`` it is, for messages); one that cannot be imported is a
    ``UserInputError`` naming ``key``."""
    file, sep, name = ref.rpartition(":")
    if not sep or not file or not name.isidentifier():
        kind = "CLASS" if "class" in what else "FUNCTION"
        raise UserInputError(f"expected FILE.py:{kind}, got {ref!r}", key)
    path = recipe.resolve_path(file)
    if path is None or not path.is_file():
        raise UserInputError(f"no such file: {path}", key)
    if path.suffix != ".py":
        raise UserInputError(f"a {what} lives in a .py file, not {path.name}", key)
    mod_name = f"mlxtune_rewards_{abs(hash(str(path.resolve())))}"
    try:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    except Exception as e:
        raise UserInputError(f"{path} failed to load: {type(e).__name__}: {e}", key) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        kind = "class" if "class" in what else "function"
        raise UserInputError(f"{path} defines no {kind} {name!r}", key)
    return fn


@dataclass
class Reward:
    """A recipe's reward function, ready to call."""

    label: str
    """Its name in metrics (``rewards/<label>``)."""
    weight: float
    fn: Callable
    where: str
    """The recipe key that named it, for errors."""


def build_rewards(specs: list[RewardSpec], recipe, key: str = "objective.rewards") -> list[Reward]:
    """The recipe's reward functions; a spec with a key its kind never reads, or missing one it
    needs, is refused naming the key."""
    out: list[Reward] = []
    used: dict[str, int] = {}
    for i, s in enumerate(specs):
        at = f"{key}[{i}]"
        if (s.name is None) == (s.function is None):
            raise UserInputError("give either a built-in 'name' or a 'function'", at)
        wants = {"exact_match": {"extract"}, "regex": {"pattern"}, "length": {"target"}}.get(
            s.name, set()
        )
        for k in ("pattern", "extract", "target"):
            if getattr(s, k) is not None and k not in wants:
                what = f"the {s.name} reward" if s.name else "a function of yours"
                raise UserInputError(f"{what} does not read {k!r}", f"{at}.{k}")
        if not math.isfinite(s.weight):
            raise UserInputError("must be a finite number", f"{at}.weight")
        if s.name == "exact_match":
            fn = exact_match_reward(s.extract, f"{at}.extract")
        elif s.name == "regex":
            if not s.pattern:
                raise UserInputError("the regex reward needs a 'pattern'", at)
            fn = regex_reward(s.pattern, f"{at}.pattern")
        elif s.name == "length":
            if s.target is None or s.target < 1:
                raise UserInputError("the length reward needs a 'target' of at least 1", at)
            fn = length_reward(s.target)
        else:
            fn = _user_function(s.function, recipe, f"{at}.function")
        label = s.name or s.function.rpartition(":")[2]
        used[label] = used.get(label, 0) + 1
        if used[label] > 1:
            label = f"{label}_{used[label]}"
        out.append(Reward(label, s.weight, fn, f"{at} ({s.name or s.function})"))
    return out


def score(
    rewards: list[Reward],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    fields: list[dict],
) -> tuple[list[float], dict[str, list[float | None]]]:
    """(each completion's weighted reward, each function's own values by label). A function
    that raises or returns something other than one number (or None) per completion is a
    ``UserInputError`` naming it; a completion no function scored gets 0."""
    n = len(completions)
    columns: dict[str, list] = {}
    for k in {k for f in fields for k in f}:
        if k in ("prompts", "completions", "completion_ids"):
            continue
        columns[k] = [f.get(k) for f in fields]
    total = [0.0] * n
    each: dict[str, list[float | None]] = {}
    for r in rewards:
        try:
            got = r.fn(prompts, completions, completion_ids, **columns)
        except Exception as e:
            raise UserInputError(
                f"reward function failed: {type(e).__name__}: {e}", r.where
            ) from None
        try:
            got = list(got)
        except TypeError:
            got = None
        if got is None or len(got) != n:
            raise UserInputError(
                f"reward function returned {type(got).__name__ if got is None else len(got)} "
                f"values for {n} completions (one number or None each)",
                r.where,
            )
        vals: list[float | None] = []
        for v in got:
            if v is None:
                vals.append(None)
                continue
            if isinstance(v, bool):
                v = float(v)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UserInputError(
                    f"reward function returned {v!r}; expected a finite number or None", r.where
                )
            vals.append(float(v))
        each[r.label] = vals
        for i, v in enumerate(vals):
            if v is not None:
                total[i] += r.weight * v
    return total, each


__all__ = [
    "Reward",
    "RewardSpec",
    "build_rewards",
    "load_user",
    "exact_match_reward",
    "length_reward",
    "regex_reward",
    "score",
]
