"""The README and docs/ hold together: every link lands on a file and a heading that exist,
every recipe snippet names keys the schema has, every command is one mlxtune has, and every
shipped-recipe command line loads with its overrides. (docs/recipe.md is checked against the
schema in tests/test_recipe.py; the library examples run in tests/test_cli_and_docs.py and
tests/test_objectives.py.)"""

from __future__ import annotations

import dataclasses
import re
import shlex
import typing

import pytest
import yaml

from conftest import REPO
from mlxtune import config as R
from mlxtune.cli import cli

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def text(page) -> str:
    return page.read_text()


def anchors(page) -> set[str]:
    """GitHub's anchors of the page's headings (outside code blocks)."""
    out, fence = set(), False
    for line in text(page).splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def blocks(lang: str):
    """(page, code) of each fenced block whose info string is ``lang`` ("" for a bare fence)."""
    for page in PAGES:
        inside, body = None, []
        for line in text(page).splitlines():
            if line.startswith("```"):
                if inside is None:
                    inside, body = line[3:].strip(), []
                    continue
                if inside == lang:
                    yield page, "\n".join(body) + "\n"
                inside = None
            elif inside is not None:
                body.append(line)


def test_the_readme_is_a_front_door_and_docs_hold_the_reference():
    readme = text(REPO / "README.md")
    assert len(readme.splitlines()) <= 300
    for page in ("recipe", "recipes", "data", "models", "objectives", "rl", "exports",
                 "precision-and-memory", "distributed", "tracking", "kernels", "library",
                 "benchmarks"):  # fmt: skip
        assert f"(docs/{page}.md" in readme, page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_lands(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
        if re.match(r"https?://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{page.name}: {target}: no such file"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), f"{page.name}: {target}: no such heading"


def _keys_of(cls: type) -> dict[str, type | None]:
    """A dataclass's keys, each with the dataclass it holds (a nested section) or None."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        inner = None
        for arg in (hints[f.name], *typing.get_args(hints[f.name])):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                inner = arg
        out[f.name] = inner
    return out


def _check(snippet: dict, cls_keys: dict, where: str) -> int:
    """Every key of ``snippet`` is one of ``cls_keys``, nested sections recursively: how many
    keys were checked."""
    n = 0
    for k, v in snippet.items():
        assert k in cls_keys, f"{where}: unknown key {k!r}"
        n += 1
        inner = cls_keys[k]
        if inner is not None and isinstance(v, dict):
            n += _check(v, _keys_of(inner), f"{where}.{k}")
    return n


def test_every_recipe_snippet_names_keys_the_schema_has():
    sections = _keys_of(R.Recipe)
    objective = {}
    for cls in R.OBJECTIVE_CONFIGS.values():  # a snippet may show several objectives' keys
        objective.update(_keys_of(cls))
    checked = 0
    for page, block in blocks("yaml"):
        lines = [x for x in block.splitlines() if x.strip() and not x.lstrip().startswith("#")]
        one_liners = all(not x.startswith(" ") for x in lines)
        docs = [yaml.safe_load(x) for x in lines] if one_liners else [yaml.safe_load(block)]
        for doc in docs:
            assert isinstance(doc, dict), f"{page.name}: a yaml block that is no mapping"
            for k, v in doc.items():
                assert k in sections, f"{page.name}: unknown section {k!r}"
                checked += 1
                if v is None:  # a section named with its keys in comments
                    continue
                if k == "objective":
                    checked += _check(v, objective, f"{page.name}: objective")
                elif isinstance(v, dict) and sections[k] is not None:
                    checked += _check(v, _keys_of(sections[k]), f"{page.name}: {k}")
    assert checked > 100


def _command_lines():
    for page, block in [*blocks("bash"), *blocks("")]:
        for line in block.splitlines():
            if not re.match(r"(\$ )?(\.venv/bin/)?mlxtune |\.?\.?/?\.venv|python|pip", line):
                continue  # a line of output, or of a layout, not a command
            line = line.split(" #", 1)[0].strip().lstrip("$ ").strip()
            for part in line.split("&&"):
                try:
                    words = shlex.split(part.strip())
                except ValueError:  # a quote that a line of a longer command leaves open
                    words = part.split()
                for i, w in enumerate(words):
                    if w.endswith("mlxtune") and i + 1 < len(words) and "/" not in w[:-7]:
                        yield page, words[i + 1 :]
                    elif w.endswith("/mlxtune") and i + 1 < len(words):
                        yield page, words[i + 1 :]


def test_every_documented_command_is_one_mlxtune_has_and_shipped_recipes_load():
    names = set(cli.commands)
    seen = loaded = 0
    for page, args in _command_lines():
        if not args or args[0].startswith("-") or args[0].isupper():
            continue
        assert args[0] in names, f"{page.name}: mlxtune {args[0]}: no such command"
        seen += 1
        if args[0] in ("run", "validate") and args[1:2] and args[1].startswith("recipes/"):
            overrides = [a for a in args[2:] if "=" in a and not a.startswith("-")]
            R.load_recipe(REPO / args[1], overrides)
            loaded += 1
    assert seen >= 10 and loaded >= 3
