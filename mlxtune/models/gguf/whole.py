"""Configs of the architectures read back whole from their GGUF metadata, without the common
attention keys: Mamba and Mamba 2 (no attention), multi-head latent attention (DeepSeek, Youtu,
Mistral 4, MiniCPM3), Nemotron-H (its layer pattern read off the per-layer kv heads and widths),
and the families whose settings differ per layer or nest (OpenELM, MiMo-V2-Flash,
Step 3.5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import UserInputError
from ...gguf.tensors import DECI_NOOP_FFN, dequantized
from ..common import hf_architecture
from .settings import grouped_routing

if TYPE_CHECKING:
    from ...gguf.file import GGUFModelFile


def _identity(g: GGUFModelFile, model_type: str) -> dict:
    """The keys a whole config starts with: the model type, its transformers architecture and
    the vocabulary size (the file's, else its embedding's rows). A file without a
    token_embd.weight tensor is an error."""
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise UserInputError("no token_embd.weight tensor", str(g.path))
    return {
        "model_type": model_type,
        "architectures": [hf_architecture(model_type)],
        "vocab_size": int(g.get("vocab_size") or embd.shape[-1]),
    }


def nemotron_h_config(g: GGUFModelFile, need) -> dict:
    """Nemotron-H's config from what llama.cpp's nemotron_h_moe reads: its layer pattern from
    the per-layer kv heads (attention) and FFN widths (experts), Mamba 2 elsewhere."""
    kv = [int(x) for x in need("attention.head_count_kv")]
    ff = [int(x) for x in need("feed_forward_length")]
    pattern = "".join("*" if k else "E" if f else "M" for k, f in zip(kv, ff, strict=True))
    inner, heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    head = _identity(g, "nemotron_h")
    has = g.tensors.__contains__
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "intermediate_size": max(ff),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": max(kv),
        "head_dim": int(need("attention.key_length")),
        "attention_bias": any(has(f"blk.{i}.attn_q.bias") for i in range(len(pattern))),
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "mamba_proj_bias": has("blk.0.ssm_in.bias"),
        "ssm_state_size": int(need("ssm.state_size")),
        "conv_kernel": int(need("ssm.conv_kernel")),
        "n_groups": int(g.get("ssm.group_count", 1)),
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": has("blk.0.ssm_conv1d.bias"),
        "layer_norm_epsilon": float(g.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "n_routed_experts": int(g.get("expert_count", 0)),
        "num_experts_per_tok": int(g.get("expert_used_count", 0)),
        "moe_intermediate_size": int(g.get("expert_feed_forward_length", 0)),
        "moe_shared_expert_intermediate_size": int(g.get("expert_shared_feed_forward_length", 0)),
        "n_shared_experts": int(g.get("expert_shared_count", 0)),
        **grouped_routing(g, norm=True),
        "time_step_limit": [0.0, float("inf")],
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def mla_config(g: GGUFModelFile, need, softmax_is_v2: bool = True) -> dict:
    """DeepSeek-V3's config from what llama.cpp's deepseek2 reads (see the export)."""
    rope = int(need("rope.dimension_count"))
    head = _identity(g, "deepseek_v3")
    heads = int(need("attention.head_count"))
    gating = int(g.get("expert_gating_func", 1))
    config = {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "moe_intermediate_size": int(g.get("expert_feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": int(g.get("expert_count", 0)),
        "num_experts_per_tok": int(g.get("expert_used_count", 0)),
        "n_shared_experts": int(g.get("expert_shared_count", 0)) or None,
        **grouped_routing(g, norm=False),
        "scoring_func": "sigmoid" if gating == 2 else "softmax",
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "q_lora_rank": g.get("attention.q_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(need("attention.key_length_mla")) - rope,
        "v_head_dim": int(need("attention.value_length_mla")),
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    if not g.get("expert_count"):  # no experts: Youtu's dense MLA
        for key in list(config):
            if key.startswith(("n_routed", "n_shared", "moe_", "num_experts", "routed", "n_group")):
                del config[key]
        for key in ("norm_topk_prob", "scoring_func", "topk_group", "first_k_dense_replace"):
            config.pop(key, None)
        config.update(model_type="youtu_llm", architectures=[hf_architecture("youtu_llm")])
        config.update(rope_traditional=True, mlp_bias=False)
    elif gating != 2 and softmax_is_v2:  # softmax routing: DeepSeek-V2's (never renormalised)
        if config["norm_topk_prob"]:
            raise UserInputError(
                "this deepseek2 file renormalises softmax routing, which no mlx-lm model does",
                str(g.path),
            )
        grouped = config["n_group"] > 1
        config.update(model_type="deepseek_v2", architectures=[hf_architecture("deepseek_v2")])
        config["topk_method"] = "group_limited_greedy" if grouped else "greedy"
        if grouped:
            raise UserInputError(
                "this deepseek2 file routes by expert group, which llama.cpp ranks by the two "
                "best scores and mlx-lm's DeepSeek-V2 by the best one",
                str(g.path),
            )
    if not config["q_lora_rank"]:
        config["q_lora_rank"] = None  # one q projection
    if g.get("rope.scaling.type") == "yarn":
        log_mul = float(g.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": float(need("rope.scaling.factor")),
            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
            "beta_fast": float(g.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(g.get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": log_mul,
            "mscale_all_dim": log_mul,
        }
    return config


def openelm_config(g: GGUFModelFile, need) -> dict:
    """OpenELM's config from what llama.cpp's openelm reads: heads and MLP widths per layer
    (each width as its multiplier of the model's, rounded to 1)."""
    head = _identity(g, "openelm")
    dim, layers = int(need("embedding_length")), int(need("block_count"))

    def per_layer(key):
        v = need(key)
        return [int(x) for x in v] if not isinstance(v, int) else [int(v)] * layers

    return {
        **head,
        "model_dim": dim,
        "num_transformer_layers": layers,
        "head_dim": int(need("attention.key_length")),
        "num_query_heads": per_layer("attention.head_count"),
        "num_kv_heads": per_layer("attention.head_count_kv"),
        "ffn_multipliers": [f / dim for f in per_layer("feed_forward_length")],
        "ffn_dim_divisor": 1,
        "rope_freq_constant": float(g.get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_context_length": int(g.get("context_length", 2048)),
    }


def mimo2_config(g: GGUFModelFile, need) -> dict:
    """MiMo-V2-Flash's config from what llama.cpp's mimo2 reads: sliding and full layers with
    heads of their own, sinks where the file holds them, experts where it holds a router."""
    head = _identity(g, "mimo_v2_flash")
    layers = int(need("block_count"))
    sliding = [bool(x) for x in need("attention.sliding_window_pattern")]
    heads, kv = need("attention.head_count"), need("attention.head_count_kv")
    heads = [int(x) for x in heads] if not isinstance(heads, int) else [heads] * layers
    kv = [int(x) for x in kv] if not isinstance(kv, int) else [kv] * layers

    def first(values, want):
        return next((v for v, s in zip(values, sliding, strict=True) if s == want), values[0])

    def sinks(want):
        return any(
            f"blk.{i}.attn_sinks.weight" in g.tensors for i in range(layers) if sliding[i] == want
        )

    head_dim = int(need("attention.key_length"))
    scale = g.get("attention.value_scale")
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(need("feed_forward_length")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "num_attention_heads": first(heads, False),
        "num_key_value_heads": first(kv, False),
        "swa_num_attention_heads": first(heads, True),
        "swa_num_key_value_heads": first(kv, True),
        "head_dim": head_dim,
        "swa_head_dim": head_dim,
        "v_head_dim": int(need("attention.value_length")),
        "swa_v_head_dim": int(need("attention.value_length")),
        "partial_rotary_factor": int(g.get("rope.dimension_count", head_dim)) / head_dim,
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "swa_rope_theta": float(g.get("rope.freq_base_swa", 10000.0)),
        "sliding_window_size": int(need("attention.sliding_window")),
        "hybrid_layer_pattern": [int(s) for s in sliding],
        "moe_layer_freq": [int(f"blk.{i}.ffn_gate_inp.weight" in g.tensors) for i in range(layers)],
        "add_swa_attention_sink_bias": sinks(True),
        "add_full_attention_sink_bias": sinks(False),
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": None,
        "norm_topk_prob": True,
        "routed_scaling_factor": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": int(g.get("expert_group_count", 1)),
        "topk_group": int(g.get("expert_group_used_count", 1)),
        "layernorm_epsilon": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "attention_value_scale": float(scale) if scale is not None else None,
    }


def mistral4_config(g: GGUFModelFile, need) -> dict:
    """Mistral 4's config from what llama.cpp's mistral4 (its deepseek2 loader) reads: MLA,
    softmax routing, its RoPE settings (yarn, Llama 4's temperature) in rope_parameters."""
    config = mla_config(g, need, softmax_is_v2=False)
    scaling = config.pop("rope_scaling", None)
    rp = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if scaling is not None:
        rp = {**scaling, **rp, "rope_type": "yarn"}
        rp.pop("type", None)
        beta = g.get("attention.temperature_scale")
        if beta is not None:
            rp["llama_4_scaling_beta"] = float(beta)
    config.update(
        model_type="mistral4",
        architectures=[hf_architecture("mistral4")],
        rope_parameters=rp,
        head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
        rope_interleave=True,
    )
    if not config["q_lora_rank"]:
        config["q_lora_rank"] = None
    return config


def step35_config(g: GGUFModelFile, need) -> dict:
    """Step 3.5's config from what llama.cpp's step35 reads (the full layers' rotated dims are
    written doubled: see the export)."""
    head = _identity(g, "step3p5")
    layers = int(need("block_count"))
    sliding = [bool(x) for x in need("attention.sliding_window_pattern")]

    def per_layer(key):
        v = need(key)
        return [int(x) for x in v] if not isinstance(v, int) else [int(v)] * layers

    heads, kv = per_layer("attention.head_count"), per_layer("attention.head_count_kv")
    head_dim = int(need("attention.key_length"))
    full = next((i for i, s in enumerate(sliding) if not s), 0)
    swa = next((i for i, s in enumerate(sliding) if s), 0)
    rot_full = int(need("rope.dimension_count")) // 2
    rot_swa = int(g.get("rope.dimension_count_swa", 2 * rot_full))
    theta_full = float(g.get("rope.freq_base", 10000.0))
    theta_swa = float(g.get("rope.freq_base_swa", 10000.0))
    limits, shared_limits = g.get("swiglu_clamp_exp"), g.get("swiglu_clamp_shexp")
    limits = [0.0] * layers if limits is None else limits
    shared_limits = [0.0] * layers if shared_limits is None else shared_limits
    moe = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in g.tensors]
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads[full],
        "num_attention_groups": kv[full],
        "attention_other_setting": {
            "num_attention_heads": heads[swa],
            "num_attention_groups": kv[swa],
        },
        "head_dim": head_dim,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "partial_rotary_factors": [(rot_swa if s else rot_full) / head_dim for s in sliding],
        "rope_theta": [theta_swa if s else theta_full for s in sliding],
        "sliding_window": int(need("attention.sliding_window")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "use_head_wise_attn_gate": "blk.0.attn_gate.weight" in g.tensors,
        "moe_num_experts": int(need("expert_count")),
        "moe_top_k": int(need("expert_used_count")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "share_expert_dim": int(need("expert_shared_feed_forward_length")),
        "moe_layers_enum": ",".join(str(i) for i in moe),
        "moe_router_scaling_factor": float(g.get("expert_weights_scale", 1.0)),
        "norm_expert_weight": bool(g.get("expert_weights_norm", False)),
        "swiglu_limits": [float(x) for x in limits],
        "swiglu_limits_shared": [float(x) for x in shared_limits],
        "tie_word_embeddings": False,
    }


def minicpm3_config(g: GGUFModelFile, need) -> dict:
    """MiniCPM3's config from what llama.cpp's minicpm3 reads: its scales fixed at
    MiniCPM3-4B's (the export folds a model's own into the weights), its rotary factors from
    the file's tensors."""
    head = _identity(g, "minicpm3")
    rope = int(need("rope.dimension_count"))
    long, short = (
        g.tensors.get("rope_factors_long.weight"),
        g.tensors.get("rope_factors_short.weight"),
    )
    if long is None or short is None:
        raise UserInputError("a minicpm3 file without its rope factor tensors", str(g.path))
    if not np.allclose(dequantized(long), dequantized(short)):
        raise UserInputError(
            "this minicpm3 file's long and short rope factors differ, and mlx-lm's MiniCPM3 "
            "always rotates by the long ones",
            str(g.path),
        )
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": int(need("attention.head_count_kv")),
        "q_lora_rank": int(need("attention.q_lora_rank")),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(need("attention.key_length")) - rope,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 4096)),
        "scale_emb": 12.0,
        "scale_depth": 1.4,
        "dim_model_base": 256,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [float(x) for x in dequantized(long).reshape(-1)],
            "short_factor": [float(x) for x in dequantized(short).reshape(-1)],
            "original_max_position_embeddings": int(
                g.get("rope.scaling.original_context_length", g.get("context_length", 4096))
            ),
        },
        "tie_word_embeddings": False,
    }


