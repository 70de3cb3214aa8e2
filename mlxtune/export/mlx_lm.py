"""The ``mlx-lm`` format: adapter_config.json + adapters.safetensors (mlx-lm's names: lora_a [in,
r], lora_b [r, out], an absolute scale), loaded by ``mlx_lm.load(base, adapter_path=...)``; a
GGUF base beside it in the Hugging Face layout mlx-lm reads."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..adapters import lora_scale
from ..models import (
    is_gguf,
    is_quantized,
    load_gguf,
    reward_head,
    save_model,
    value_head,
    without_reward_head,
    without_value_head,
)
from ..models.building import write_safetensors
from ..models.heads import VALUE_HEAD
from ..qat import LEARNED
from .weights import REWARD_HEAD_FILE, VALUE_HEAD_FILE, TrainedModel


def mlx_lm_config(t: TrainedModel) -> dict:
    a = t.adapter
    n_layers = len(t.model.layers)
    if a["type"] in ("full", LEARNED):  # every weight, or the quantized layers' scales
        return {"fine_tune_type": a["type"], "num_layers": n_layers}
    keys = sorted({name.split(".", 2)[2] for name in a["adapted"]})
    return {
        "fine_tune_type": a["type"],
        "num_layers": n_layers - min(a["layers"]),
        "lora_parameters": {
            "rank": a["rank"],
            "scale": lora_scale(a["alpha"], a["rank"], a.get("rslora", False)),
            "dropout": a.get("dropout", 0.0),
            "keys": keys,
        },
        "base_model": str(t.base_dir) if t.base_dir else None,
    }


def write_reward_head(model: nn.Module, out: Path) -> None:
    """A reward model's score head as ``reward_head.safetensors`` in ``out`` (nothing for a
    language model)."""
    head = reward_head(model)
    if head is not None:
        mx.save_safetensors(str(out / REWARD_HEAD_FILE), {"score.weight": head.weight})


def write_mlx_lm(
    t: TrainedModel, out: Path, metadata: dict | None = None, weights: dict | None = None
):
    """The trained weights as mlx-lm's adapter folder (``adapters.safetensors`` and
    ``adapter_config.json``; a reward or value head beside them). ``weights``: the trainable
    weights under the unsharded model's names (a fully sharded run's, gathered lazily), then
    written a tensor at a time; by default the model's own, written at once."""
    streamed = weights is not None
    if weights is None:
        weights = dict(tree_flatten(t.model.trainable_parameters()))
    kept = without_value_head(without_reward_head(weights))
    for k in [k for k in weights if k not in kept]:  # in place: the caller's dict empties
        del weights[k]  # as it is written, holding no written tensor
    del kept
    write_reward_head(t.model, out)
    head = value_head(t.model)  # a checkpoint of a PPO run (exports set it aside first)
    if head is not None:
        mx.save_safetensors(
            str(out / VALUE_HEAD_FILE), dict(tree_flatten({VALUE_HEAD: head.parameters()}))
        )
    tags = {k: str(v) for k, v in (metadata or {}).items()}
    if streamed:
        write_safetensors(out / "adapters.safetensors", weights, tags)
    else:
        mx.save_safetensors(str(out / "adapters.safetensors"), weights, metadata=tags)
    (out / "adapter_config.json").write_text(json.dumps(mlx_lm_config(t), indent=2))
    if t.base_dir is not None and is_gguf(t.base_dir):
        write_gguf_base(t, out / "base")


def write_gguf_base(t: TrainedModel, out: Path):
    """A GGUF base as mlx-lm loads a base model (mlx-lm reads no GGUF): the weights the run
    trained over, in the family's Hugging Face layout with mlx-lm's quantization config when
    they stayed quantized (the file's codes, as held), and the tokenizer read from the file."""
    held = {str(v.dtype).split(".")[-1] for _, v in tree_flatten(t.model.parameters())}
    dtype = next((d for d in ("float32", "bfloat16", "float16") if d in held), "float32")
    keep = any(is_quantized(m) for _, m in t.model.named_modules())
    base, config, _ = load_gguf(t.base_dir, dtype, keep_quantized=keep)
    layers = {p: (m.group_size, m.bits) for p, m in base.named_modules() if is_quantized(m)}
    if layers:
        (group, bits), _ = Counter(layers.values()).most_common(1)[0]
        quant = {"group_size": group, "bits": bits, "mode": "affine"}
        for p, (g, b) in layers.items():
            if (g, b) != (group, bits):
                quant[p] = {"group_size": g, "bits": b, "mode": "affine"}
        config = {**config, "quantization": quant}
    save_model(base, config, out, t.tokenizer, t.tokenizer_dir)
