"""The ``fused`` format: the base with the adapters merged in, Hugging Face layout (de-quantized,
or MLX-quantized on request)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .. import qat
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
from ..models.quantize import dequantized_rows
from .weights import TrainedModel, adapter_modules, release


def fuse(model: nn.Module) -> nn.Module:
    """Merge every LoRA/DoRA layer into a plain Linear, in place; returns the model."""
    fused = [(n, m.fused()) for n, m in adapter_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


def dequantize(
    model: nn.Module,
    config: dict,
    dtype: str | None = None,
    keep: tuple[int, int] | None = None,
    rows: dict | None = None,
) -> tuple[nn.Module, dict]:
    """Every quantized layer back to a dense one (lazily; in ``dtype`` where given, the whole
    model then cast to it), and the config without quantization. ``keep`` (bits, group size):
    affine layers quantized so stay as they are, codes and all (an export quantized the same
    way: nothing to compute, nothing lost).

    A weight of more than ``WHOLE_ELEMENTS`` (an LM head) is de-quantized a block of rows at a
    time (``dequantized_rows``) where a writer takes the blocks one by one: ``rows`` then maps
    the id of each such weight to (the weight, its blocks), for ``write_safetensors``. Without
    ``rows``, only where ``dtype`` narrows it (the blocks joined hold the weight twice in that
    dtype, where de-quantizing it whole holds it twice in fp32)."""
    from mlx_lm.utils import dequantize_model

    if not any(is_quantized(m) for _, m in model.named_modules()):
        if dtype is not None:
            cast_floats(model, dtype)
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
        name: parts
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and name not in kept
        and (rows is not None or (target is not None and target.size < m.scales.dtype.size))
        and (parts := dequantized_rows(m, target)) is not None
    }
    model = dequantize_model(model)  # the rest de-quantized whole, as mlx-lm does
    if dtype is not None:
        cast_floats(model, dtype)  # before the blocks go in: they are in it already
    layers = dict(model.named_modules())
    for name, parts in by_rows.items():
        w = mx.concatenate(parts, axis=0)
        layers[name].weight = w
        if rows is not None:
            rows[id(w)] = (w, parts)
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
    rows: dict = {}  # the weights de-quantized by blocks of rows: written a block at a time
    weights, config, published = _fused_payload(t, dtype, quantize, group_size, rows)
    if consume:
        release(t.model)
    write_hf(weights, config, out, t.tokenizer, t.tokenizer_dir, rows)
    rows.clear()
    if published or quantize is not None:  # MLX's quantized layout is mlx-lm's alone anyway
        return None
    return (
        f"{config.get('model_type')}: the fused weights keep mlx-lm's layout (stacked experts, "
        "MLX conv weights), which mlx-lm loads; no rewrite into the published layout reads "
        "back through this family's sanitize, so transformers may not read them"
    )


def _quantize_trained(model: nn.Module, paths: list[str], spec: dict) -> None:
    """The layers at ``paths`` quantized as ``spec`` says, lazily: MLX's quantize of the merged
    weight, the codes a quantization-aware run computed with (the rest stays as it is)."""
    chosen = set(paths)
    nn.quantize(
        model,
        group_size=spec["group_size"],
        bits=spec["bits"],
        mode=spec["mode"],
        class_predicate=lambda p, m: p in chosen,
    )


def _fused_payload(t: TrainedModel, dtype, quantize, group_size, rows: dict):
    """(weights, config, published) of the fused model, lazy; the shadow it is built on goes
    when this returns. ``rows``: ``dequantize``'s."""
    keep = (quantize, group_size) if quantize is not None else None
    trained = qat.prepared(t.model) if t.qat is not None and quantize is not None else None
    model, config = dequantize(fuse(shadow(t.model)), t.model_config, dtype, keep, rows)
    if trained is not None:  # quantization-aware: the layers it trained so, with its codes
        with reward_head_aside(model):
            _quantize_trained(model, trained, t.qat)
        config = {**config, "quantization": t.qat}
        dtype = None
    elif quantize is not None:
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
