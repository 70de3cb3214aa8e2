"""Models: load a Hugging Face layout directory through mlx-lm, build one from an architecture
config, save one in Hugging Face layout, and split a model into its backbone and LM head so the
loss never needs the full logits."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ._slot import Slot
from .errors import UserInputError

# Families whose mlx-lm model exposes ``model.model(inputs) -> hidden`` and an LM head that is
# ``lm_head`` or the tied embedding. mistral loads through mlx-lm's llama.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

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

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def is_quantized(m: nn.Module) -> bool:
    """Whether a layer is one of MLX's quantized linear or embedding layers."""
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def dense_weight(m: nn.Module) -> mx.array:
    """A linear or embedding layer's [out, in] weight, de-quantized when the layer is quantized."""
    if not is_quantized(m):
        return m.weight
    return mx.dequantize(
        m.weight,
        m.scales,
        m.get("biases"),
        m.group_size,
        m.bits,
        mode=getattr(m, "mode", "affine"),
    )


@dataclass
class LMParts:
    """What the loss needs from a model: hidden states, the head weight, and a softcap."""

    model: nn.Module

    def hidden(self, inputs: mx.array) -> mx.array:
        """Final hidden states [B, T, D] (after the last norm), before the LM head."""
        return self.model.model(inputs)

    def head_weight(self) -> mx.array:
        """The LM head as a [V, D] matrix (de-quantized when the head is quantized)."""
        m = self.model
        head = getattr(m, "lm_head", None)
        if head is None:
            head = m.model.embed_tokens
        return dense_weight(head)

    @property
    def softcap(self) -> float | None:
        return getattr(self.model, "final_logit_softcapping", None)


def lm_parts(model: nn.Module) -> LMParts:
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in SUPPORTED or not hasattr(getattr(model, "model", None), "embed_tokens"):
        raise UserInputError(
            f"model type {model_type!r} is not supported for training yet; supported: {', '.join(SUPPORTED)}",
            "model",
        )
    return LMParts(model)


def _get_classes(config: dict):
    from mlx_lm.utils import _get_classes as mlx_lm_classes

    return mlx_lm_classes(config)


def resolve_model_path(path: str, base: Path | None) -> Path:
    """A local directory, or a Hub id downloaded (safetensors only) when the network allows."""
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None and (base / p).exists():
        p = base / p
    if p.exists():
        if not p.is_dir():
            raise UserInputError("a model is a directory (config.json + *.safetensors)", str(p))
        _check_layout(p)
        return p
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) is None:
        raise UserInputError("model directory not found", str(p))
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            path,
            allow_patterns=[
                "*.json",
                "model*.safetensors",
                "*.tiktoken",
                "tokenizer.model",
                "*.jinja",
                "*.txt",
            ],
        )
    except Exception as e:
        raise UserInputError(
            f"not a local directory, and fetching it from the Hugging Face Hub failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})",
            path,
        ) from None
    _check_layout(Path(local))
    return Path(local)


# Weights in these files are pickles, which run code as they load: they are never read.
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def pickled_hint(p: Path) -> str:
    """' (pickled .bin weights are never loaded: ...)' when ``p`` holds pickled weights."""
    kinds = sorted({f.suffix for f in p.iterdir() if f.suffix in PICKLED}) if p.is_dir() else []
    if not kinds:
        return ""
    return f" (pickled {'/'.join(kinds)} weights are never loaded: convert them to safetensors)"


def code_files(p: Path, config: dict) -> list[str]:
    """The Python code a model directory's config.json asks a loader to run: mlx-lm's
    ``model_file``, and transformers' ``auto_map`` classes whose module is in the directory
    (or in another Hub repository, ``repo--module.Class``)."""
    found = []
    if config.get("model_file") is not None:
        found.append(str(config["model_file"]))
    refs = config.get("auto_map") or {}
    for ref in refs.values() if isinstance(refs, dict) else []:
        for r in ref if isinstance(ref, list) else [ref]:
            if not isinstance(r, str):
                continue
            module = r.rsplit(".", 1)[0]
            if "--" in r or (p / f"{module}.py").exists():
                found.append(f"{module}.py")
    return sorted(set(found))


