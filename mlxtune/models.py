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
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return mx.dequantize(
                head.weight,
                head.scales,
                head.get("biases"),
                head.group_size,
                head.bits,
                mode=getattr(head, "mode", "affine"),
            )
        return head.weight

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
    return Path(local)


def check_model_dir(p: Path):
    if not (p / "config.json").exists():
        raise UserInputError("no config.json in the model directory", str(p))
    try:
        config = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(
            f"config.json is not valid JSON: {e}", str(p / "config.json")
        ) from None
    if not list(p.glob("model*.safetensors")):
        hint = (
            " (pickled .bin weights are never loaded: convert them to safetensors)"
            if list(p.glob("*.bin"))
            else ""
        )
        raise UserInputError(f"no model*.safetensors weights in the model directory{hint}", str(p))
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
    config = check_model_dir(path)
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


_SEGMENTS: list = [None]


class segments:
    """While active, training attention keeps packed examples apart: ``ids`` [B, T] gives each
    position's example (0: padding). Needs ``kernel_attention`` active around the model.

    With rotary position embeddings an attention score depends only on the distance between
    query and key, so within a segment the scores (and the logits) are those of the example on
    its own: positions restart per segment in effect, without rotating anything twice.
    """

    def __init__(self, ids: mx.array | None):
        self.ids = ids

    def __enter__(self):
        self.saved = _SEGMENTS[0]
        _SEGMENTS[0] = self.ids
        return self

    def __exit__(self, *exc):
        _SEGMENTS[0] = self.saved
        return False


class kernel_attention:
    """Route a model's training attention through ``mlxtune.kernels.attention`` while active.

    mlx-lm's llama, qwen2, qwen3, gemma and phi3 modules call a module-level
    ``scaled_dot_product_attention``; inside this context that name is a wrapper that sends
    the training case (no KV cache, a plain causal mask, no sinks) to the kernel tier and every
    other call (generation with a cache, explicit masks) to mlx-lm's own function. mlx-lm's files
    are not edited, and the original is restored on exit. Families whose attention is their own
    code (gemma2's soft-capped scores) keep it.
    """

    def __init__(self, model: nn.Module, impl: str | None = None):
        import sys

        self.module = sys.modules[type(model).__module__]
        self.impl = impl
        self.original = getattr(self.module, "scaled_dot_product_attention", None)

    @property
    def active(self) -> bool:
        return self.original is not None

    def __enter__(self):
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
                    segment_ids=_SEGMENTS[0],
                    impl=impl,
                )
            if sinks is None:
                return original(queries, keys, values, cache, scale=scale, mask=mask)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

        self.module.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            self.module.scaled_dot_product_attention = self.original
        return False