def kimi_linear_config(g: GGUFModelFile, need) -> dict:
    """Kimi Linear's config from what llama.cpp's kimi-linear reads: its delta-net layers are
    the ones without kv heads, the rest latent attention."""
    head = _identity(g, "kimi_linear")
    layers = int(need("block_count"))
    kv = need("attention.head_count_kv")
    kv = [int(x) for x in kv] if not isinstance(kv, int) else [int(kv)] * layers
    rope = int(need("rope.dimension_count"))
    heads = int(need("attention.head_count"))
    gating = int(g.get("expert_gating_func", 2))
    groups = int(g.get("expert_group_count", 1))
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": int(need("kda.head_dim")),
        "rope_theta": 10000.0,  # no RoPE: its latent attention's rotary part goes unrotated
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "model_max_length": int(g.get("context_length", 2048)),
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(layers) if kv[i] == 0],
            "full_attn_layers": [i + 1 for i in range(layers) if kv[i] > 0],
            "num_heads": heads,
            "head_dim": int(need("kda.head_dim")),
            "short_conv_kernel_size": int(need("ssm.conv_kernel")),
        },
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(need("attention.key_length_mla")) - rope,
        "v_head_dim": int(need("attention.value_length_mla")),
        "num_experts": int(need("expert_count")),
        "num_experts_per_token": int(need("expert_used_count")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "num_shared_experts": int(g.get("expert_shared_count", 0)),
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(g.get("expert_weights_scale", 1.0)),
        "moe_router_activation_func": "sigmoid" if gating == 2 else "softmax",
        "moe_renormalize": True,
        "moe_layer_freq": 1,
        "use_grouped_topk": groups > 1,
        "num_expert_group": groups,
        "topk_group": int(g.get("expert_group_used_count", 1)),
        "tie_word_embeddings": False,
    }


