"""Building a model from an architecture config, and saving one in Hugging Face layout."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import _malloc
from ..errors import UserInputError
from ..tokenizer import save_tokenizer
from .common import DTYPES, cast_floats, family_classes, hf_architecture
from .configs import normalise_config
from .layout import hf_weights

# Architecture sizes that must be positive integers when a recipe gives them.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def build_model(
    arch: dict,
    vocab_size: int,
    dtype: str = "float32",
    seed: int = 0,
    special_ids: dict | None = None,
):
    """A freshly initialised model from an architecture config: (model, config)."""
    config = dict(arch)
    config.setdefault("vocab_size", vocab_size)
    for key in _SIZES:
        v = config.get(key)
        if key in config and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise UserInputError(f"must be a positive integer, got {v!r}", f"model.arch.{key}")
    if "head_dim" not in config and config.get("hidden_size", 0) % config.get(
        "num_attention_heads", 1
    ):
        raise UserInputError(
            f"hidden_size {config['hidden_size']} is not a multiple of num_attention_heads "
            f"{config['num_attention_heads']} (or give head_dim)",
            "model.arch",
        )
    if config["vocab_size"] < vocab_size:
        raise UserInputError(
            f"vocab_size {config['vocab_size']} is smaller than the tokenizer's {vocab_size}",
            "model.arch.vocab_size",
        )
    config.setdefault("architectures", [hf_architecture(config["model_type"], config)])
    config.setdefault("tie_word_embeddings", True)
    for k, v in (special_ids or {}).items():
        if v is not None:
            config.setdefault(k, v)
    model_class, args_class = family_classes(config, "model.arch.model_type")
    config = normalise_config(config, args_class, "model.arch")
    try:
        args = args_class.from_dict(config)
        mx.random.seed(seed)
        model = model_class(args)
    except Exception as e:  # the architecture is user input: any failure to build it is bad input
        raise UserInputError(
            f"cannot build this architecture: {type(e).__name__}: {e}", "model.arch"
        ) from None
    init_weights(model, seed)
    cast_floats(model, dtype)
    mx.eval(model.parameters())
    return model, config


def init_weights(model: nn.Module, seed: int, std: float = 0.02):
    """GPT-style init: normal(0, 0.02) for matrices and embeddings, norms as built.

    mlx's default uniform init leaves the tied embedding with unit-scale rows, which makes the
    first logits huge; a small normal init starts training from near-uniform predictions.
    """
    key = mx.random.key(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            key, sub = mx.random.split(key)
            new.append((name, (mx.random.normal(p.shape, key=sub) * std).astype(p.dtype)))
    model.load_weights(new, strict=False)


_SCALARS = ("str", "int", "float", "bool")


def _of_declared_type(field: dataclasses.Field, value) -> bool:
    """False where the field declares a plain scalar (str, int, float, bool) and ``value`` is
    a container: a default written with a stray comma (mlx-lm's dots1 ``scoring_func``,
    ``("noaux_tc",)``), which no reader of the saved config takes for the setting."""
    declared = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    return not (declared in _SCALARS and isinstance(value, (tuple, list, dict)))


def _settings_left_to_defaults(model: nn.Module, config: dict) -> dict:
    """The settings mlx-lm built ``model`` with that ``config`` leaves out (its defaults, and
    what it derives, such as a layer layout from a pattern key), so that the saved config
    describes the model that ran to any reader: transformers' defaults are not always
    mlx-lm's (Gemma 4's double-wide MLP), and transformers 5 builds its own layout when
    ``layer_types`` is missing. A default not of its field's declared type is left out."""
    args = getattr(model, "args", None)
    if not dataclasses.is_dataclass(args):
        return {}
    out = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name, None)
        if f.name in config or value is None or f.name.startswith("_"):
            continue
        if not _of_declared_type(f, value):  # a malformed default (dots1's ("noaux_tc",))
            continue
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):  # not JSON (or infinite: not every reader takes it)
            continue
        out[f.name] = value
    return out


SHARD_BYTES = 2 * 10**9
"""The largest weights file a save writes (Hugging Face's sharded layout beyond it)."""

# safetensors' names for MLX's dtypes
_SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}


def write_weights(
    weights: dict, out: Path, metadata: dict | None = None, rows: dict | None = None
) -> list[str]:
    """``weights`` as ``model.safetensors``, or as shards of at most ``SHARD_BYTES`` with
    ``model.safetensors.index.json`` (the layout transformers and mlx-lm read) when they are
    larger; the file names. Each weight is taken out of ``weights``, computed, written and
    dropped before the next (``write_safetensors``): lazily computed weights (de-quantized,
    merged) hold memory one at a time, whatever the shard's size."""
    shards: list[list[str]] = [[]]
    size = 0
    for k, v in weights.items():
        if shards[-1] and size + v.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += v.nbytes
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    total, where = 0, {}
    for name, keys in zip(names, shards, strict=True):
        total += write_safetensors(out / name, {k: weights.pop(k) for k in keys}, metadata, rows)
        where.update(dict.fromkeys(keys, name))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": where}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def taken_blocks(v: mx.array, rows: dict | None) -> list[mx.array]:
    """The blocks of rows ``v`` joins, taken out of ``rows`` (``id(tensor)`` -> (that tensor,
    its blocks): ``export.fused.dequantize``'s), or ``[v]``. Nothing here keeps ``v``: when
    the caller holds it no longer, nothing but the list holds the blocks, and each goes once
    the caller drops it from the list."""
    entry = rows.pop(id(v), None) if rows else None
    return entry[1] if entry is not None and entry[0] is v else [v]


