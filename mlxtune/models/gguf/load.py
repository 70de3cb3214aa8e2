"""Loading a GGUF file (llama.cpp's format, as Ollama, LM Studio and llama.cpp keep models) as a
trainable mlx-lm model.

- The config comes from the file's metadata, for every family mlxtune exports to GGUF (llama and
  mistral, qwen2, qwen3, gemma, gemma2, phi3), in the family's Hugging Face form, so the model is
  the same mlx-lm module a Hugging Face directory gives and everything downstream (adapters,
  kernels, exports) treats it alike.
- Tensor names are mapped back with the export's own table (``names.gguf_name``), llama's
  q/k rows are permuted back from llama.cpp's interleaved rope order to rotate-half, and gemma's
  norms lose the 1 llama.cpp's converter adds.
- Q8_0, Q4_0 and Q4_1 are affine codes in blocks of 32 with one scale (and one offset) per block,
  which is exactly what an MLX quantized array holds with ``group_size=32``: such tensors become
  ``QuantizedLinear`` / ``QuantizedEmbedding`` layers without any rounding, when the caller keeps
  them quantized (a LoRA/DoRA base). Every other type (F32, F16, BF16, the K-quants, ...) is
  de-quantized with the ``gguf`` package's reference code and held in the model's dtype.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...errors import UserInputError
from ...gguf.file import GGUFModelFile, read_gguf
from ...gguf.names import ARCHES, FAMILIES, NORM_PLUS_ONE, QKV_LAYOUT, gguf_name
from ...gguf.tensors import (
    deci_qk,
    dequantized,
    gate_up_join,
    llama4_qk_scale,
    minicpm3_scale,
    mla_join,
    norm_offset,
    plain_tensor,
    qkv_from_gguf,
    qwen3_next_join,
    qwen35_from_gguf,
    shared_kv_heads,
    ssm_from_gguf,
    unpermute_qk,
    xielu_from_gguf,
)
from ..common import DTYPES, family_classes
from ..quantize import cpu_dequantizing
from .configs import WRAPPED, gguf_config

GROUP = 32  # ggml's block size for Q8_0, Q4_0 and Q4_1

# architectures whose q/k rows llama.cpp's converter permutes to its interleaved rope order
PERMUTED = tuple({arch for arch, permuted in ARCHES.values() if permuted})
# tensor types held as MLX quantized arrays (bits) when kept quantized
NATIVE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}


# ------------------------------------------------------------------------------ config


def _name_table(model: nn.Module, model_type: str, g: GGUFModelFile) -> dict[str, str]:
    """GGUF tensor name -> parameter name, for every parameter the model has. A mixture whose
    experts the model holds one by one (DBRX) has each expert's slice of the file's stacked
    tensor put in the file under its own name ("<stacked>#<expert>")."""
    table, n_blocks = {}, len(model.layers)
    for hf, _ in tree_flatten(model.parameters()):
        parts = hf.split(".")
        expert = None
        if "experts" in parts:
            i = parts.index("experts")
            if i + 2 < len(parts) and parts[i + 1].isdigit():
                expert = int(parts[i + 1])
                parts = parts[: i + 1] + parts[i + 2 :]
        name = gguf_name(".".join(parts).removeprefix("language_model."), model_type, n_blocks)
        if name is None:
            continue
        if expert is not None:
            stacked = g.tensors.get(name)
            if stacked is not None and not isinstance(stacked, list):  # split once
                g.tensors[name] = list(dequantized(stacked))
            if isinstance(g.tensors.get(name), list):
                g.tensors[f"{name}#{expert}"] = plain_tensor(
                    f"{name}#{expert}", g.tensors[name][expert]
                )
            name = f"{name}#{expert}"
        table[name] = hf
    for name in [n for n, t in g.tensors.items() if isinstance(t, list)]:
        del g.tensors[name]
    return table


def _blocks(t, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, cols] uint8, scales, offsets [rows, cols // 32] float32) of a Q8_0, Q4_0 or
    Q4_1 tensor, so that weight = scale * code + offset in each block of 32."""
    raw = np.asarray(t.data)  # [rows, bytes per row], uint8
    rows = raw.shape[0]
    block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = raw.reshape(rows, -1, block)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = b[..., 2:].copy().view(np.int8).astype(np.int16) + 128  # int8 -> unsigned
        return q.astype(np.uint8).reshape(rows, -1), d, -128.0 * d
    if kind == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:]
    else:
        m, qs = -8.0 * d, b[..., 2:]
    # a block's 16 bytes hold elements j (low nibble) and j + 16 (high nibble)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return q.reshape(rows, -1), d, m


