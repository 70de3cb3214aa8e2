"""What the model modules share: the families mlxtune trains, their Hugging Face class names,
and the float dtypes a model is held in."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UserInputError

# The Hugging Face class names of the families GGUF files are read for (a GGUF file names no
# class); ``hf_architecture`` asks transformers for the rest.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def cast_floats(model: nn.Module, dtype: str) -> None:
    """Hold every floating-point parameter of ``model`` in ``dtype`` (a key of DTYPES)."""
    target = DTYPES[dtype]
    params = tree_flatten(model.parameters())
    if any(v.dtype != target and mx.issubdtype(v.dtype, mx.floating) for _, v in params):
        model.set_dtype(target)


def family_classes(config: dict, where: str = "config.json"):
    """mlx-lm's (Model, ModelArgs) classes for a config's model_type, or a UserInputError."""
    # mlx_lm.utils pulls in transformers: imported when a model is built, not with mlxtune
    from mlx_lm.utils import _get_classes

    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise UserInputError("no model_type", where)
    try:
        return _get_classes(config)
    except ValueError:
        raise UserInputError(f"model_type {mt!r} is not a model type mlx-lm knows", where) from None


def hf_architecture(model_type: str) -> str:
    """The transformers class that runs a model_type as a causal LM ("" where transformers has
    none)."""
    if model_type in HF_ARCHITECTURES:
        return HF_ARCHITECTURES[model_type]
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return ""
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")