def _safetensors_header(tensors: dict, metadata: dict | None) -> tuple[bytes, int]:
    """(the header's bytes, padded to 8, and the data's size) from the tensors' shapes."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for k, v in tensors.items():
        header[k] = {
            "dtype": _SAFETENSORS_DTYPES[v.dtype],
            "shape": list(v.shape),
            "data_offsets": [offset, offset + v.nbytes],
        }
        offset += v.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), offset  # data 8-byte aligned, as safetensors pads it


def write_safetensors(
    path: Path, tensors: dict, metadata: dict | None = None, rows: dict | None = None
) -> int:
    """A safetensors file written a tensor at a time: the header from the (lazy) tensors'
    shapes, then each tensor taken out of ``tensors``, computed, written and dropped, so the
    file is never held whole in memory. Returns the bytes of tensor data written.

    ``rows`` maps ``id(tensor)`` to (that tensor, the blocks of rows it joins): such a tensor
    is written a block at a time, each computed and dropped before the next (an export's
    de-quantized LM head: ``export.fused.dequantize``), never held whole."""
    raw, offset = _safetensors_header(tensors, metadata)  # keeps no tensor
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for k in list(tensors):
            parts = taken_blocks(tensors.pop(k), rows)
            for i in range(len(parts)):
                p = mx.contiguous(parts[i])  # row-major bytes (no copy when already)
                parts[i] = None
                mx.eval(p)
                f.write(memoryview(p))
                del p
            mx.clear_cache()  # its buffers back to the system, not kept for the next
            _malloc.trim()  # and the heap's: the next weight's peak is its own
    return offset


def _layer_types_of_pattern(cfg: dict) -> dict:
    """``layer_types`` spelled out from a string ``sliding_window_pattern`` ("LLLG": L a
    sliding layer, G a global one, repeated), where the config has none: EXAONE 4's published
    configs hold both, and transformers 5 reads a string pattern only beside the list."""
    pattern, n = cfg.get("sliding_window_pattern"), cfg.get("num_hidden_layers")
    if "layer_types" in cfg or "sliding_window_pattern" not in cfg or not n:
        return {}
    if not isinstance(pattern, str) or not pattern or set(pattern) - {"L", "G"}:
        return {}
    return {
        "layer_types": [
            "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
            for i in range(int(n))
        ]
    }


def hf_payload(model: nn.Module, config: dict, dtype: str | None = None):
    """(weights in Hugging Face layout, config.json's contents, whether the layout is the
    published one): what ``save_model`` writes, as lazy as the model's weights are."""
    weights, published = hf_weights(model, dict(tree_flatten(model.parameters())))
    if dtype is not None:  # a weight already in it stays the same array
        weights = {
            k: v.astype(DTYPES[dtype])
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != DTYPES[dtype]
            else v
            for k, v in weights.items()
        }
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    cfg.update(_settings_left_to_defaults(model, cfg))
    cfg.update(_layer_types_of_pattern(cfg))
    cfg.setdefault("architectures", [hf_architecture(cfg.get("model_type", ""), cfg)])
    float_dtypes = {
        str(v.dtype).split(".")[-1] for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)
    }
    if len(float_dtypes) == 1:
        cfg["torch_dtype"] = float_dtypes.pop()
    return weights, cfg, published


def write_hf(
    weights: dict,
    cfg: dict,
    out_dir: str | Path,
    tokenizer=None,
    tokenizer_dir=None,
    rows: dict | None = None,
):
    """A ``hf_payload`` written: the weights (taken out of ``weights`` as written; ``rows`` as
    ``write_safetensors`` takes it), config.json and the tokenizer's files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(weights, out, {"format": "mlx"}, rows)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, tokenizer_dir)
    return out


def save_model(
    model: nn.Module,
    config: dict,
    out_dir: str | Path,
    tokenizer=None,
    tokenizer_dir=None,
    dtype: str | None = None,
):
    """Save in Hugging Face layout: config.json, the weights (``write_weights``), tokenizer
    files. Returns the folder, and whether the weights are in the published layout (False: a
    family whose experts or conv layers have no layout mlx-lm's ``sanitize`` reads back, saved
    as held)."""
    weights, cfg, published = hf_payload(model, config, dtype)
    return write_hf(weights, cfg, out_dir, tokenizer, tokenizer_dir), published
