"""The ``peft`` format: adapter_config.json (r, lora_alpha, target_modules,
base_model_name_or_path) + adapter_model.safetensors (``base_model.model.<module>.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]; DoRA magnitudes as ``lora_magnitude_vector``), as PEFT
saves."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..adapters import DoRALinear, LoRASwitchLinear
from ..errors import UserInputError
from ..models import VisionLM, reward_head
from ..models.layout import published_names, transposed_when_published
from .mlx_vlm import PREFIX, hf_path
from .weights import TrainedModel, adapter_modules


def _plain_weights(model: nn.Module) -> dict[str, mx.array]:
    """The model's weights as its base holds them: each adapter's base weight at its path."""
    wrapped = {name for name, _ in adapter_modules(model)}
    out = {}
    for k, v in tree_flatten(model.parameters()):
        module, _, leaf = k.rpartition(".")
        if module in wrapped:
            continue  # lora_a, lora_b, a DoRA magnitude
        parent, _, inner = module.rpartition(".")
        out[f"{parent}.{leaf}" if inner == "linear" and parent in wrapped else k] = v
    return out


def _module_names(model: nn.Module) -> dict[str, str]:
    """Each adapted module's path as transformers' model names it."""
    if isinstance(model, VisionLM):  # mlx-vlm's paths (under the wrapper's "vlm.") mapped
        return {n: hf_path(model, n.removeprefix(PREFIX)) for n, _ in adapter_modules(model)}
    names = published_names(model, _plain_weights(model))
    return {
        n: names.get(f"{n}.weight", f"{n}.weight")[: -len(".weight")]
        for n, _ in adapter_modules(model)
    }


def peft_weights(model: nn.Module) -> dict[str, mx.array]:
    """PEFT's tensors, under the module names of the published layout (what transformers
    builds): the same as mlx-lm's wherever a family keeps them."""
    names = _module_names(model)
    out = {}
    for name, m in adapter_modules(model):
        key = f"base_model.model.{names[name]}"
        out[f"{key}.lora_A.weight"] = mx.contiguous(m.lora_a.T)
        out[f"{key}.lora_B.weight"] = mx.contiguous(m.lora_b.T)
        if isinstance(m, DoRALinear):
            out[f"{key}.lora_magnitude_vector"] = m.m
    return out


def peft_refusal(model: nn.Module) -> str | None:
    """Why the model's adapters have no PEFT form (None when they have one)."""
    experts = [n for n, m in adapter_modules(model) if isinstance(m, LoRASwitchLinear)]
    if experts:
        return (
            f"{experts[0]} is a mixture's experts, which mlx-lm stacks in one layer and PEFT "
            "names one by one (or not at all): export mlx-lm (the adapter) or fused instead, "
            "or leave the experts out of adapter.targets"
        )
    if isinstance(model, VisionLM):
        return None
    adapted = {f"{n}.weight" for n, _ in adapter_modules(model)}
    transposed = sorted(adapted & transposed_when_published(model, _plain_weights(model)))
    if transposed:
        return (
            f"{transposed[0].removesuffix('.weight')} is held transposed in this family's "
            "published layout (a Conv1D, as GPT-2's), which mlxtune's PEFT export does not "
            "write: export mlx-lm (the adapter) or fused instead"
        )
    return None


def write_peft(t: TrainedModel, out: Path, base_name: str | None = None):
    a = t.adapter
    if a["type"] == "full":
        raise UserInputError(
            "PEFT adapters hold LoRA/DoRA weights; a full fine-tune exports as fused", "export"
        )
    why = peft_refusal(t.model)
    if why is not None:
        raise UserInputError(why, "export")
    weights = peft_weights(t.model)
    head = reward_head(t.model)
    if head is not None:  # PEFT keeps a sequence classifier's head whole (modules_to_save)
        weights["base_model.model.score.weight"] = head.weight
    mx.save_safetensors(str(out / "adapter_model.safetensors"), weights, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if head is None else "SEQ_CLS",
        "base_model_name_or_path": base_name or (str(t.base_dir) if t.base_dir else None),
        "r": a["rank"],
        "lora_alpha": a["alpha"],
        "use_rslora": a.get("rslora", False),
        "lora_dropout": a.get("dropout", 0.0),
        "target_modules": sorted(
            {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in weights if ".lora_A." in k}
        ),
        "layers_to_transform": sorted(a["layers"]),
        "use_dora": a["type"] == "dora",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    if head is not None:
        config["modules_to_save"] = ["score"]
    if isinstance(t.model, VisionLM):
        # the adapted modules by their whole paths: a vision tower has q_proj and layers too,
        # which suffixes and layer numbers would also pick
        prefix = len("base_model.model.")
        config["target_modules"] = sorted(
            {k.split(".lora_A.")[0][prefix:] for k in weights if ".lora_A." in k}
        )
        config["layers_to_transform"] = None
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