def deci_config(g: GGUFModelFile, need) -> dict:
    """Nemotron-NAS's config from what llama.cpp's deci reads: per layer, an attention with kv
    heads, a linear one (heads, no kv heads) or none; an MLP of its width, or none where the
    export wrote an all-zero one DECI_NOOP_FFN wide."""
    head = _identity(g, "nemotron-nas")
    layers, hidden = int(need("block_count")), int(need("embedding_length"))

    def per_layer(key):
        v = need(key)
        return [int(x) for x in v] if not isinstance(v, int) else [int(v)] * layers

    heads, kv, ff = (
        per_layer(k)
        for k in ("attention.head_count", "attention.head_count_kv", "feed_forward_length")
    )
    n_heads = max(heads)
    blocks = []
    for i in range(layers):
        if heads[i] == 0:
            attention = {"no_op": True}
        elif kv[i] == 0:
            attention = {"replace_with_linear": True}
        else:
            attention = {"n_heads_in_group": heads[i] // kv[i]}
        down = g.tensors.get(f"blk.{i}.ffn_down.weight")
        if ff[i] == DECI_NOOP_FFN and down is not None and not dequantized(down).any():
            ffn = {"no_op": True}
        else:
            ffn = {"ffn_mult": 3 * ff[i] / (2 * hidden)}  # mlx-lm's width rule, inverted
        blocks.append({"attention": attention, "ffn": ffn})
    return {
        **head,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "block_configs": blocks,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "mlp_bias": any(n.endswith("ffn_up.bias") for n in g.tensors),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def mamba_config(g: GGUFModelFile, need) -> dict:
    """Mamba 1's config from what llama.cpp's mamba reads (no attention, no MLP)."""
    head = _identity(g, "mamba")
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("ssm.inner_size")),
        "state_size": int(need("ssm.state_size")),
        "conv_kernel": int(need("ssm.conv_kernel")),
        "time_step_rank": int(need("ssm.time_step_rank")),
        "use_bias": False,
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in g.tensors,
        "use_bcdt_rms": bool(g.get("ssm.dt_b_c_rms", False)),
        "mixer_rms_eps": 1e-5,
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def mamba2_config(g: GGUFModelFile, need) -> dict:
    """Mamba 2's config from what llama.cpp's mamba2 reads (no attention, no MLP)."""
    inner, heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    head = _identity(g, "mamba2")
    return {
        **head,
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": inner,
        "num_heads": heads,
        "head_dim": inner // heads,
        "state_size": int(need("ssm.state_size")),
        "conv_kernel": int(need("ssm.conv_kernel")),
        "n_groups": int(g.get("ssm.group_count", 1)),
        "layer_norm_epsilon": float(g.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "use_bias": "blk.0.ssm_in.bias" in g.tensors,
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in g.tensors,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": heads,
        "max_position_embeddings": int(g.get("context_length", 2048)),
    }
