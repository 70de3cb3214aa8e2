"""What a model directory may ask a loader to do that mlxtune refuses: run its own Python code
(unless the recipe trusts it) or unpickle weights (never)."""

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
