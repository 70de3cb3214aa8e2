"""Each family's own config keys, read back from a GGUF file: what its metadata and tensors say
and what llama.cpp fixes for its architecture (``FAMILY_SETTINGS``, by model type); the common
keys are ``configs.gguf_config``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UserInputError
from ...gguf.tensors import dequantized

if TYPE_CHECKING:
    from ...gguf.file import GGUFModelFile


def grouped_routing(g: GGUFModelFile, norm: bool) -> dict:
    """DeepSeek-style routing's config keys from llama.cpp's: whether the chosen experts'
    weights are renormalised (``norm`` when the file does not say), their scale, and the expert
    groups and how many of them each token draws from."""
    return {
        "norm_topk_prob": bool(g.get("expert_weights_norm", norm)),
        "routed_scaling_factor": float(g.get("expert_weights_scale", 1.0)),
        "n_group": int(g.get("expert_group_count", 1)),
        "topk_group": int(g.get("expert_group_used_count", 1)),
    }


def _gemma4_settings(g: GGUFModelFile, config: dict, kv_layers: list | None) -> dict:
    """Gemma 4's layout back from what llama.cpp's gemma4 reads (see the export)."""
    where, layers = str(g.path), config["num_hidden_layers"]
    sliding = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    if len(sliding) != layers:
        raise UserInputError(f"{g.arch}.attention.sliding_window_pattern is not per layer", where)
    head_swa = int(g.get("attention.key_length_swa", config["head_dim"]))
    head_full = int(g.get("attention.key_length", config["head_dim"]))
    ff = g.get("feed_forward_length")
    ff = [int(x) for x in ff] if not isinstance(ff, int) else [int(ff)] * layers
    shared = int(g.get("attention.shared_kv_layers", 0))
    out = {
        "head_dim": head_swa,
        "global_head_dim": head_full,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(g.get("attention.sliding_window", 512)),
        "final_logit_softcapping": g.get("final_logit_softcapping"),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(g.get("embedding_length_per_layer_input", 0)),
        "intermediate_size": ff[0],
        "use_double_wide_mlp": any(x == 2 * ff[0] for x in ff[layers - shared :])
        if shared
        else False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
    }
    if kv_layers is not None:
        out["num_key_value_heads"] = next(n for n, s in zip(kv_layers, sliding, strict=True) if s)
        out["num_global_key_value_heads"] = next(
            n for n, s in zip(kv_layers, sliding, strict=True) if not s
        )
    per_layer = g.tensors.get("per_layer_token_embd.weight")
    if per_layer is not None:
        out["vocab_size_per_layer_input"] = int(per_layer.shape[-1])
    freqs = g.tensors.get("rope_freqs.weight")
    rotated = head_full // 2
    if freqs is not None:
        rotated = int((dequantized(freqs) < 1e20).sum())
    swa_dims = int(g.get("rope.dimension_count_swa", head_swa))
    out["rope_parameters"] = {
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 2 * rotated / head_full,
            "rope_theta": float(g.get("rope.freq_base", 1e6)),
        },
        "sliding_attention": {
            "rope_type": "default",
            "partial_rotary_factor": swa_dims / head_swa,
            "rope_theta": float(g.get("rope.freq_base_swa", 1e4)),
        },
    }
    return out


def _linear_attention(g: GGUFModelFile) -> dict:
    """A gated delta-net's sizes (Qwen3-Next, Qwen3.5)."""
    rank = int(g.get("ssm.time_step_rank"))
    return {
        "linear_conv_kernel_dim": int(g.get("ssm.conv_kernel")),
        "linear_key_head_dim": int(g.get("ssm.state_size")),
        "linear_num_key_heads": int(g.get("ssm.group_count")),
        "linear_num_value_heads": rank,
        "linear_value_head_dim": int(g.get("ssm.inner_size")) // rank,
        "full_attention_interval": int(g.get("full_attention_interval", 4)),
    }


def _granite(g, config, kv_layers) -> dict:
    keys = (
        ("attention_multiplier", "attention.scale"),
        ("embedding_multiplier", "embedding_scale"),
        ("residual_multiplier", "residual_scale"),
        ("logits_scaling", "logit_scale"),
    )
    return {key: float(g.get(meta, 1.0)) for key, meta in keys}


