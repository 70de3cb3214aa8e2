"""What exports and imports share: a trained model as an export reads it, its trainable weights
read back from a checkpoint, and adapters (mlx-lm's or PEFT's) imported into a model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from ..adapters import LoRALinear
from ..errors import UserInputError
from ..models import (
    PICKLED,
    pickled_hint,
)

REWARD_HEAD_FILE = "reward_head.safetensors"


VALUE_HEAD_FILE = "value_head.safetensors"


@dataclass
class TrainedModel:
    """A model with its trained adapters (or weights) in place, and what it came from."""

    model: nn.Module
    tokenizer: object
    model_config: dict
    adapter: dict
    """type, rank, alpha, rslora, dropout, targets, layers (indices) and adapted (module names)."""
    base_dir: Path | None
    tokenizer_dir: Path | None
    qat: dict | None = None
    """The format a quantization-aware run trained toward (bits, group_size, mode), or None:
    its quantized exports hold those codes."""


def load_trainable_weights(model: nn.Module, weights: dict, where: str):
    """Load weights that must each match a trainable parameter in name and shape."""
    params = dict(tree_flatten(model.trainable_parameters()))
    for k, v in weights.items():
        if k not in params:
            raise UserInputError(
                f"{k!r} is not a trainable parameter of this model and adapter", where
            )
        if v.shape != params[k].shape:
            raise UserInputError(
                f"{k}: shape {tuple(v.shape)} does not match the model's {tuple(params[k].shape)}",
                where,
            )
    missing = sorted(set(params) - set(weights))
    if missing:
        raise UserInputError(
            f"no weight for {missing[0]} (and {len(missing) - 1} more)"
            if len(missing) > 1
            else f"no weight for {missing[0]}",
            where,
        )
    model.load_weights(list(weights.items()), strict=False)


def release(model: nn.Module) -> None:
    """Drop every weight ``model`` holds (each becomes an empty array of its dtype): what an
    export does once its lazy payload is built from a model that is its alone, so that each
    weight (a lazily read base's, above all) goes once the output computed from it is
    written."""
    model.update(tree_map(lambda v: mx.zeros((0,), v.dtype), model.parameters()))


# ------------------------------------------------------------------------------ formats


def adapter_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def read_trainable(folder: Path) -> dict[str, mx.array]:
    """The trainable weights a checkpoint (or mlx-lm adapter export) holds: its adapters, a
    reward model's head, and (a PPO checkpoint) the value head."""
    weights = mx.load(str(folder / "adapters.safetensors"))
    for extra in (REWARD_HEAD_FILE, VALUE_HEAD_FILE):
        if (folder / extra).exists():
            weights.update(mx.load(str(folder / extra)))
    return weights


def read_adapter(path: str | Path) -> dict[str, mx.array]:
    """An mlx-lm or PEFT adapter directory, as weights under mlxtune's (mlx-lm's) names."""
    p = Path(path)
    if p.is_file():
        why = "pickled weights are never loaded; " if p.suffix in PICKLED else ""
        raise UserInputError(
            f"{why}an adapter is a directory with adapter_config.json and adapters.safetensors "
            "(mlx-lm) or adapter_model.safetensors (PEFT)",
            str(p),
        )
    cfg_path = p / "adapter_config.json"
    if not cfg_path.exists():
        raise UserInputError(
            "no adapter_config.json: not an mlx-lm or PEFT adapter directory", str(p)
        )
    if (p / "adapters.safetensors").exists():
        return _load_weights(p / "adapters.safetensors")
    if (p / "adapter_model.safetensors").exists():
        weights = {}
        for k, v in _load_weights(p / "adapter_model.safetensors").items():
            name = k.removeprefix("base_model.model.")
            if name.endswith(".lora_A.weight"):
                weights[name.removesuffix(".lora_A.weight") + ".lora_a"] = mx.contiguous(v.T)
            elif name.endswith(".lora_B.weight"):
                weights[name.removesuffix(".lora_B.weight") + ".lora_b"] = mx.contiguous(v.T)
            elif name.endswith(".lora_magnitude_vector") or name.endswith(
                ".lora_magnitude_vector.weight"
            ):
                weights[name.split(".lora_magnitude_vector")[0] + ".m"] = v
            else:
                raise UserInputError(
                    f"unexpected tensor {k!r} in a PEFT adapter",
                    str(p / "adapter_model.safetensors"),
                )
        return weights
    raise UserInputError(
        f"no adapters.safetensors or adapter_model.safetensors{pickled_hint(p)}", str(p)
    )


def _load_weights(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except RuntimeError as e:  # MLX's reader: a truncated or corrupt file
        raise UserInputError(f"cannot read the weights: {e}", str(path)) from None


def import_adapter(model: nn.Module, path: str | Path):
    """Load an mlx-lm or PEFT adapter into a model whose adapters are already in place."""
    load_trainable_weights(model, read_adapter(path), str(path))


def adapter_settings(path: str | Path) -> dict:
    """LoRA settings (type, rank, alpha, targets, layers) from an mlx-lm or PEFT adapter_config.json."""
    p = Path(path)
    try:
        cfg = json.loads((p / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise UserInputError(
            "no adapter_config.json: not an mlx-lm or PEFT adapter directory", str(p)
        ) from None
    except json.JSONDecodeError as e:
        raise UserInputError(f"adapter_config.json is not valid JSON: {e}", str(p)) from None
    if not isinstance(cfg, dict):
        raise UserInputError("adapter_config.json is not a JSON object", str(p))
    try:
        return _settings(cfg, p)
    except (KeyError, TypeError, AttributeError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else f"a field has the wrong type ({e})"
        raise UserInputError(f"adapter_config.json: {why}", str(p)) from None


def _settings(cfg: dict, p: Path) -> dict:
    if "lora_parameters" in cfg:  # mlx-lm
        lp = cfg["lora_parameters"]
        keys = lp.get("keys")
        return {
            "type": cfg.get("fine_tune_type", "lora"),
            "rank": lp["rank"],
            "alpha": lp["scale"] * lp["rank"],  # the scale is absolute: alpha / rank
            "rslora": False,
            "targets": sorted({k.rsplit(".", 1)[-1] for k in keys}) if keys else ["all-linear"],
            "layers": cfg.get("num_layers"),
        }
    if cfg.get("peft_type") == "LORA":
        targets = cfg.get("target_modules")
        if not isinstance(targets, list):
            raise UserInputError(
                "target_modules as a regular expression is not supported; list the module names",
                str(p),
            )
        return {
            "type": "dora" if cfg.get("use_dora") else "lora",
            "rank": cfg["r"],
            "alpha": cfg["lora_alpha"],
            "rslora": bool(cfg.get("use_rslora", False)),
            "targets": targets,
            "layers": cfg.get("layers_to_transform"),
        }
    raise UserInputError(
        "adapter_config.json is neither mlx-lm's (lora_parameters) nor PEFT's (peft_type LORA)",
        str(p),
    )
