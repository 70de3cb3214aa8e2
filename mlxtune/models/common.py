"""What the model modules share: the families mlxtune trains, their Hugging Face class names,
and the float dtypes a model is held in."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

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

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def cast_floats(model: nn.Module, dtype: str) -> None:
    """Hold every floating-point parameter of ``model`` in ``dtype`` (a key of DTYPES)."""
    target = DTYPES[dtype]
    params = tree_flatten(model.parameters())
    if any(v.dtype != target and mx.issubdtype(v.dtype, mx.floating) for _, v in params):
        model.set_dtype(target)