def _granite_hybrid(g, config, kv_layers) -> dict:
    layers, has = config["num_hidden_layers"], g.tensors.__contains__
    rank = int(g.get("ssm.time_step_rank"))
    return {
        **_granite(g, config, kv_layers),
        "layer_types": ["attention" if n else "mamba" for n in kv_layers or [1] * layers],
        "mamba_n_heads": rank,
        "mamba_d_head": int(g.get("ssm.inner_size")) // rank,
        "mamba_d_state": int(g.get("ssm.state_size")),
        "mamba_d_conv": int(g.get("ssm.conv_kernel")),
        "mamba_n_groups": int(g.get("ssm.group_count", 1)),
        "mamba_proj_bias": any(has(f"blk.{i}.ssm_in.bias") for i in range(layers)),
        "mamba_conv_bias": any(has(f"blk.{i}.ssm_conv1d.bias") for i in range(layers)),
        "shared_intermediate_size": int(g.get("expert_shared_feed_forward_length", 0)),
        "position_embedding_type": "rope" if g.get("rope.scaling.finetuned", True) else "nope",
        "time_step_limit": [0.0, float("inf")],
    }


def _qwen3_5_moe(g, config, kv_layers) -> dict:
    return {
        **_linear_attention(g),
        "shared_expert_intermediate_size": int(g.get("expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": True,
    }


def _glm4_moe(g, config, kv_layers) -> dict:
    return {
        "n_shared_experts": int(g.get("expert_shared_count", 0)),
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        **grouped_routing(g, norm=True),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "rope_scaling": config.get("rope_scaling"),  # a key its ModelArgs requires
    }


def _gpt_oss(g, config, kv_layers) -> dict:  # llama.cpp's: a window on even layers
    layers = config["num_hidden_layers"]
    return {
        "intermediate_size": int(g.get("expert_feed_forward_length", config["intermediate_size"])),
        "sliding_window": int(g.get("attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
    }


def _deepseek(g, config, kv_layers) -> dict:
    return {
        "n_shared_experts": g.get("expert_shared_count"),
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        "moe_layer_freq": 1,
    }


def _ministral3(g, config, kv_layers) -> dict:  # its RoPE settings go in rope_parameters
    scaling = config.get("rope_scaling") or {}
    rp = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if scaling.get("rope_type") == "yarn":
        log_mul = float(g.get("rope.scaling.yarn_log_multiplier", 1.0))
        rp = {**scaling, **rp, "rope_type": "yarn", "mscale": log_mul, "mscale_all_dim": log_mul}
        beta = g.get("attention.temperature_scale")
        if beta is not None:
            rp["llama_4_scaling_beta"] = float(beta)
    return {"rope_parameters": rp, "rope_scaling": None, "sliding_window": None}


def _olmo3(g, config, kv_layers) -> dict:
    layers = config["num_hidden_layers"]
    pattern = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    if len(pattern) != layers:  # llama.cpp's default: every 4th layer full
        pattern = [(i + 1) % 4 != 0 for i in range(layers)]
    return {
        "sliding_window": int(g.get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
    }


def _nemotron(g, config, kv_layers) -> dict:  # llama.cpp's: squared ReLU, LayerNorm1P
    return {"hidden_act": "relu2", "norm_eps": float(g.get("attention.layer_norm_epsilon", 1e-5))}


def _minicpm(g, config, kv_layers) -> dict:
    return {
        "scale_emb": float(g.get("embedding_scale", 1.0)),
        "scale_depth": float(g.get("residual_scale", 1.0)) * config["num_hidden_layers"] ** 0.5,
        "dim_model_base": round(config["hidden_size"] / float(g.get("logit_scale", 1.0))),
    }


def _gemma3(g, config, kv_layers) -> dict:
    big = config["num_hidden_layers"] == 62  # llama.cpp scales the 27B's queries by hidden/heads
    out = {
        "sliding_window": int(g.get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": float(
            config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
        ),
    }
    if g.get("final_logit_softcapping"):
        out["final_logit_softcapping"] = float(g.get("final_logit_softcapping"))
    return out


def _short_conv(g, config, kv_layers) -> dict:
    """LFM2's: its conv layers are the ones without kv heads."""
    layers = config["num_hidden_layers"]
    return {
        "full_attn_idxs": [i for i, n in enumerate(kv_layers or [1] * layers) if n > 0],
        "conv_L_cache": int(g.get("shortconv.l_cache", 3)),
        "conv_bias": any(
            f"blk.{i}.shortconv.{part}.bias" in g.tensors
            for i in range(layers)
            for part in ("conv", "in_proj")
        ),
        "norm_eps": config["rms_norm_eps"],
    }


def _lfm2(g, config, kv_layers) -> dict:
    return {
        **_short_conv(g, config, kv_layers),
        "block_dim": config["hidden_size"],
        "block_ff_dim": config["intermediate_size"],  # the written width, as it is
        "block_auto_adjust_ff_dim": False,
        "block_multiple_of": 1,
        "block_ffn_dim_multiplier": 1.0,
    }


def _lfm2_moe(g, config, kv_layers) -> dict:
    return {
        **_short_conv(g, config, kv_layers),
        "num_dense_layers": int(g.get("leading_dense_block_count", 0)),
        "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
        "norm_topk_prob": True,
        "use_expert_bias": any(".exp_probs_b." in n for n in g.tensors),
    }


def _cohere2(g, config, kv_layers) -> dict:
    sliding = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    period = next((i + 1 for i, s in enumerate(sliding) if not s), len(sliding) + 1)
    return {
        "sliding_window": int(g.get("attention.sliding_window")),
        "sliding_window_pattern": period,
        "logit_scale": float(g.get("logit_scale", 1.0)),
    }


def _exaone4(g, config, kv_layers) -> dict:
    """EXAONE 4: local ("L") and global ("G") layers as the per-layer window pattern says (none:
    every layer global, roped)."""
    local = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    out = {"rope_scaling": config.get("rope_scaling")}  # a key its ModelArgs requires
    if not local:
        return {**out, "sliding_window_pattern": None, "sliding_window": None}
    return {
        **out,
        "sliding_window_pattern": "".join("L" if x else "G" for x in local),
        "sliding_window": int(g.get("attention.sliding_window")),
    }


def _plamo3(g, config, kv_layers) -> dict:
    """PLaMo 3: sliding layers beside every pattern-th full one; the written window is mlx-lm's
    window_size + 1 (see the export)."""
    sliding = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    period = next((i + 1 for i, s in enumerate(sliding) if not s), len(sliding) + 1)
    window = int(g.get("attention.sliding_window")) - 1
    return {
        "sliding_window": window,
        "window_size": window,
        "sliding_window_pattern": period,
        "rope_local_theta": float(g.get("rope.freq_base_swa", 10000.0)),
    }


def _exaone_moe(g, config, kv_layers) -> dict:
    layers = config["num_hidden_layers"]
    sliding = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    if len(sliding) != layers:  # llama.cpp's default: layers il % 4 < 3 slide
        sliding = [i % 4 < 3 for i in range(layers)]
    dense = int(g.get("leading_dense_block_count", 0))
    return {
        "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
        "num_shared_experts": int(g.get("expert_shared_count", 0)),
        "sliding_window": int(g.get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "is_moe_layer": [i >= dense for i in range(layers)],
        **grouped_routing(g, norm=False),
    }


def _afmoe(g, config, kv_layers) -> dict:
    layers = config["num_hidden_layers"]
    return {
        "layer_types": [
            "full_attention" if i % 4 == 3 else "sliding_attention" for i in range(layers)
        ],  # llama.cpp's afmoe fixes it
        "sliding_window": int(g.get("attention.sliding_window")),
        "num_dense_layers": int(g.get("leading_dense_block_count", 0)),
        "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
        "num_shared_experts": int(g.get("expert_shared_count", 0)),
        "route_norm": bool(g.get("expert_weights_norm", False)),
        "route_scale": float(g.get("expert_weights_scale", 1.0)),
        "score_func": "sigmoid" if g.get("expert_gating_func", 2) == 2 else "softmax",
        "n_group": int(g.get("expert_group_count", 1)),
        "topk_group": int(g.get("expert_group_used_count", 1)),
        "mup_enabled": True,
    }


def _falcon_h1(g, config, kv_layers) -> dict:
    """Falcon-H1 with its multipliers in the weights (every one 1 here), Mamba 2 beside the
    attention in each layer."""
    heads = int(g.get("ssm.time_step_rank"))
    groups = int(g.get("ssm.group_count", 1))
    layers = config["num_hidden_layers"]
    has = g.tensors.__contains__
    return {
        "mamba_d_ssm": int(g.get("ssm.inner_size")),
        "mamba_n_heads": heads,
        "mamba_d_head": int(g.get("ssm.inner_size")) // heads,
        "mamba_d_state": int(g.get("ssm.state_size")),
        "mamba_d_conv": int(g.get("ssm.conv_kernel")),
        "mamba_n_groups": groups,
        "mamba_rms_norm": any(has(f"blk.{i}.ssm_norm.weight") for i in range(layers)),
        "mamba_conv_bias": any(has(f"blk.{i}.ssm_conv1d.bias") for i in range(layers)),
        "mamba_norm_before_gate": False,
        "mamba_proj_bias": False,
        "projectors_bias": False,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 1.0,
        "embedding_multiplier": 1.0,
        "key_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
        "mlp_multipliers": [1.0, 1.0],
        "ssm_in_multiplier": 1.0,
        "ssm_multipliers": [1.0] * 5,
        "ssm_out_multiplier": 1.0,
    }


# model type -> its own settings (what its metadata, tensors and llama.cpp's fixed choices say)
FAMILY_SETTINGS = {
    "llama4": lambda g, config, kv_layers: {
        "intermediate_size": int(g.get("expert_feed_forward_length")),
        "intermediate_size_mlp": config["intermediate_size"],
        "interleave_moe_layer_step": int(g.get("interleave_moe_layer_step", 1)),
        "num_local_experts": int(g.get("expert_count")),
        "use_qk_norm": int(g.get("expert_count")) != 128,  # as llama.cpp decides it
        "attention_chunk_size": 8192,
        "attention_bias": False,
        "rope_scaling": config.get("rope_scaling"),
    },
    "afmoe": _afmoe,
    "exaone_moe": _exaone_moe,
    "plamo": lambda g, config, kv_layers: {
        "n_shared_head": config["num_attention_heads"] // config["num_key_value_heads"]
    },
    "plamo3": _plamo3,
    "falcon_h1": _falcon_h1,
    "bailing_moe": lambda g, config, kv_layers: {
        "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
        "num_shared_experts": int(g.get("expert_shared_count", 0)),
        "moe_shared_expert_intermediate_size": int(g.get("expert_shared_feed_forward_length")),
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        **grouped_routing(g, norm=False),
        "score_function": "sigmoid" if g.get("expert_gating_func") == 2 else "softmax",
        "moe_router_enable_expert_bias": any(".exp_probs_b." in n for n in g.tensors),
        "use_qk_norm": True,
    },
    "dots1": lambda g, config, kv_layers: {
        "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        "n_shared_experts": int(g.get("expert_shared_count", 0)),
        **grouped_routing(g, norm=False),
    },
    "ernie4_5_moe": lambda g, config, kv_layers: {
        "moe_k": int(g.get("expert_used_count")),
        "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
        "moe_layer_start_index": int(g.get("leading_dense_block_count", 0)),
        "moe_num_shared_experts": int(g.get("expert_shared_count", 0)),
        "moe_layer_interval": 1,
    },
    # mlx-lm's Apertus normalises q and k whatever its flags say (and llama.cpp's alike)
    "apertus": lambda g, config, kv_layers: {"post_norm": False, "qk_norm": True},
    "exaone": lambda g, config, kv_layers: {"layer_norm_epsilon": config["rms_norm_eps"]},
    "qwen": lambda g, config, kv_layers: {
        "kv_channels": config["head_dim"],
        "layer_norm_epsilon": config["rms_norm_eps"],
        "no_bias": True,
    },
    "gpt_neox": lambda g, config, kv_layers: {
        "rotary_emb_base": config["rope_theta"],
        "use_parallel_residual": bool(g.get("use_parallel_residual", True)),
    },
    "gpt2": lambda g, config, kv_layers: {"n_ctx": config["max_position_embeddings"]},
    "exaone4": _exaone4,
    "minimax": lambda g, config, kv_layers: {
        "intermediate_size": int(g.get("expert_feed_forward_length")),
        "shared_intermediate_size": 0,
        "use_qk_norm": True,
    },
    "cohere": lambda g, config, kv_layers: {"logit_scale": float(g.get("logit_scale", 1.0))},
    "cohere2": _cohere2,
    "granite": _granite,
    "granitemoe": _granite,
    "granitemoehybrid": _granite_hybrid,
    "gemma4_text": _gemma4_settings,
    "qwen3_5_text": lambda g, config, kv_layers: _linear_attention(g),
    "qwen3_5_moe_text": _qwen3_5_moe,
    "qwen3_next": _qwen3_5_moe,  # the same keys: a delta-net, a shared expert, renormalised
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
    "deepseek": _deepseek,
    "ministral3": _ministral3,
    "olmo3": _olmo3,
    "nemotron": _nemotron,
    "minicpm": _minicpm,
    "smollm3": lambda g, config, kv_layers: {"no_rope_layer_interval": 4},  # llama.cpp's fixed
    "gemma3_text": _gemma3,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
}
