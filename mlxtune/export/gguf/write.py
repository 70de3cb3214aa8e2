"""GGUF, written natively with the ``gguf`` package (llama.cpp's own reader/writer; no llama.cpp
build and no torch needed).

- ``write_gguf_model``: the fused model in f32, f16, bf16 or q8_0, with the tokenizer's
  vocabulary, scores, token types and special tokens as llama.cpp expects them.
- ``write_gguf_adapter``: a LoRA adapter for llama.cpp's ``--lora``: general.type = adapter,
  adapter.type = lora, adapter.lora.alpha, tensors ``blk.N.<name>.weight.lora_a`` [r, in] and
  ``.lora_b`` [out, r] (numpy order).

llama-family models store q/k in Hugging Face's rotate-half layout; llama.cpp's converter
permutes their rows to the interleaved layout its rope uses, so the same permutation is applied
here (to q/k weights, and to the rows of LoRA B for q/k). Every file is read back and checked
(architecture, metadata, tensor names and shapes) before the export counts as written.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ... import _malloc
from ...adapters import DoRALinear, LoRALinear, LoRASwitchLinear
from ...errors import UserInputError
from ...gguf.file import open_gguf
from ...gguf.names import (
    DTYPES,
    FAMILIES,
    GATE_UP,
    NO_ADAPTER,
    QKV_LAYOUT,
    RUNS_OTHERWISE,
    gguf_name,
    llama_cpp_arch,
    separate_qkv,
)
from ...gguf.tensors import (
    MINICPM3_FIXED,
    deci_fillers,
    deci_layers,
    deci_qk,
    gemma4_rope_freqs,
    llama4_qk_scale,
    minicpm3_rope_factors,
    minicpm3_scale,
    mla_split,
    permute_qk,
    qkv_split,
    qwen3_next_split,
    qwen35_to_gguf,
    shared_kv_heads,
    ssm_to_gguf,
    to_gguf,
)
from ...models.building import taken_blocks
from ...models.configs import standard_config
from ..weights import release
from . import codes
from .fixed import model_args, refusal
from .hparams import add_hparams, add_rope_scaling, head_counts
from .vocab import tokenizer_fields


def _arch(config: dict) -> tuple[str, bool]:
    mt = config.get("model_type")
    if mt in RUNS_OTHERWISE:
        raise UserInputError(RUNS_OTHERWISE[mt], "export --format gguf")
    if mt not in FAMILIES:
        arch = llama_cpp_arch(str(mt))
        why = (
            f"llama.cpp has no architecture for {mt!r}"
            if arch is None
            else f"llama.cpp's {arch!r} architecture is not one mlxtune writes yet"
        )
        raise UserInputError(
            f"{why}; GGUF export writes {', '.join(FAMILIES)}", "export --format gguf"
        )
    return FAMILIES[mt].arch, FAMILIES[mt].permuted


def text_part(model, config: dict):
    """(language model, its config) of a multimodal wrapper that mlx-lm builds around one
    (Gemma 3 and 4, Qwen3.5, Mistral 3: ``language_model`` under ``text_config``); the model
    and config themselves otherwise. GGUF holds the language model; a vision tower goes to
    llama.cpp's separate projector file, which mlxtune does not write."""
    text = config.get("text_config")
    inner = getattr(model, "language_model", None)
    if isinstance(text, dict) and isinstance(inner, nn.Module):
        mt = text.get("model_type", config.get("model_type"))
        if config.get("model_type") == "llama4":  # Llama 4's text model, not mlx-lm's llama4_text
            mt = "llama4"
        return inner, {**text, "model_type": mt}
    return model, config


_QUANTIZE_ELEMENTS = 1 << 24
"""The most weights a GGUF type's quantizer is given at once (a head's rows go in blocks)."""