def mlx_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, cols] as MLX packs them: 32 // bits per uint32, the first in the low bits."""
    per = 32 // bits
    c = codes.astype(np.uint32).reshape(codes.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(c << shifts, axis=-1)


def mlx_codes(words: np.ndarray, bits: int) -> np.ndarray:
    """``mlx_words`` undone: MLX's packed uint32 words [..., n] as the codes [..., n x 32 //
    bits] (uint8)."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    codes = (words.astype(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.astype(np.uint8).reshape(*words.shape[:-1], -1)


@dataclass
class GGUFLoad:
    """What ``load_gguf`` did: tensors kept quantized (bits per name) and de-quantized (type
    per name), and the bytes the weights take as held."""

    quantized: dict[str, int]
    dequantized: dict[str, str]
    nbytes: int

    def summary(self, dtype: str) -> str:
        """One line on what loading did with the file's tensors."""
        parts = []
        if self.quantized:
            bits = _tally(self.quantized, "at {} bits")
            parts.append(f"{len(self.quantized)} weights kept quantized ({bits}, groups of 32)")
        if self.dequantized:
            kinds = _tally(self.dequantized, "{}")
            parts.append(f"{len(self.dequantized)} de-quantized to {dtype} ({kinds})")
        parts.append(f"weights {self.nbytes / 1e9:.3f} GB as held")
        return "; ".join(parts)


def _tally(values: dict, label: str) -> str:
    """'3 at 4 bits, 1 at 8 bits': how many of each value."""
    counts = Counter(values.values())
    return ", ".join(f"{n} {label.format(v)}" for v, n in sorted(counts.items()))


def _unit_axes_restored(model: nn.Module, weights: list) -> list:
    """Each weight in its parameter's shape where the two differ only by axes of size 1:
    llama.cpp's quantizer writes a [1, n] tensor (Qwen2-MoE's shared-expert gate) as [n]."""
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    out = []
    for k, v in weights:
        want = shapes.get(k)
        if want is not None and tuple(v.shape) != tuple(want) and v.size == math.prod(want):
            if [n for n in v.shape if n != 1] == [n for n in want if n != 1]:
                v = v.reshape(want)
        out.append((k, v))
    return out


def load_gguf(
    path: str | Path, dtype: str = "float32", keep_quantized: bool = False
) -> tuple[nn.Module, dict, GGUFLoad]:
    """A GGUF model file as (mlx-lm model, Hugging Face config, what was done).

    With ``keep_quantized``, Q8_0/Q4_0/Q4_1 linear and embedding weights become MLX quantized
    layers holding the file's codes, scales and offsets exactly (QLoRA over the file as it
    is); otherwise, and for every other type, weights are de-quantized to ``dtype``.
    """
    g = read_gguf(path)
    where = str(g.path)
    config = gguf_config(g)
    text_type = config["model_type"]
    if text_type in WRAPPED:  # mlx-lm builds this text model inside its wrapper only
        config = {"model_type": WRAPPED[text_type], "text_config": config}
    model_class, args_class = family_classes(config)
    try:
        model = model_class(args_class.from_dict(config))
    except Exception as e:
        raise UserInputError(
            f"cannot build the model its metadata describes: {type(e).__name__}: {e}", where
        ) from None
    if g.arch == "qwen3next":
        qwen3_next_join(g, config)
    if g.arch in ("mamba", "mamba2", "nemotron_h_moe", "granitehybrid", "falcon-h1"):
        ssm_from_gguf(g, config)
    if g.arch == "granitehybrid":
        gate_up_join(g, config["num_hidden_layers"], "ffn_gate_up_shexp")
    if g.arch == "openelm":
        gate_up_join(g, config["num_transformer_layers"], "ffn_gate_up")
    if g.arch in ("qwen35", "qwen35moe"):
        qwen35_from_gguf(g, config["text_config"])
    if config["model_type"] in ("deepseek_v2", "youtu_llm"):  # kv_b_proj held whole
        mla_join(g, config)
    if g.arch == "deci":  # the all-zero MLPs standing for no-op ones: not the model's
        for i, block in enumerate(config["block_configs"]):
            if block["ffn"].get("no_op"):
                for name in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down"):
                    g.tensors.pop(f"blk.{i}.{name}.weight", None)
    if g.arch == "apertus":
        xielu_from_gguf(g, config)
    if text_type in QKV_LAYOUT:  # the family holds q/k/v as one projection
        family = FAMILIES[text_type]
        qkv_from_gguf(g, config, QKV_LAYOUT[text_type], family.permuted)
    table = _name_table(model, text_type, g)
    _tie_left_out_head(model, table, g)
    _check_tensor_names(g, table, text_type)
    quant = _kept_quantized(g, table, model) if keep_quantized else {}
    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                {"group_size": GROUP, "bits": quant[p], "mode": "affine"} if p in quant else False
            ),
        )
    done = GGUFLoad({}, {}, 0)
    weights = _weights(g, table, config.get("text_config", config), quant, DTYPES[dtype], done)
    weights = _unit_axes_restored(model, weights)
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        raise UserInputError(f"the file's tensors do not fit its config: {e}", where) from None
    mx.eval(model.parameters())
    cpu_dequantizing(model)
    done.nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return model, config, done


