"""A vision-language run's exports, as mlx-vlm reads them.

- ``mlx-vlm``: the adapters, loaded by ``mlx_vlm.load(base, adapter_path=...)``:
  adapters.safetensors (each adapted layer's ``lora_a`` [in, r] and ``lora_b`` [r, out], DoRA's
  magnitude ``m``, under the layer's path in mlx-vlm's model) and adapter_config.json
  (``fine_tune_type``, ``lora_parameters``: rank, absolute scale, dropout, and the adapted
  layers' paths as ``keys``).
- ``fused``: the whole model with its adapters merged in (or fully trained), as a model folder
  ``mlx_vlm.load(folder)`` reads: config.json, model.safetensors in mlx-vlm's names, the
  tokenizer and the image processor's preprocessor_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
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


def write_vision_fused(t: TrainedModel, out: Path, dtype: str | None = None) -> None:
    model = fuse(t.model)
    if dtype is not None:
        cast_floats(model, dtype)
    weights = {k.removeprefix(PREFIX): v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(t.model_config, indent=2))
    t.tokenizer._tokenizer.save_pretrained(str(out))
    source = Path(t.base_dir) / "preprocessor_config.json"
    (out / "preprocessor_config.json").write_bytes(source.read_bytes())