def _check_layout(p: Path) -> dict:
    """config.json and safetensors weights, or a UserInputError: the config."""
    if not (p / "config.json").exists():
        raise UserInputError("no config.json in the model directory", str(p))
    try:
        config = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(
            f"config.json is not valid JSON: {e}", str(p / "config.json")
        ) from None
    if not isinstance(config, dict):
        raise UserInputError("config.json is not a JSON object", str(p / "config.json"))
    if not list(p.glob("model*.safetensors")):
        raise UserInputError(
            f"no model*.safetensors weights in the model directory{pickled_hint(p)}", str(p)
        )
    return config


def check_model_dir(p: Path, trust_remote_code: bool = False):
    config = _check_layout(p)
    code = code_files(p, config)
    if code and not trust_remote_code:
        raise UserInputError(
            f"this model asks to run its own Python code ({', '.join(code)}), which runs only "
            "when the recipe sets model.trust_remote_code: true",
            str(p / "config.json"),
        )
    mt = config.get("model_type")
    if mt not in SUPPORTED:
        raise UserInputError(
            f"model_type {mt!r} is not supported for training yet; supported: {', '.join(SUPPORTED)}",
            str(p / "config.json"),
        )
    return config


def load_model(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False):
    """Load a model directory (Hugging Face layout) with mlx-lm's loader: (model, config)."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = Path(path)
    config = check_model_dir(path, trust_remote_code)
    try:
        model, config = mlx_lm_load_model(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise UserInputError(str(e), str(path)) from None
    cast_floats(model, dtype)
    return model, config


def cast_floats(model: nn.Module, dtype: str):
    target = DTYPES[dtype]
    params = tree_flatten(model.parameters())
    if any(v.dtype != target and mx.issubdtype(v.dtype, mx.floating) for _, v in params):
        model.set_dtype(target)


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
    if config["model_type"] not in SUPPORTED:
        raise UserInputError(
            f"{config['model_type']!r} is not supported; supported: {', '.join(SUPPORTED)}",
            "model.arch.model_type",
        )
    config.setdefault("architectures", [HF_ARCHITECTURES[config["model_type"]]])
    config.setdefault("tie_word_embeddings", True)
    for k, v in (special_ids or {}).items():
        if v is not None:
            config.setdefault(k, v)
    model_class, args_class = _get_classes(config)
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


def save_model(
    model: nn.Module,
    config: dict,
    out_dir: str | Path,
    tokenizer=None,
    tokenizer_dir=None,
    dtype: str | None = None,
):
    """Save in Hugging Face layout: config.json, model.safetensors, tokenizer files."""
    from .tokenizer import save_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        weights = {
            k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    cfg.setdefault("architectures", [HF_ARCHITECTURES.get(cfg.get("model_type"), "")])
    float_dtypes = {
        str(v.dtype).split(".")[-1] for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)
    }
    if len(float_dtypes) == 1:
        cfg["torch_dtype"] = float_dtypes.pop()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, tokenizer_dir)
    return out


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return trainable, total


_SEGMENTS = Slot()


def segments(ids: mx.array | None):
    """While active, training attention keeps packed examples apart: ``ids`` [B, T] gives each
    position's example (0: padding). Needs ``kernel_attention`` active around the model.

    With rotary position embeddings an attention score depends only on the distance between
    query and key, so within a segment the scores (and the logits) are those of the example on
    its own: positions restart per segment in effect, without rotating anything twice.
    """
    return _SEGMENTS.holding(ids)


class kernel_attention:
    """Route a model's training attention through ``mlxtune.kernels.attention`` while active.

    mlx-lm's llama, qwen2, qwen3, gemma and phi3 modules call a module-level
    ``scaled_dot_product_attention``; inside this context that name is a wrapper that sends
    the training case (no KV cache, a plain causal mask, no sinks) to the kernel tier and every
    other call (generation with a cache, explicit masks) to mlx-lm's own function. mlx-lm's files
    are not edited, and the original is restored on exit. Families whose attention is their own
    code (gemma2's soft-capped scores) keep it.

    On the CPU, unless the tier is "reference", the modules' ``swiglu`` (llama, qwen2, qwen3,
    phi3) becomes ``kernels.cpu.swiglu`` too: the same function with an exponential that MLX's
    CPU backend vectorises (see kernels/cpu.py).
    """

    def __init__(self, model: nn.Module, impl: str | None = None):
        import sys

        self.module = sys.modules[type(model).__module__]
        self.impl = impl
        # mlx-lm's own functions, also when another kernel_attention is active around this one
        self.original = _unpatched(getattr(self.module, "scaled_dot_product_attention", None))
        self.original_swiglu = _unpatched(getattr(self.module, "swiglu", None))
        self._saved: list[tuple] = []  # what each __enter__ found, for its __exit__

    @property
    def active(self) -> bool:
        return self.original is not None

    def __enter__(self):
        self._saved.append(
            (
                getattr(self.module, "scaled_dot_product_attention", None),
                getattr(self.module, "swiglu", None),
            )
        )
        if self.original is None:
            return self
        from .kernels import attention

        original, impl = self.original, self.impl

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            if cache is None and sinks is None and isinstance(mask, str) and mask == "causal":
                return attention(
                    queries,
                    keys,
                    values,
                    scale=scale,
                    causal=True,
                    segment_ids=_SEGMENTS.value,
                    impl=impl,
                )
            seg = _SEGMENTS.value
            if cache is None and seg is not None and mask is not None and not isinstance(mask, str):
                # an explicit mask (a sliding-window layer): packed examples stay apart there too
                same = (seg[:, :, None] == seg[:, None, :])[:, None]
                if mask.dtype == mx.bool_:
                    mask = mask & same
                else:  # additive
                    mask = mx.where(same, mask, mx.array(-mx.inf, dtype=mask.dtype))
            if sinks is None:
                return original(queries, keys, values, cache, scale=scale, mask=mask)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

        sdpa._mlxtune_original = original
        self.module.scaled_dot_product_attention = sdpa
        if self.original_swiglu is not None:
            if self.impl != "reference" and mx.default_device() == mx.cpu:
                from .kernels import cpu

                def swiglu(gate, x):
                    return cpu.swiglu(gate, x)

                swiglu._mlxtune_original = self.original_swiglu
                self.module.swiglu = swiglu
            else:  # the naive tier keeps mlx-lm's, inside another kernel_attention too
                self.module.swiglu = self.original_swiglu
        return self

    def __exit__(self, *exc):
        sdpa, swiglu = self._saved.pop()
        if sdpa is not None:
            self.module.scaled_dot_product_attention = sdpa
        if swiglu is not None:
            self.module.swiglu = swiglu
        return False


def _unpatched(fn):
    """mlx-lm's function behind a kernel_attention replacement (fn itself when it is not one)."""
    return getattr(fn, "_mlxtune_original", fn)


