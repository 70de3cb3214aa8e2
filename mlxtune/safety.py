"""What mlxtune refuses: a model directory's own Python code (unless the recipe trusts it),
pickled weights (never), and a run's name or folder that would lead out of where runs go."""

from __future__ import annotations

from pathlib import Path

# Weights in these files are pickles, which run code as they load: they are never read.
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def pickled_hint(p: Path) -> str:
    """' (pickled .bin weights are never loaded: ...)' when ``p`` holds pickled weights."""
    kinds = sorted({f.suffix for f in p.iterdir() if f.suffix in PICKLED}) if p.is_dir() else []
    if not kinds:
        return ""
    return f" (pickled {'/'.join(kinds)} weights are never loaded: convert them to safetensors)"


def code_files(p: Path, config: dict) -> list[str]:
    """The Python code a model directory's config.json asks a loader to run: mlx-lm's
    ``model_file``, and transformers' ``auto_map`` classes whose module is in the directory
    (or in another Hub repository, ``repo--module.Class``)."""
    found = []
    if config.get("model_file") is not None:
        found.append(str(config["model_file"]))
    refs = config.get("auto_map") or {}
    for ref in refs.values() if isinstance(refs, dict) else []:
        for r in ref if isinstance(ref, list) else [ref]:
            if not isinstance(r, str):
                continue
            module = r.rsplit(".", 1)[0]
            if "--" in r or (p / f"{module}.py").exists():
                found.append(f"{module}.py")
    return sorted(set(found))


# A run's name and a recipe's run_dir: what keeps a recipe from writing outside its folder
NOT_PLAIN = (
    "is not a plain name: the name becomes the folder runs/NAME-TIMESTAMP (set run_dir, or give "
    "--run-dir, to choose the folder)"
)
NOT_UNDER_HERE = (
    "is not a folder under the current directory (a relative path without '..'); give --run-dir "
    "to write somewhere else"
)


def is_plain_name(name: str) -> bool:
    """A run's name becomes a folder name (runs/NAME-TIMESTAMP): it may not be a path."""
    return not ("/" in name or "\\" in name or "\0" in name or name.strip() in (".", ".."))


def is_under_here(path: str) -> bool:
    """A recipe's run_dir: relative, without '..' (a recipe file cannot send a run elsewhere)."""
    p = Path(path)
    return not (p.is_absolute() or ".." in p.parts)
