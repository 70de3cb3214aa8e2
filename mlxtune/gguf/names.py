"""GGUF's names for the families and tensors mlxtune exports and reads back: one table, so the
export (export.py) and the import (load.py) agree."""

from __future__ import annotations

# model_type -> (gguf architecture, whether q/k rows are permuted as llama.cpp's converter does)
ARCHES = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "gemma": ("gemma", False),
    "gemma2": ("gemma2", False),
    "phi3": ("phi3", False),
}
# gemma's RMSNorm scales by (1 + w); llama.cpp's by w, so its converter stores w + 1
NORM_PLUS_ONE = ("gemma", "gemma2")
DTYPES = ("f32", "f16", "bf16", "q8_0")

_LINEAR = {
    "self_attn.qkv_proj": "attn_qkv",  # phi3: q, k and v in one matrix
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up in one matrix
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_OTHER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}


# gemma2 has four norms per block; its post_attention_layernorm is not llama's (pre-FFN) one
_GEMMA2 = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf: str, model_type: str = "llama") -> str | None:
    """The GGUF tensor name for a Hugging Face/mlx-lm parameter name (None: not exported)."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    bid, rest = parts[2], ".".join(parts[3:])
    if model_type == "gemma2" and rest in _GEMMA2:
        return f"blk.{bid}.{_GEMMA2[rest]}"
    if rest in _OTHER:
        return f"blk.{bid}.{_OTHER[rest]}"
    for hf_mod, name in _LINEAR.items():
        if rest == f"{hf_mod}.weight":
            return f"blk.{bid}.{name}.weight"
    return None


__all__ = ["ARCHES", "DTYPES", "NORM_PLUS_ONE", "gguf_name"]