# --------------------------------------------------------------------------------------------
# QLoRA: a quantized base


def quantize_model(model: nn.Module, bits: int = 4, group_size: int = 64) -> dict:
    """Quantize a model's base in place for QLoRA: every dense Linear and Embedding whose input
    size is a multiple of ``group_size`` becomes its MLX quantized twin (affine, ``bits`` per
    weight, one scale and bias per group), as mlx-lm's convert does; the tied LM head goes with
    the embedding. Layers that are quantized already stay as they are.

    Returns a summary: ``layers`` (how many were quantized), ``skipped`` (paths whose shapes do
    not allow it), ``already`` (layers quantized before), ``bytes_before`` / ``bytes_after``
    (every weight of the model, as held).
    """
    bytes_before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    already = sum(1 for _, m in model.named_modules() if is_quantized(m))
    own = getattr(model, "quant_predicate", None)  # a family's own exclusions (mlx-lm's hook)
    quantized: list[str] = []
    skipped: list[str] = []

    def predicate(path: str, m: nn.Module):
        if not isinstance(m, (nn.Linear, nn.Embedding)) or not hasattr(m, "to_quantized"):
            return False
        if m.weight.shape[-1] % group_size:
            skipped.append(path)
            return False
        choice = own(path, m) if own is not None else True
        if choice:
            quantized.append(path)
        return choice

    try:
        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    except ValueError as e:
        raise UserInputError(
            f"cannot quantize to {bits} bits in groups of {group_size}: {e}", "model.quantize"
        ) from None
    mx.eval(model.parameters())
    return {
        "bits": bits,
        "group_size": group_size,
        "layers": len(quantized),
        "skipped": skipped,
        "already": already,
        "bytes_before": bytes_before,
        "bytes_after": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    }


