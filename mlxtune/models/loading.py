"""Loading a model: a directory in Hugging Face layout (local or from the Hub) through mlx-lm,
after checking its layout and what it asks to run, or a GGUF file (``models.gguf.load.load_gguf``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import UserInputError
from ..gguf.file import is_gguf
from ..safety import code_files, pickled_hint
from .common import cast_floats, family_classes
from .configs import normalise_config
from .gguf.load import load_gguf
from .quantize import cpu_dequantizing, materialize


def resolve_model_path(path: str, base: Path | None) -> Path:
    """A local directory or GGUF file, or a Hub id downloaded (safetensors only) when the
    network allows."""
    if path.startswith("package:"):
        return package_file(path)
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None and (base / p).exists():
        p = base / p
    if p.exists():
        if is_gguf(p):
            return p
        if not p.is_dir():
            raise UserInputError(
                "a model is a directory (config.json + *.safetensors) or a GGUF file"
                + ("" if p.suffix != ".gguf" else " (this one does not start with GGUF's magic)"),
                str(p),
            )
        _check_layout(p)
        return p
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) is None:
        raise UserInputError("model directory not found", str(p))
    try:
        # huggingface_hub is imported only when a model comes from the Hub
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            path,
            allow_patterns=[
                "*.json",
                "model*.safetensors",
                "*.tiktoken",
                "tokenizer.model",
                "*.jinja",
                "*.txt",
            ],
        )
    except Exception as e:
        raise UserInputError(
            f"not a local directory, and fetching it from the Hugging Face Hub failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})",
            path,
        ) from None
    _check_layout(Path(local))
    return Path(local)


def package_file(spec: str) -> Path:
    """``package:NAME/FILE``: a file inside an installed Python package (a model shipped in a
    wheel), found without importing the package."""
    import importlib.util

    rest = spec.removeprefix("package:")
    name, _, inner = rest.partition("/")
    if not name or not inner:
        raise UserInputError("write package:NAME/FILE (a file inside a Python package)", spec)
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise UserInputError(
            f"the Python package {name!r} is not installed here (pip install it first)", spec
        )
    for root in found.submodule_search_locations:
        p = (Path(root) / inner).resolve()
        if not p.is_relative_to(Path(root).resolve()):
            raise UserInputError("the file must be inside the package", spec)
        if p.exists():
            if is_gguf(p):
                return p
            if p.is_dir():
                _check_layout(p)
                return p
            raise UserInputError("not a GGUF file or a model directory", str(p))
    raise UserInputError(f"no {inner} in the package {name!r}", spec)


def _check_layout(p: Path) -> dict:
    """config.json and safetensors weights, or a UserInputError: the config."""
    if not (p / "config.json").exists():
        raise UserInputError("no config.json in the model directory", str(p))
    try:
        config = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(
            f"config.json is not valid JSON: {e}", str(p / "config.json")
        ) from None
    if not isinstance(config, dict):
        raise UserInputError("config.json is not a JSON object", str(p / "config.json"))
    if not list(p.glob("model*.safetensors")):
        raise UserInputError(
            f"no model*.safetensors weights in the model directory{pickled_hint(p)}", str(p)
        )
    return config


# model_type -> the prefix transformers' class saves its base model's weights under, which the
# family's mlx-lm sanitize does not take off (GPT-2 saved by transformers: "transformer.h.0.")
_BASE_PREFIXES = {"gpt2": "transformer."}


def _classes_reading_base_prefix(config: dict):
    """mlx-lm's (model class, args class) for ``config``; for a family in ``_BASE_PREFIXES``
    the model is built with a sanitize that takes the prefix off first, for this load only
    (the model's own sanitize is back once it is built: ``_own_sanitize``)."""
    model_class, args_class = family_classes(config)
    prefix = _BASE_PREFIXES.get(config.get("model_type"))
    if prefix is None:
        return model_class, args_class

    def build(args):
        model = model_class(args)

        def sanitize(weights):
            bare = {k.removeprefix(prefix): v for k, v in weights.items()}
            return model_class.sanitize(model, bare)

        object.__setattr__(model, "sanitize", sanitize)
        return model

    return build, args_class


def _own_sanitize(model) -> None:
    model.__dict__.pop("sanitize", None)


def check_model_dir(p: Path, trust_remote_code: bool = False):
    config = _check_layout(p)
    code = code_files(p, config)
    if code and not trust_remote_code:
        raise UserInputError(
            f"this model asks to run its own Python code ({', '.join(code)}), which runs only "
            "when the recipe sets model.trust_remote_code: true",
            str(p / "config.json"),
        )
    return config


def load_model(
    path: str | Path,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    keep_quantized: bool = False,
    lazy: bool = False,
):
    """Load a model directory (Hugging Face layout) with mlx-lm's loader, or a GGUF file:
    (model, config). ``keep_quantized``: a GGUF file's Q8_0/Q4_0/Q4_1 weights stay quantized
    (a QLoRA base) instead of being de-quantized to ``dtype``.

    A directory's weights are read lazily, shard by shard, and cast to ``dtype`` one layer at a
    time, so loading holds the model as it will be held plus one layer. ``lazy``: nothing is
    read yet (the caller computes the weights, as QLoRA's quantization does one layer at a
    time, so that a dense base is never held whole)."""
    # mlx_lm.utils pulls in transformers: imported when a model loads, not with mlxtune
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = Path(path)
    if is_gguf(path):
        model, config, _ = load_gguf(path, dtype, keep_quantized)
        return model, config
    config = check_model_dir(path, trust_remote_code)
    changes = {}
    if (
        config.get("model_file") is None
    ):  # mlx-lm's own module: its keys, as transformers reads them
        normalised = normalise_config(
            config, family_classes(config, str(path / "config.json"))[1], str(path / "config.json")
        )
        changes = {k: v for k, v in normalised.items() if k not in config or config[k] != v}
    try:
        model, config = mlx_lm_load_model(
            path,
            lazy=True,
            trust_remote_code=trust_remote_code,
            model_config=changes,
            get_model_classes=_classes_reading_base_prefix,
        )
    except ValueError as e:  # missing or misshapen weights
        raise UserInputError(" ".join(str(e).split()), str(path)) from None
    except TypeError as e:  # the family's ModelArgs lacks a key it requires
        if "required" not in str(e):
            raise
        missing = str(e).split("argument", 1)[-1].strip(" s:")
        raise UserInputError(
            f"lacks {missing}, which this family's mlx-lm module requires",
            str(path / "config.json"),
        ) from None
    except RuntimeError as e:  # MLX's reader: a truncated or corrupt safetensors file
        if "safetensors" not in str(e):
            raise
        raise UserInputError(f"cannot read the weights: {e}", str(path)) from None
    _own_sanitize(model)
    cast_floats(model, dtype)
    if not lazy:
        try:
            materialize(model)
        except RuntimeError as e:  # MLX's reader, now reading: a truncated or corrupt file
            if "safetensors" not in str(e) and "read" not in str(e):
                raise
            raise UserInputError(f"cannot read the weights: {e}", str(path)) from None
    cpu_dequantizing(model)  # a quantized checkpoint's layers, at BLAS speed on the CPU
    return model, config