def _tensor_array(a: np.ndarray, dtype: str | dict):
    """(numpy data, raw dtype or None) for GGUFWriter.add_tensor, from an fp32 array; ``dtype``
    a dict: the codes a quantization-aware run trained with (``write_gguf_model``'s
    ``trained_codes``)."""
    import gguf

    if isinstance(dtype, dict):
        return codes.encode(a, dtype["spec"], dtype["dtype"])
    if dtype == "f32" or a.ndim == 1:  # norms and biases stay f32, as llama.cpp's converter does
        return a, None
    if dtype == "f16":
        return a.astype(np.float16), None
    if dtype == "bf16":
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16)
        return q, gguf.GGMLQuantizationType.BF16
    if a.shape[-1] % 32:  # q8_0 packs 32 values per block
        return a.astype(np.float16), None
    q8 = gguf.GGMLQuantizationType.Q8_0
    # a block of rows at a time: the quantizer's temporaries are each the size of what it is given
    step = max(1, _QUANTIZE_ELEMENTS // a.shape[-1]) if a.ndim == 2 else len(a)
    if len(a) <= step:
        return gguf.quants.quantize(a, q8), q8
    return np.concatenate(
        [gguf.quants.quantize(a[i : i + step], q8) for i in range(0, len(a), step)]
    ), q8


def _writer(path: Path, arch: str, name: str, dtype: str, file_type: int | None = None):
    """A GGUF writer whose tensor data goes to a temporary file beside ``path`` until the header
    is written (the writer holds one tensor, not the file)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.temp_file = tempfile.TemporaryFile(dir=path.parent)
    w.add_name(name)
    w.add_file_type(file_type or {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[dtype])
    return w


def _file(out: Path, name: str, arch: str, dtype: str, trained_codes: dict | None):
    """(path, writer) of a model's GGUF: named and typed after ``dtype``, or after the GGUF
    type of a quantization-aware run's codes."""
    kind = codes.gguf_type(trained_codes["spec"]) if trained_codes else None
    label = kind.name.lower() if kind is not None else dtype
    path = out / f"{name}-{label}.gguf"
    return path, _writer(path, arch, name, dtype, codes.FILE_TYPES.get(kind))


def _as_numpy(tensors: list, i: int, rows: dict | None) -> np.ndarray:
    """``tensors[i]``'s weight in fp32 NumPy, taken out of the list. One that ``rows`` holds
    as blocks of rows (``export.fused.dequantize``) is filled in a block at a time, so MLX never
    holds it whole (on the CPU its whole de-quantization holds twice its fp32 size)."""
    mx.clear_cache()  # what the tensor before took goes back first
    _malloc.trim()
    parts = taken_blocks(tensors[i][1], rows)
    tensors[i] = None
    if len(parts) == 1:
        return np.array(parts[0].astype(mx.float32))
    rows_in = [b.shape[0] for b in parts]
    out = np.empty((sum(rows_in), *parts[0].shape[1:]), np.float32)
    start = 0
    for k, n in enumerate(rows_in):
        block, parts[k] = parts[k], None
        out[start : start + n] = np.array(block.astype(mx.float32))
        start += n
        del block
    return out


def held_stacked(model) -> list[tuple[str, mx.array]]:
    """The model's parameters, a mixture's experts held one by one (DBRX's) stacked into one
    array per projection as llama.cpp holds them (``...experts.w1.weight`` [experts, ...])."""
    out, groups = [], {}
    for hf, v in tree_flatten(model.parameters()):
        parts = hf.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            if i + 2 < len(parts) and parts[i + 1].isdigit():
                key = ".".join(parts[: i + 1] + parts[i + 2 :])
                if key not in groups:
                    groups[key] = []
                    out.append((key, None))
                groups[key].append((int(parts[i + 1]), v))
                continue
        out.append((hf, v))
    return [
        (k, v if v is not None else mx.stack([a for _, a in sorted(groups[k], key=lambda t: t[0])]))
        for k, v in out
    ]


def _names(model, config: dict, where: str) -> dict[str, str]:
    """Parameter name -> GGUF name, every parameter named (UserInputError otherwise)."""
    mt, layers = config["model_type"], config["num_hidden_layers"]
    out = {}
    for hf, _ in held_stacked(model):
        g = gguf_name(hf, mt, layers)
        if g is None:
            raise UserInputError(
                f"llama.cpp's {FAMILIES[mt].arch} architecture holds no tensor for {hf!r}", where
            )
        out[hf] = g
    return out


# architectures whose llama.cpp graph needs an output head even when the model ties it
NEEDS_OUTPUT = (
    "internlm2", "qwen", "apertus", "dots1", "bailingmoe2", "exaone-moe", "kimi-linear",
)  # fmt: skip


def gate_up_split(g: str, a: np.ndarray):
    """A joined gate-then-up matrix (or an adapter's B rows) as llama.cpp's two tensors, or
    None for any other tensor."""
    for joined, (gate_name, up_name) in GATE_UP.items():
        if g.endswith(f".{joined}.weight"):
            block = g[: -len(f"{joined}.weight")]
            gate, up = np.split(a, 2, axis=0)
            return [(f"{block}{gate_name}.weight", gate), (f"{block}{up_name}.weight", up)]
    return None


def qkv_pieces(g: str, a: np.ndarray, model_type: str, n_head: int, n_kv: int):
    """[(GGUF name, rows)]: a fused q/k/v projection (weight, bias or an adapter's B) as
    llama.cpp's converter writes it, three tensors; any other tensor as it is."""
    layout = QKV_LAYOUT.get(model_type)
    if layout is None or not g.endswith(("attn_qkv.weight", "attn_qkv.bias")):
        return [(g, a)]
    q, k, v = qkv_split(a, layout, n_head, n_kv)
    if not separate_qkv(FAMILIES[model_type].arch):  # one tensor, all q rows first (GPT-NeoX)
        return [(g, np.concatenate([q, k, v], axis=0))]
    pieces = zip("qkv", (q, k, v), strict=True)
    return [(g.replace("attn_qkv", f"attn_{x}"), part) for x, part in pieces]


def _family_tensor(a: np.ndarray, g: str, family, args, n_head: int, n_kv: int, deci) -> np.ndarray:
    """A parameter (fp32) in llama.cpp's convention for ``g``, the family's own rewrites
    included (head orders, folded scales, SSM parameters)."""
    a = to_gguf(a, g, family, n_head, n_kv)
    if family.arch == "plamo":
        a = shared_kv_heads(a, g, n_head, n_kv)
    if family.arch == "llama4":
        a = a * llama4_qk_scale(g, args)
    if family.arch == "deci":
        a = deci_qk(a, g, deci)
    if family.arch == "minicpm3":
        a = a * minicpm3_scale(g, args, a.shape[0])
    if family.arch in ("qwen35", "qwen35moe"):
        a = qwen35_to_gguf(a, g, args)
    if family.arch == "kimi-linear" and g.endswith(".ssm_a"):
        a = -np.exp(a)  # A as llama.cpp's converter writes it
    if family.arch in ("mamba", "mamba2", "nemotron_h_moe", "granitehybrid", "falcon-h1"):
        a = ssm_to_gguf(a, g, args, family.arch)
    return a


def _split_tensor(a: np.ndarray, g: str, family, args):
    """The tensors llama.cpp's converter splits ``g`` into ([(name, array)]), or None."""
    split = qwen3_next_split(a, g, args) if family.arch == "qwen3next" else None
    split = gate_up_split(g, a) or split  # gate rows, then up rows
    if family.arch == "deepseek2":  # a whole kv_b_proj: per-head key and value parts
        split = mla_split(a, g, args) or split
    return split


def _tied_head_scale(family, args) -> float | None:
    """The factor on the embedding that makes a tied model's head where llama.cpp's
    architecture reads one of its own (None: it reads the embedding as mlx-lm does)."""
    if family.arch == "falcon-h1":  # mlx-lm scales the tied logits at run time
        return float(args.lm_head_multiplier) / float(args.embedding_multiplier)
    if family.arch == "minicpm3":  # mlx-lm's tied logits are unscaled, llama.cpp's scaled
        return float(args.hidden_size) / MINICPM3_FIXED["dim_model_base"]
    return 1.0 if family.arch in NEEDS_OUTPUT else None


def _refuse_what_llama_cpp_reads_otherwise(model, config: dict, head_dim: int, where: str):
    """A model llama.cpp would run differently from mlx-lm is refused (``UserInputError``)."""
    scalar = getattr(model_args(model), "query_pre_attn_scalar", None)
    if config["model_type"] == "gemma2" and scalar is not None and scalar != head_dim:
        raise UserInputError(
            f"llama.cpp scales gemma2 queries by 1/sqrt(head_dim); this model's query_pre_attn_scalar "
            f"is {scalar:g}, not head_dim {head_dim}",
            where,
        )
    why = refusal(model, config)
    if why is not None:
        raise UserInputError(why, where)


_F32_KEPT = ("ffn_gate_inp.weight", "shortconv.conv.weight", "attn_sinks.weight")
"""Routers and short convolutions stay f32, as llama.cpp's converter keeps them."""


def _pieces(g0: str, held: np.ndarray, config: dict, family, args, deci, dtype: str):
    """The GGUF tensors (name, array, type) the held weight ``g0`` becomes."""
    n_head, n_kv, _ = head_counts(config)
    for g, a in qkv_pieces(g0, held, config["model_type"], n_head, n_kv):
        a = _family_tensor(a, g, family, args, n_head, n_kv, deci)
        split = _split_tensor(a, g, family, args)
        for g2, a2 in split if split is not None else [(g, a)]:
            yield g2, a2, "f32" if split is None and g2.endswith(_F32_KEPT) else dtype


def _settings(w, model, config: dict, family):
    """The model's hyperparameters and rope settings into ``w``; the rope_freqs tensor a
    family needs (or None)."""
    add_hparams(w, config, model)
    if config["model_type"] == "gemma4_text":
        return gemma4_rope_freqs(model_args(model))
    return None if family.arch == "minicpm3" else add_rope_scaling(w, config)


def write_gguf_model(
    model,
    config: dict,
    tokenizer,
    tokenizer_dir: Path | None,
    out: Path,
    dtype: str = "f16",
    name: str = "model",
    tokenizer_gguf: Path | None = None,
    consume: bool = False,
    rows: dict | None = None,
    trained_codes: dict | None = None,
):
    """The (already fused) model as one GGUF file; returns its path. ``tokenizer_gguf``: a GGUF
    file whose tokenizer fields are copied as they are (a run over a GGUF base). ``trained_codes``:
    a QAT run's ``spec``, the ``names`` of the weights it quantized and their ``dtype``: those
    go in the GGUF type holding the codes QAT computed with (``codes``), the rest in ``dtype``.

    Tensors are written one at a time through a temporary file beside the output, so the
    writer holds one tensor, not the file. ``consume``: the model is an export's own lazy copy
    (adapters merged in, de-quantized: ``models.shadow``), whose weights are dropped from it
    before writing, so that each is computed as it is written and goes after. ``rows``:
    weights held as blocks of rows (``export.fused.dequantize``), read a block at a time."""
    if dtype not in DTYPES:
        raise UserInputError(
            f"GGUF dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", "--dtype"
        )
    where = "export --format gguf"
    model, config = text_part(model, config)
    config = standard_config(config)
    arch, _ = _arch(config)
    family = FAMILIES[config["model_type"]]
    head_dim = head_counts(config)[2]
    _refuse_what_llama_cpp_reads_otherwise(model, config, head_dim, where)
    names = _names(model, config, where)
    coded = trained_codes or {"names": ()}
    path, w = _file(out, name, arch, dtype, trained_codes)
    rope_freqs = _settings(w, model, config, family)
    tokenizer_fields(w, tokenizer, tokenizer_dir, tokenizer_gguf)
    shapes, xielu, args = {}, {}, model_args(model)
    deci = deci_layers(model) if family.arch == "deci" else []
    no_op = [layer.mlp is None for layer in model.layers] if deci else []
    scale = _tied_head_scale(family, args)  # a tied head llama.cpp's graph must be given
    tied_head = scale is not None and "output.weight" not in names.values()
    tensors = held_stacked(model)
    if consume:  # the list holds the lazy weights now, and nothing else
        release(model)

    def put(g: str, a: np.ndarray, kind: str | dict = dtype) -> None:
        data, raw = _tensor_array(np.ascontiguousarray(a, dtype=np.float32), kind)
        w.add_tensor(g, data, raw_dtype=raw)
        shapes[g] = a.shape[::-1]

    for i in range(len(tensors)):
        hf = tensors[i][0]
        held = _as_numpy(tensors, i, rows)  # the list held it: computed, written, and gone
        if ".xielu." in names[hf]:  # Apertus: one value per layer, as metadata
            block, key = names[hf].split(".")[1], names[hf].rsplit(".", 1)[-1]
            xielu.setdefault(key, {})[int(block)] = float(held.reshape(-1)[0])
            continue
        for g, a, kind in _pieces(names[hf], held, config, family, args, deci, dtype):
            put(g, a, coded if hf in coded["names"] and a.ndim > 1 else kind)
        if tied_head and names[hf] == "token_embd.weight":
            put("output.weight", held * scale)
        del held  # gone before the next is computed
    if family.arch == "deci":  # no-op sublayers as llama.cpp's deci can hold them
        for g, a in deci_fillers(deci, int(args.hidden_size), no_op):
            if g not in shapes:
                put(g, a, "f32" if a.ndim == 1 else dtype)
    for key, values in xielu.items():
        getattr(w, f"add_xielu_{key}")([values[i] for i in sorted(values)])
    if family.arch == "minicpm3":  # mlx-lm rotates by the long factors whatever the length
        for kind in ("long", "short"):
            put(f"rope_factors_{kind}.weight", minicpm3_rope_factors(args), "f32")
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
        shapes["rope_freqs.weight"] = rope_freqs.shape
    _finish(w)
    verify(path, arch, shapes)
    return path


def write_gguf_adapter(model, config: dict, alpha: float, out: Path, name: str = "adapter"):
    """The LoRA adapter of a model (its LoRALinear layers) for llama.cpp's --lora; returns its path."""
    import gguf

    where = "export --format gguf-adapter"
    model, config = text_part(model, config)
    config = standard_config(config)
    arch, permute = _arch(config)
    why = refusal(model, config)
    if why is not None:
        raise UserInputError(why, where)
    n_head, n_kv, _ = head_counts(config)
    layers = config["num_hidden_layers"]
    path = out / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_name(name)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    shapes = {}
    for mod_name, m in model.named_modules():
        if isinstance(m, LoRASwitchLinear):
            raise UserInputError(
                f"{mod_name} adapts a mixture's experts, which llama.cpp's LoRA adapters do not "
                "hold; export gguf (fused) instead, or leave the experts out of adapter.targets",
                where,
            )
        if not isinstance(m, LoRALinear):
            continue
        if isinstance(m, DoRALinear):
            raise UserInputError(
                "llama.cpp's LoRA adapters cannot hold DoRA; export gguf (fused) instead", "export"
            )
        g = gguf_name(f"{mod_name}.weight", config["model_type"], layers)
        if g is None:
            raise UserInputError(f"no GGUF name for {mod_name!r}", where)
        a = np.ascontiguousarray(np.array(m.lora_a.astype(mx.float32)).T)  # [r, in]
        b = np.ascontiguousarray(np.array(m.lora_b.astype(mx.float32)).T)  # [out, r]
        if permute and g.endswith("attn_q.weight"):
            b = permute_qk(b, n_head)
        elif permute and g.endswith("attn_k.weight"):
            b = permute_qk(b, n_kv)
        tensor = g.removesuffix(".weight").split(".")[-1]
        if tensor in NO_ADAPTER.get(arch, ()):
            raise UserInputError(
                f"{mod_name} is {tensor} in llama.cpp's {arch}, which its graph multiplies "
                "without applying LoRA adapters; export gguf (fused) instead, or leave "
                f"{mod_name.rsplit('.', 1)[-1]} out of adapter.targets",
                where,
            )
        if arch == "minicpm3":  # its folded scales, on B's rows
            b = b * minicpm3_scale(g, model_args(model), b.shape[0])
        if arch == "deci":  # q/k rows in llama.cpp's rope order, per layer: B's rows too
            b = deci_qk(b, g, deci_layers(model))
        if arch == "llama4":  # q/k rows scaled for llama.cpp's q/k norm epsilon: B's rows too
            b = b * llama4_qk_scale(g, model_args(model))
        if arch == "plamo":  # q heads in llama.cpp's order: B's rows (q), A's columns (output)
            a = np.ascontiguousarray(shared_kv_heads(a, g, n_head, n_kv, lora="a"))
            b = shared_kv_heads(b, g, n_head, n_kv, lora="b")
        pairs = qkv_pieces(g, b, config["model_type"], n_head, n_kv)
        pairs = [
            (g_, permute_qk(b_, n_head if g_.endswith("attn_q.weight") else n_kv))
            if permute and g_.endswith(("attn_q.weight", "attn_k.weight")) and g_ != g
            else (g_, b_)
            for g_, b_ in pairs
        ]
        if arch == "qwen3next":  # the fused projection is two tensors there: B's rows split
            pairs = qwen3_next_split(b, g, model_args(model)) or pairs
        pairs = gate_up_split(g, b) or pairs  # B's rows: the gate's, then the up's
        if arch in ("qwen35", "qwen35moe"):  # V heads tiled in B's rows (ssm_out: A's columns)
            a = np.ascontiguousarray(qwen35_to_gguf(a, g, model_args(model), "a"))
            pairs = [(g, qwen35_to_gguf(b, g, model_args(model), "b"))]
        for name_, b_ in pairs:
            b_ = np.ascontiguousarray(b_)
            w.add_tensor(f"{name_}.lora_a", a)
            w.add_tensor(f"{name_}.lora_b", b_)
            shapes[f"{name_}.lora_a"], shapes[f"{name_}.lora_b"] = a.shape[::-1], b_.shape[::-1]
    _finish(w)
    verify(path, arch, shapes, adapter=True)
    return path


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def verify(path: Path, arch: str, shapes: dict, adapter: bool = False):
    """Read a GGUF back and check its header, metadata and tensor shapes (GGUF lists dims
    innermost first)."""
    import gguf

    try:
        r = open_gguf(path)
    except UserInputError as e:
        raise UserInputError(f"the GGUF just written does not read back: {e}", str(path)) from None
    field = r.fields.get
    problems = []
    if field("general.architecture") != arch:
        problems.append(f"general.architecture is {field('general.architecture')!r}, not {arch!r}")
    if adapter and (field("general.type") != "adapter" or field("adapter.type") != "lora"):
        problems.append("adapter metadata (general.type, adapter.type) missing")
    if not adapter:
        array, int32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32
        if r.types.get("tokenizer.ggml.token_type") != (array, int32):
            problems.append("tokenizer.ggml.token_type is not an array of int32")
    got = {name: tuple(int(x) for x in t.shape) for name, t in r.tensors.items()}
    for name, shape in shapes.items():
        if name not in got:
            problems.append(f"tensor {name} is missing")
        elif got[name] != tuple(int(x) for x in shape):
            problems.append(f"tensor {name} has shape {got[name]}, expected {tuple(shape)}")
    if problems:
        path.unlink(missing_ok=True)
        raise UserInputError("GGUF check failed: " + "; ".join(problems), str(path))