# --------------------------------------------------------------------------------------------
# Gradient checkpointing


def _plain_argument(a) -> bool:
    return a is None or isinstance(a, (mx.array, str, int, float))


def _run_block(block: nn.Module, call, key, params: dict, seg, *args, **kwargs):
    """The block's own forward with ``params`` in place, and the dropout key and packed segments
    of the original call: the backward pass runs this again and must see exactly the same. (The
    key is no input of the checkpointed function: nothing differentiates through a key.)"""
    from .lora import dropout_key

    held = block.trainable_parameters()
    block.update(params)
    try:
        with segments(seg), dropout_key(key):
            return call(block, *args, **kwargs)
    finally:
        block.update(held)


def _checkpointed_call(self, *args, **kwargs):
    """A checkpointed block's call: its trainable parameters go in as inputs of the checkpointed
    function, so their gradients flow; the frozen ones are constants of the recomputation."""
    call = type(self)._mlxtune_block_call
    if not all(_plain_argument(a) for a in (*args, *kwargs.values())):
        return call(self, *args, **kwargs)  # generation with a KV cache: nothing to save
    key = None
    if self.training and any(isinstance(m, nn.Dropout) and m._p_1 < 1 for m in self.modules()):
        # adapter dropout draws its masks again in the backward pass: from the same key
        key = mx.random.randint(0, 1 << 32, (2,), dtype=mx.uint32)
    fn = mx.checkpoint(
        lambda params, seg, *a, **kw: _run_block(self, call, key, params, seg, *a, **kw)
    )
    return fn(self.trainable_parameters(), _SEGMENTS.value, *args, **kwargs)


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if getattr(cls, "_mlxtune_block_call", None) is not None:
        return cls
    if cls not in _CHECKPOINTED:
        _CHECKPOINTED[cls] = type(
            f"Checkpointed{cls.__name__}",
            (cls,),
            {
                "__call__": _checkpointed_call,
                "__module__": cls.__module__,
                "__doc__": f"{cls.__name__} that recomputes its activations in the backward pass.",
                "_mlxtune_block_call": cls.__call__,
            },
        )
    return _CHECKPOINTED[cls]


def checkpoint_layers(model: nn.Module, every: int = 1) -> int:
    """Gradient checkpointing: transformer blocks 0, every, 2*every, ... keep only their input
    for the backward pass and recompute their activations there (less memory, about a third
    more compute for those blocks). Only these instances change (each gets a subclass of its
    own class whose call is checkpointed); parameter names and values stay as they are, and
    generation with a KV cache runs the blocks as before. Returns how many blocks it covers.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer 1 or more, got {every!r}")
    blocks = model.layers
    chosen = range(0, len(blocks), every)
    for i in chosen:
        blocks[i].__class__ = _checkpointed_class(type(blocks[i]))
    return len(chosen)


def checkpointed_layers(model: nn.Module) -> int:
    """How many transformer blocks of a model recompute their activations (checkpoint_layers)."""
    return sum(1 for b in model.layers if getattr(type(b), "_mlxtune_block_call", None) is not None)