def _tie_left_out_head(model: nn.Module, table: dict[str, str], g: GGUFModelFile) -> None:
    """A file without ``output.weight`` (llama.cpp's converter leaves a tied head out) for a
    model that holds a head of its own (Gemma 3's text model, which ties its head only when a
    checkpoint has none): the head is tied, as mlx-lm's ``sanitize`` ties it; a family without
    that switch reads the embedding as its head."""
    head = table.get("output.weight")
    if head is None or "output.weight" in g.tensors or "token_embd.weight" not in g.tensors:
        return
    path = head.removesuffix(".weight")
    owner_path, _, leaf = path.rpartition(".")
    owner = dict(model.named_modules()).get(owner_path, model) if owner_path else model
    if isinstance(getattr(owner, "tie_word_embeddings", None), bool) and leaf in owner:
        owner.tie_word_embeddings = True
        owner.pop(leaf)
        del table["output.weight"]
    else:
        g.tensors["output.weight"] = g.tensors["token_embd.weight"]


def _check_tensor_names(g: GGUFModelFile, table: dict[str, str], model_type: str) -> None:
    """Every tensor of the file has a place in the model, and every parameter a tensor."""

    def first(names: list[str]) -> str:
        return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")

    read_as_config = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
    unknown = sorted(set(g.tensors) - set(table) - read_as_config)
    if unknown:
        raise UserInputError(
            f"tensor {first(unknown)} has no place in a {model_type} model", str(g.path)
        )
    missing = sorted(set(table) - set(g.tensors))
    if missing:
        raise UserInputError(f"the file has no tensor {first(missing)}", str(g.path))


def _kept_quantized(g: GGUFModelFile, table: dict[str, str], model: nn.Module) -> dict[str, int]:
    """Module path -> bits, for the linear and embedding layers whose weight the file holds as
    Q8_0, Q4_0 or Q4_1."""
    modules = dict(model.named_modules())
    quant = {}
    for gname, hf in table.items():
        kind, mod = g.tensors[gname].type_name, hf.rsplit(".", 1)[0]
        if (
            kind in NATIVE_BITS
            and hf.endswith(".weight")
            and isinstance(modules.get(mod), (nn.Linear, nn.Embedding))
        ):
            quant[mod] = NATIVE_BITS[kind]
    return quant


def _weights(g, table, config, quant, target, done: GGUFLoad) -> list[tuple[str, mx.array]]:
    """(parameter name, array) for every tensor: the codes, scales and offsets of a kept
    quantized weight, every other tensor de-quantized to ``target``; q/k rows back in
    rotate-half order and gemma norms without llama.cpp's 1. Records each in ``done``."""
    heads = {"attn_q.weight": config.get("num_attention_heads")}
    heads["attn_k.weight"] = config.get("num_key_value_heads")
    heads["attn_q.bias"], heads["attn_k.bias"] = heads["attn_q.weight"], heads["attn_k.weight"]
    deci = []  # Nemotron-NAS: (heads, kv heads, -) per layer, its q/k rows permuted per layer
    for block in config.get("block_configs", []) if g.arch == "deci" else []:
        attn, n = block["attention"], config["num_attention_heads"]
        kv = n // attn["n_heads_in_group"] if "n_heads_in_group" in attn else 0
        deci.append((0 if attn.get("no_op") else n, kv, 0))
    weights = []
    for gname, hf in table.items():
        t = g.tensors[gname]
        kind, mod = t.type_name, hf.rsplit(".", 1)[0]
        h = heads.get(gname.split(".", 2)[-1]) if g.arch in PERMUTED else None
        if mod in quant and hf.endswith(".weight"):
            codes, scales, offsets = _blocks(t, kind)
            if h is not None:
                codes, scales, offsets = (unpermute_qk(a, h) for a in (codes, scales, offsets))
            if deci:
                codes, scales, offsets = (
                    deci_qk(a, gname, deci, back=True) for a in (codes, scales, offsets)
                )
            weights += [
                (hf, mx.array(mlx_words(codes, quant[mod]))),
                (f"{mod}.scales", mx.array(scales).astype(target)),
                (f"{mod}.biases", mx.array(offsets).astype(target)),
            ]
            done.quantized[gname] = quant[mod]
            continue
        a = dequantized(t)
        if h is not None:
            a = unpermute_qk(a, h)
        if config["model_type"] in NORM_PLUS_ONE and gname.endswith("norm.weight"):
            a = a - 1.0
        a = a - norm_offset(g.arch, gname)
        if g.arch == "minicpm3":  # its scales and latent norms' epsilon, unfolded
            a = a / minicpm3_scale(gname, SimpleNamespace(**config), a.shape[0])
        if g.arch == "deci":
            a = deci_qk(a, gname, deci, back=True)
        if g.arch == "llama4":
            a = a / llama4_qk_scale(gname, SimpleNamespace(**config))
        if g.arch == "plamo":
            n_head = config["num_attention_heads"]
            a = shared_kv_heads(a, gname, n_head, n_head // config["n_shared_head"], back=True)
        if gname.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):  # -> MLX [C, K, 1]
            a = a[..., None]
        if gname.endswith(("ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")):
            a = a.swapaxes(1, 2)  # Kimi Linear's [C, 1, K] -> MLX [C, K, 1]
        if g.arch == "kimi-linear" and gname.endswith(".ssm_a"):
            a = np.log(-a)
        weights.append((hf, mx.array(a).astype(target)))
        if kind != "F32":
            done.dequantized[gname] = kind
    return weights
