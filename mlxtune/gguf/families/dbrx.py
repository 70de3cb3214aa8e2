"""DBRX: its attention and expert settings nested in the config (``attn_config``,
``ffn_config``), q/k/v clamped by ``clip_qkv``, LayerNorms without biases, each expert held
stacked as llama.cpp's dbrx holds them."""

from __future__ import annotations

from ...errors import UserInputError
from ..family import Family, FamilyFacts


def write_settings(w, args) -> None:
    """DBRX as llama.cpp's dbrx reads it."""
    attn, ffn = args.attn_config, args.ffn_config
    w.add_context_length(int(getattr(args, "max_seq_len", None) or 2048))
    w.add_embedding_length(int(args.d_model))
    w.add_block_count(int(args.n_layers))
    w.add_feed_forward_length(int(ffn["ffn_hidden_size"]))
    w.add_head_count(int(args.n_heads))
    w.add_head_count_kv(int(attn["kv_n_heads"]))
    w.add_rope_freq_base(float(attn["rope_theta"]))
    w.add_rope_dimension_count(int(args.d_model) // int(args.n_heads))
    w.add_clamp_kqv(float(attn["clip_qkv"]))
    w.add_expert_count(int(ffn["moe_num_experts"]))
    w.add_expert_used_count(int(ffn["moe_top_k"]))
    w.add_layer_norm_eps(1e-5)
    w.add_vocab_size(int(args.vocab_size))


def read_config(g, need) -> dict:
    """DBRX's config from what llama.cpp's dbrx reads."""
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise UserInputError("no token_embd.weight tensor", str(g.path))
    return {
        "model_type": "dbrx",
        "vocab_size": int(g.get("vocab_size") or embd.shape[-1]),
        "d_model": int(need("embedding_length")),
        "n_layers": int(need("block_count")),
        "n_heads": int(need("attention.head_count")),
        "max_seq_len": int(g.get("context_length", 2048)),
        "attn_config": {
            "kv_n_heads": int(need("attention.head_count_kv")),
            "clip_qkv": float(need("attention.clamp_kqv")),
            "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        },
        "ffn_config": {
            "ffn_hidden_size": int(need("feed_forward_length")),
            "moe_num_experts": int(need("expert_count")),
            "moe_top_k": int(need("expert_used_count")),
        },
    }


def refusal(arg, mt: str) -> str | None:
    if not float((arg("attn_config") or {}).get("clip_qkv") or 0) > 0:
        return "llama.cpp's dbrx clamps q/k/v only by a positive clip_qkv; this model's is not"
    return None


FACTS = FamilyFacts(
    "dbrx",
    Family("dbrx", norm_topk=True),
    write_settings=write_settings,
    read_config=read_config,
    refusal=refusal,
)
