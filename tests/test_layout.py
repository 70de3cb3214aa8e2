"""docs/layout.md is written from the code: each module's line is the first sentence of its
docstring, each package's its ``__init__``'s. The test fails when the page is stale; write it
again with ``python tests/test_layout.py``."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "layout.md"
WIDTH = 100
NAME_COLUMN = 26

# the Python folders, in the order the page shows them (each __init__ says what it installs as)
PACKAGES = ["mlxtune", "metal_kernels", "tui", "recipes"]
# the rest of the repository's top level, which has no docstring to read
OTHERS = {
    "tests/": "pytest: tests mirror the library's modules and build tiny models of their own "
    "(conftest.py, vision_models.py).",
    "bench/": "Benchmarks against mlx-lm's trainer, mlx-lm-lora and mlx-vlm, each peer timed in "
    "the same run (harness.py: running a peer in a child process and what its figures share; "
    "lora_runs.py: the models, data and both trainers' LoRA runs the SFT comparisons share); "
    "bench/device/: checks for a GPU "
    "machine; RESULTS.md: every figure with its command.",
    "docs/": "The reference, one page a topic; recipe.md and this page are written from the code.",
    ".ci/": "run: CI on a clean clone (wheel: the wheel alone in a fresh environment trains the "
    "quickstart; then the README's test command).",
    "pyproject.toml": "The package: metadata, dependencies, package data; setup.py finds the "
    "packages (mlxtune/'s, and the three folders installed inside it).",
    "CHANGELOG.md": "What each version changed.",
}


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def _line(name: str, depth: int, text: str) -> list[str]:
    head = "  " * depth + name
    lines = textwrap.wrap(text, WIDTH - NAME_COLUMN, break_on_hyphens=False) or [""]
    if len(head) >= NAME_COLUMN:
        first = [head]
    else:
        first = [head.ljust(NAME_COLUMN) + lines.pop(0)]
    return first + [" " * NAME_COLUMN + rest for rest in lines]


def _folder(folder: Path, depth: int, modules_too: bool = True) -> list[str]:
    out = []
    init = folder / "__init__.py"
    out += _line(f"{folder.name}/", depth, first_sentence(init) if init.exists() else "")
    if not modules_too:
        return out
    for f in sorted(folder.glob("*.py")):
        if f.name != "__init__.py":
            out += _line(f.name, depth + 1, first_sentence(f))
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").exists()):
        out += _folder(sub, depth + 1)
    return out


def layout_page() -> str:
    lines = []
    for folder in PACKAGES:
        lines += _folder(REPO / folder, 0, modules_too=folder != "recipes")
    for name, text in OTHERS.items():
        lines += _line(name, 0, text)
    return (
        "# Layout\n\n"
        "Where each part of mlxtune lives, one line a module: the first sentence of its "
        "docstring.\nWritten from the code by `python tests/test_layout.py`; "
        "`tests/test_layout.py` fails when\nthis page is stale.\n\n"
        "```\n" + "\n".join(line.rstrip() for line in lines) + "\n```\n"
    )


def test_the_layout_page_is_written_from_the_code():
    assert PAGE.read_text(encoding="utf-8") == layout_page(), (
        "docs/layout.md is stale: write it again with python tests/test_layout.py"
    )


def test_every_module_has_a_docstring_for_its_line():
    for folder in PACKAGES:
        for f in (REPO / folder).rglob("*.py"):
            if folder == "recipes" and f.name != "__init__.py":
                continue  # the scripts that made the recipes' data
            assert first_sentence(f), f"{f.relative_to(REPO)} has no docstring"


if __name__ == "__main__":
    PAGE.write_text(layout_page(), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}", file=sys.stderr)
