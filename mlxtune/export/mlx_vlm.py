"""A vision-language run's exports, as mlx-vlm reads them.

- ``mlx-vlm``: the adapters, loaded by ``mlx_vlm.load(base, adapter_path=...)``:
  adapters.safetensors (each adapted layer's ``lora_a`` [in, r] and ``lora_b`` [r, out], DoRA's
  magnitude ``m``, under the layer's path in mlx-vlm's model) and adapter_config.json
  (``fine_tune_type``, ``lora_parameters``: rank, absolute scale, dropout, and the adapted
  layers' paths as ``keys``).
- ``fused``: the whole model with its adapters merged in (or fully trained), as a model folder
  that both transformers and ``mlx_vlm.load(folder)`` read: config.json, model.safetensors in
  transformers' names and layout (``hf_vision_weights``), the tokenizer and the image
  processor's preprocessor_config.json. A quantized model keeps mlx-vlm's names (transformers
  reads no MLX quantization).
- ``peft``: the adapters under transformers' module names (``VisionFamily.hf_modules``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..adapters import LoRALinear
from ..errors import UserInputError
from ..models import VisionLM, cast_floats
from .fused import fuse
from .mlx_lm import mlx_lm_config
from .weights import TrainedModel

PREFIX = "vlm."
"""Where a VisionLM holds mlx-vlm's model: its paths there, less this, are mlx-vlm's."""


def write_mlx_vlm(t: TrainedModel, out: Path) -> None:
    if not isinstance(t.model, VisionLM):
        raise UserInputError(
            "mlx-vlm adapters are for vision-language models; this run's exports as mlx-lm",
            "export",
        )
    a = t.adapter
    if a["type"] == "full":
        raise UserInputError(
            "mlx-vlm adapters hold LoRA/DoRA weights; this run trained every weight", "export"
        )
    weights = {k.removeprefix(PREFIX): v for k, v in tree_flatten(t.model.trainable_parameters())}
    config = mlx_lm_config(t)  # mlx-lm's adapter config, the layers named by their full paths
    config["lora_parameters"]["keys"] = sorted(
        n.removeprefix(PREFIX) for n, m in t.model.named_modules() if isinstance(m, LoRALinear)
    )
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def hf_path(model: VisionLM, path: str, table=None) -> str:
    """mlx-vlm's path ``path`` (weight or module) as transformers names it (``table``: the
    family's ``hf_modules`` unless given)."""
    for ours, theirs in model.family.hf_modules if table is None else table:
        if path.startswith(ours):
            return theirs + path[len(ours) :]
    return path


def _read_back(model: VisionLM, weights: dict) -> dict:
    """``weights`` as mlx-vlm's loader turns them into its model's (the model's, its tower's
    and its language model's ``sanitize``, in the loader's order)."""
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(dict(model.vlm.config.__dict__, model_type=model.family.name))
    vlm, out = model.vlm, {k: mx.array(v) for k, v in weights.items()}
    if hasattr(vlm, "sanitize"):
        out = vlm.sanitize(out)
    for part in ("VisionModel", "LanguageModel"):
        cls = getattr(module, part, None)
        held = next((m for _, m in vlm.named_modules() if cls and isinstance(m, cls)), None)
        if held is not None and hasattr(held, "sanitize"):
            out = held.sanitize(out)
    return out


def hf_vision_weights(model: VisionLM, weights: dict) -> dict | None:
    """``weights`` (mlx-vlm's names) in a layout transformers reads (its module names, or an
    older layout it converts) that mlx-vlm's loader reads back as they are held: conv weights
    as torch holds them ([out, in, *kernel]). None when no such layout reads back."""
    convs = {
        f"{path}.weight"
        for path, m in model.vlm.named_modules()
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    }
    family = model.family
    for table in (family.hf_modules, family.hf_legacy, ()):
        if table is None:
            continue
        layout = {
            hf_path(model, k, table): mx.moveaxis(v, -1, 1) if k in convs else v
            for k, v in weights.items()
        }
        try:
            back = _read_back(model, layout)
        except (KeyError, ValueError, IndexError, TypeError, AttributeError):
            continue
        if back.keys() == weights.keys() and all(
            back[k].shape == v.shape and mx.array_equal(back[k], v).item()
            for k, v in weights.items()
        ):
            return layout
    return None


def write_vision_fused(t: TrainedModel, out: Path, dtype: str | None = None) -> None:
    model = fuse(t.model)
    if dtype is not None:
        cast_floats(model, dtype)
    weights = {k.removeprefix(PREFIX): v for k, v in tree_flatten(model.parameters())}
    if not any(k.endswith(".scales") for k in weights):
        weights = hf_vision_weights(model, weights) or weights
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(t.model_config, indent=2))
    t.tokenizer._tokenizer.save_pretrained(str(out))
    source = Path(t.base_dir) / "preprocessor_config.json"
    (out / "preprocessor_config.json").write_bytes(source.read_bytes())
