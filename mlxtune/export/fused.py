"""The ``fused`` format: the base with the adapters merged in, Hugging Face layout (de-quantized,
or MLX-quantized on request)."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import UserInputError
from ..models import (
    cast_floats,
    hf_architecture,
    is_quantized,
    quantize_model,
    reward_head,
    reward_head_aside,
    shadow,
)
from ..models.building import hf_payload, write_hf
from ..models.common import DTYPES
from ..models.quantize import dequantized_by_rows
from .weights import TrainedModel, adapter_modules, release


def fuse(model: nn.Module) -> nn.Module:
    """Merge every LoRA/DoRA layer into a plain Linear, in place; returns the model."""
    fused = [(n, m.fused()) for n, m in adapter_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


def dequantize(
    model: nn.Module, config: dict, dtype: str | None = None, keep: tuple[int, int] | None = None
) -> tuple[nn.Module, dict]:
    """Every quantized layer back to a dense one (lazily; in ``dtype`` where given), and the
    config without quantization. A weight of more than ``WHOLE_ELEMENTS`` (an LM head) that
    ``dtype`` narrows is de-quantized and cast a block of rows at a time
    (``dequantized_by_rows``). ``keep`` (bits, group size): affine layers quantized so stay as
    they are, codes and all (an export quantized the same way: nothing to compute, nothing
    lost)."""
    from mlx_lm.utils import dequantize_model

    if not any(is_quantized(m) for _, m in model.named_modules()):
        return model, config
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    kept = {
        name: m
        for name, m in model.named_modules()
        if keep is not None
        and is_quantized(m)
        and (m.bits, m.group_size) == keep
        and getattr(m, "mode", "affine") == "affine"
    }
    target = DTYPES.get(dtype) if dtype is not None else None
    by_rows = {
        name: w
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and name not in kept
        # joined blocks hold the weight twice in the narrower dtype: a gain only where that is
        # narrower than the de-quantized weight's (bf16 from fp32 scales: 2 GB for an 8B head
        # where the whole de-quantization held 4 GB)
        and target is not None
        and target.size < m.scales.dtype.size
        and (w := dequantized_by_rows(m, target)) is not None
    }
    model = dequantize_model(model)  # the rest de-quantized whole, as mlx-lm does
    layers = dict(model.named_modules())
    for name, w in by_rows.items():
        layers[name].weight = w
    if kept:
        model.update_modules(tree_unflatten(list(kept.items())))
    return model, config


def write_fused(
    t: TrainedModel,
    out: Path,
    dtype: str | None = None,
    quantize: int | None = None,
    group_size: int = 64,
    consume: bool = False,
):
    """The model with its adapters merged in; de-quantized when the base was quantized, and
    quantized again (``quantize`` bits, affine, per group of ``group_size``) when asked (a
    base layer quantized that way already keeps its codes). Returns a note when the weights
    could not be written in the published layout.

    The merge works on a ``shadow`` of the trained model, lazily: a weight is de-quantized and
    merged as it is written, and goes once written, so the export holds the trained model and
    one weight, never the whole model in full precision. ``consume``: the trained model is
    the export's alone, and its weights go as they are written (over a lazily read base, the
    export then holds one weight and what it is computed from)."""
    weights, config, published = _fused_payload(t, dtype, quantize, group_size)
    if consume:
        release(t.model)
    write_hf(weights, config, out, t.tokenizer, t.tokenizer_dir)
    if published or quantize is not None:  # MLX's quantized layout is mlx-lm's alone anyway
        return None
    return (
        f"{config.get('model_type')}: the fused weights keep mlx-lm's layout (stacked experts, "
        "MLX conv weights), which mlx-lm loads; no rewrite into the published layout reads "
        "back through this family's sanitize, so transformers may not read them"
    )


def _fused_payload(t: TrainedModel, dtype, quantize, group_size):
    """(weights, config, published) of the fused model, lazy; the shadow it is built on goes
    when this returns."""
    keep = (quantize, group_size) if quantize is not None else None
    model, config = dequantize(fuse(shadow(t.model)), t.model_config, dtype, keep)
    if dtype is not None:
        cast_floats(model, dtype)
    if quantize is not None:
        try:  # the same quantization as QLoRA's (layers whose size does not fit stay dense)
            with reward_head_aside(model):  # a reward model's score head stays dense
                quantize_model(model, quantize, group_size, evaluate=False)
        except UserInputError as e:
            raise UserInputError(e.message, "--quantize") from None
        config = {**config, "quantization": {"group_size": group_size, "bits": quantize}}
        dtype = None
    if reward_head(model) is not None:  # Hugging Face's sequence classifier, one label
        arch = hf_architecture(config.get("model_type", ""), config) or "ForCausalLM"
        config = {
            **config,
            "architectures": [arch.replace("ForCausalLM", "ForSequenceClassification")],
            "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0},
            # the classifier reads the last token that is not padding: the score is the EOS's,
            # so EOS must not count as padding
            "pad_token_id": (
                None
                if config.get("pad_token_id") == config.get("eos_token_id")
                else config.get("pad_token_id")
            ),
        }
    return hf_payload(model, config, dtype)
