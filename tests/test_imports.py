"""Import structure: every mlxtune module imports on its own in a fresh interpreter (an import
cycle between mlxtune's modules fails there), and no function body imports an mlxtune module to
hide one, except the imports listed below with their reason."""

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# where each package's files are (pyproject.toml's package-dir)
SOURCES = {"mlxtune": REPO / "mlxtune", "mlxtune.tui": REPO / "tui"}
SOURCES["mlxtune.metal_kernels"] = REPO / "metal_kernels"

# (file, imported module) -> why the import is inside a function. None hides a cycle.
ALLOWED = {
    **{
        ("mlxtune/cli.py", m): "each command imports what it runs; nothing in mlxtune imports cli"
        for m in (
            "mlxtune.loop",
            "mlxtune.evaluate",
            "mlxtune.console",
            "mlxtune.tui.live",
            "mlxtune.runs.checkpoint",
            "mlxtune.export",
            "mlxtune.generate",
            "mlxtune.runs.generation",
            "mlxtune.runs.rundir",
            "mlxtune.tui.app",
            "mlxtune.tui.compare",
            "mlxtune.engine.memory",
        )
    },
    ("mlxtune/kernels/fused.py", "mlxtune.metal_kernels"): (
        "the kernels' CPU emulator, which tests use; it compiles C code when first run"
    ),
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, root in SOURCES.items():
        for f in sorted(root.rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join([package, *parts]), f))
    return found


def _absolute(module: str, node: ast.ImportFrom | ast.Import, alias: ast.alias) -> str:
    """The module an import statement inside ``module`` (a file's dotted name) loads."""
    if isinstance(node, ast.Import):
        return alias.name
    base = module.split(".")
    if node.level:
        base = base[: len(base) - node.level + (1 if module.endswith("__init__") else 0)]
        prefix = ".".join(base)
        name = f"{prefix}.{node.module}" if node.module else prefix
    else:
        name = node.module or ""
    # "from . import cpu" loads the submodule cpu
    return f"{name}.{alias.name}" if node.module is None else name


@pytest.mark.slow  # about 100 s on 2 cores: every module pulls in mlx and mlx-lm afresh
def test_each_module_imports_alone_in_a_fresh_interpreter():
    def load(name):
        r = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, cwd=REPO
        )
        return name, r.returncode, r.stderr.strip().splitlines()[-1:] if r.returncode else []

    names = [name for name, _ in _modules()]
    assert "mlxtune.models.loading" in names and "mlxtune.adapters" in names
    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [(n, err) for n, rc, err in pool.map(load, names) if rc]
    assert not failed


def test_no_function_imports_an_mlxtune_module_unless_listed():
    found = {}
    for name, f in _modules():
        # a package's __init__ stands for the package: relative imports resolve inside it
        dotted = f"{name}.__init__" if f.name == "__init__.py" else name
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for alias in node.names:
                        target = _absolute(dotted, node, alias)
                        if target == "mlxtune" or target.startswith("mlxtune."):
                            rel = f.relative_to(REPO).as_posix()
                            found[(rel, target)] = node.lineno
    unlisted = {k: line for k, line in found.items() if k not in ALLOWED}
    assert not unlisted, f"imports inside functions that are not listed: {unlisted}"
    stale = [k for k in ALLOWED if k not in found]
    assert not stale, f"listed imports that are gone (remove them from ALLOWED): {stale}"


def test_the_scan_sees_a_hidden_import(tmp_path):
    """The scan's resolution of relative imports, on a function that hides one."""
    node = ast.parse("def f():\n    from .models import load_model\n    from . import cpu\n")
    imports = [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)]
    assert _absolute("mlxtune.export", imports[0], imports[0].names[0]) == "mlxtune.models"
    assert _absolute("mlxtune.kernels.flash", imports[1], imports[1].names[0]) == (
        "mlxtune.kernels.cpu"
    )
