"""Metadata writers for the architectures whose GGUF settings are written whole (their keys
differ per layer, nest, or come without the common attention keys): MLA, Mamba and the SSM
hybrids, and the families whose heads, widths or RoPE differ between layers."""

from __future__ import annotations

import numpy as np

from ...gguf.tensors import deci_layers


def add_routing(w, sigmoid: bool, scale=None, norm=None, n_group=1, topk_group=1) -> None:
    """A mixture's routing as llama.cpp's build_moe_ffn reads it: the gating function, the
    weights' scale and renormalisation where given, and expert groups only where grouped
    routing drops some (llama.cpp refuses as many groups used as there are)."""
    import gguf

    func = gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    w.add_expert_gating_func(func)
    if scale is not None:
        w.add_expert_weights_scale(float(scale))
    if norm is not None:
        w.add_expert_weights_norm(bool(norm))
    n_group, topk_group = int(n_group or 1), int(topk_group or 1)
    grouped = n_group > 1 and topk_group < n_group
    w.add_expert_group_count(n_group if grouped else 1)
    w.add_expert_group_used_count(topk_group if grouped else 1)


def add_mla(w, args, mt: str) -> None:
    """Multi-head latent attention and routing as llama.cpp's deepseek2 reads them: one latent
    kv head of kv_lora_rank + the rotary part, decompressed per head. DeepSeek-V3's sigmoid
    routing, DeepSeek-V2's softmax one (never renormalised in mlx-lm), or no experts at all
    (Youtu)."""

    layers = int(args.num_hidden_layers)
    experts = int(getattr(args, "n_routed_experts", None) or 0)
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(layers)
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count(int(args.num_attention_heads))
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_rope_dimension_count(int(args.qk_rope_head_dim))
    dense_lead = int(getattr(args, "first_k_dense_replace", 0)) if experts else layers
    w.add_leading_dense_block_count(dense_lead)
    w.add_q_lora_rank(int(args.q_lora_rank or 0))  # 0: one q projection
    w.add_kv_lora_rank(int(args.kv_lora_rank))
    w.add_key_length(int(args.kv_lora_rank + args.qk_rope_head_dim))
    w.add_value_length(int(args.kv_lora_rank))
    w.add_key_length_mla(int(args.qk_nope_head_dim + args.qk_rope_head_dim))
    w.add_value_length_mla(int(args.v_head_dim))
    w.add_expert_feed_forward_length(int(getattr(args, "moe_intermediate_size", 0) or 0))
    w.add_expert_shared_count(int(getattr(args, "n_shared_experts", None) or 0))
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(int(args.num_experts_per_tok))
    softmax = ("deepseek_v2", "mistral4")  # the rest: the config's scoring function
    # DeepSeek-V2 groups only in group_limited_greedy routing, and never renormalises
    grouped = mt != "deepseek_v2" or getattr(args, "topk_method", "") == "group_limited_greedy"
    add_routing(
        w,
        sigmoid=mt not in softmax and getattr(args, "scoring_func", "sigmoid") == "sigmoid",
        scale=getattr(args, "routed_scaling_factor", 1.0),
        norm=True if mt != "deepseek_v2" and getattr(args, "norm_topk_prob", False) else None,
        n_group=getattr(args, "n_group", None) if grouped else 1,
        topk_group=getattr(args, "topk_group", None),
    )


def nemotron_h_pattern(value) -> str:
    """Nemotron-H's layer pattern as one string (configs give a string or a list)."""
    return value if isinstance(value, str) else "".join(value)


def add_nemotron_h(w, args) -> None:
    """Nemotron-H as llama.cpp's nemotron_h_moe reads it: Mamba 2 layers (M), attention layers
    without RoPE (*) and expert layers (E), each kind's widths in per-layer arrays."""
    import gguf

    pattern = nemotron_h_pattern(args.hybrid_override_pattern)
    layers = len(pattern)
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(layers)
    w.add_head_count(int(args.num_attention_heads))
    w.add_head_count_kv([int(args.num_key_value_heads) if c == "*" else 0 for c in pattern])
    w.add_key_length(int(args.head_dim))
    w.add_value_length(int(args.head_dim))
    w.add_layer_norm_rms_eps(float(args.layer_norm_epsilon))
    w.add_layer_norm_eps(float(args.layer_norm_epsilon))  # the loader reads both
    w.add_vocab_size(int(args.vocab_size))
    w.add_rope_scaling_finetuned(False)  # no RoPE in the attention layers
    w.add_ssm_conv_kernel(int(args.conv_kernel))
    w.add_ssm_state_size(int(args.ssm_state_size))
    w.add_ssm_group_count(int(args.n_groups))
    w.add_ssm_inner_size(int(args.mamba_num_heads * args.mamba_head_dim))
    w.add_ssm_time_step_rank(int(args.mamba_num_heads))
    ff = int(args.moe_intermediate_size)
    w.add_feed_forward_length([ff if c == "E" else 0 for c in pattern])
    w.add_expert_count(int(args.n_routed_experts))
    w.add_expert_used_count(int(args.num_experts_per_tok))
    w.add_expert_feed_forward_length(ff)
    w.add_expert_shared_feed_forward_length(int(args.moe_shared_expert_intermediate_size))
    w.add_expert_shared_count(int(args.n_shared_experts or 0))
    w.add_expert_weights_norm(bool(args.norm_topk_prob))
    w.add_expert_weights_scale(float(args.routed_scaling_factor or 1.0))
    w.add_expert_group_count(int(args.n_group or 1))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def add_granite_hybrid(w, arg) -> None:
    """Granite 4's hybrids as llama.cpp's granitehybrid reads them: Mamba 2 layers beside the
    attention layers (kv heads per layer, 0 for Mamba), RoPE only where the model uses it."""
    w.add_ssm_conv_kernel(int(arg("mamba_d_conv")))
    w.add_ssm_state_size(int(arg("mamba_d_state")))
    w.add_ssm_group_count(int(arg("mamba_n_groups")))
    w.add_ssm_inner_size(int(arg("mamba_n_heads") * arg("mamba_d_head")))
    w.add_ssm_time_step_rank(int(arg("mamba_n_heads")))
    w.add_rope_scaling_finetuned(arg("position_embedding_type", "rope") == "rope")
    if arg("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(arg("shared_intermediate_size")))


def _add_ssm(w, args, context: int, heads: int, rms_eps: float) -> None:
    """A Mamba model's keys as llama.cpp reads them (no attention: zero heads, no MLP)."""
    w.add_context_length(int(context))
    w.add_embedding_length(int(args.hidden_size))
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(int(args.num_hidden_layers))
    w.add_ssm_conv_kernel(int(args.conv_kernel))
    w.add_ssm_inner_size(int(args.intermediate_size))
    w.add_ssm_state_size(int(args.state_size))
    w.add_ssm_time_step_rank(int(heads))
    w.add_layer_norm_rms_eps(float(rms_eps))
    w.add_vocab_size(int(args.vocab_size))


def add_mamba2(w, args) -> None:
    """Mamba 2 as llama.cpp's mamba2 reads it: its heads and groups."""
    context = getattr(args, "max_position_embeddings", None) or 2**20
    _add_ssm(w, args, context, args.num_heads, args.layer_norm_epsilon)
    w.add_ssm_group_count(int(args.n_groups))


def add_mamba(w, args) -> None:
    """Mamba 1 as llama.cpp's mamba reads it; mlx-lm's norms keep MLX's default epsilon."""
    _add_ssm(w, args, 2**20, args.time_step_rank, 1e-5)
    w.add_ssm_dt_b_c_rms(bool(args.use_bcdt_rms))


def add_openelm(w, model) -> None:
    """OpenELM as llama.cpp's openelm reads it: heads and MLP widths per layer."""
    args = model.args
    layers = int(args.num_transformer_layers)
    ffn = [int(layer.ffn.proj_2.weight.shape[1]) for layer in model.layers]  # as built
    w.add_context_length(int(getattr(args, "max_context_length", None) or 2048))
    w.add_embedding_length(int(args.model_dim))
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count([int(n) for n in args.num_query_heads])
    w.add_head_count_kv([int(n) for n in args.num_kv_heads])
    w.add_rope_freq_base(float(args.rope_freq_constant))
    w.add_rope_dimension_count(int(args.head_dim))
    w.add_key_length(int(args.head_dim))
    w.add_value_length(int(args.head_dim))
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))


def add_falcon_h1(w, args) -> None:
    """Falcon-H1 as llama.cpp's falcon-h1 reads it: every layer attention and Mamba 2 side by
    side. Its muP multipliers are in the weights as mlx-lm holds them (folded at load), so
    none is written."""
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(int(args.num_hidden_layers))
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count(int(args.num_attention_heads))
    w.add_head_count_kv(int(args.num_key_value_heads))
    w.add_key_length(int(args.head_dim))
    w.add_value_length(int(args.head_dim))
    w.add_rope_dimension_count(int(args.head_dim))
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_ssm_conv_kernel(int(args.mamba_d_conv))
    w.add_ssm_inner_size(int(args.mamba_d_ssm))
    w.add_ssm_state_size(int(args.mamba_d_state))
    w.add_ssm_time_step_rank(int(args.mamba_n_heads))
    w.add_ssm_group_count(int(args.mamba_n_groups))
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))


def add_mimo2(w, args) -> None:
    """MiMo-V2-Flash as llama.cpp's mimo2 reads it: sliding and full layers with heads of
    their own, attention sinks, the value scale, sigmoid routing with the correction bias
    (renormalised and unscaled, as llama.cpp fixes it)."""

    layers = int(args.num_hidden_layers)
    sliding = [int(p) == 1 for p in args.hybrid_layer_pattern]
    heads = [args.swa_num_attention_heads if s else args.num_attention_heads for s in sliding]
    kv = [args.swa_num_key_value_heads if s else args.num_key_value_heads for s in sliding]
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(layers)
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count([int(n) for n in heads])
    w.add_head_count_kv([int(n) for n in kv])
    w.add_key_length(int(args.head_dim))
    w.add_value_length(int(args.v_head_dim))
    w.add_rope_dimension_count(int(float(args.partial_rotary_factor) * args.head_dim))
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_rope_freq_base_swa(float(args.swa_rope_theta))
    w.add_sliding_window(int(args.sliding_window_size))
    w.add_sliding_window_pattern(sliding)
    w.add_layer_norm_rms_eps(float(args.layernorm_epsilon))
    w.add_vocab_size(int(args.vocab_size))
    w.add_expert_count(int(args.n_routed_experts))
    w.add_expert_used_count(int(args.num_experts_per_tok))
    w.add_expert_feed_forward_length(int(args.moe_intermediate_size))
    add_routing(w, sigmoid=True, n_group=args.n_group, topk_group=args.topk_group)
    if args.attention_value_scale is not None:
        w.add_float32("mimo2.attention.value_scale", float(args.attention_value_scale))


def step35_layers(args) -> list[tuple[bool, int, int, int, float]]:
    """Step 3.5's layers as mlx-lm builds them: (sliding, heads, kv heads, rotated dims,
    RoPE base) each."""
    out = []
    for i in range(int(args.num_hidden_layers)):
        sliding = args.layer_types[i] == "sliding_attention" if args.layer_types else i % 2 == 0
        other = args.attention_other_setting if sliding and args.attention_other_setting else {}
        factors = args.partial_rotary_factors or []
        factor = factors[i] if i < len(factors) else 1.0
        theta = args.rope_theta[i] if isinstance(args.rope_theta, list) else args.rope_theta
        out.append(
            (
                sliding,
                int(other.get("num_attention_heads", args.num_attention_heads)),
                int(other.get("num_attention_groups", args.num_attention_groups)),
                int(args.head_dim * factor),
                float(theta),
            )
        )
    return out


def add_step35(w, model) -> None:
    """Step 3.5 as llama.cpp's step35 reads it: sliding and full layers with heads, rotated
    dims and RoPE bases of their own (the full layers' dims written doubled, as llama.cpp
    halves them), the head-wise attention gate, sigmoid routing with the router bias, the
    SwiGLU clamps."""
    import gguf

    args = model.args
    layers = step35_layers(args)
    full = next((x for x in layers if not x[0]), layers[0])
    swa = next((x for x in layers if x[0]), layers[0])
    n = len(layers)

    def limits(values):
        values = list(values or [])
        return [float(values[i] or 0.0) if i < len(values) else 0.0 for i in range(n)]

    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(n)
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count([x[1] for x in layers])
    w.add_head_count_kv([x[2] for x in layers])
    w.add_key_length(int(args.head_dim))
    w.add_value_length(int(args.head_dim))
    w.add_rope_dimension_count(2 * full[3])
    w.add_rope_dimension_count_swa(swa[3])
    w.add_rope_freq_base(full[4])
    w.add_rope_freq_base_swa(swa[4])
    w.add_sliding_window(int(args.sliding_window))
    w.add_sliding_window_pattern([x[0] for x in layers])
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))
    w.add_expert_count(int(args.moe_num_experts))
    w.add_expert_used_count(int(args.moe_top_k))
    w.add_expert_feed_forward_length(int(args.moe_intermediate_size))
    w.add_expert_shared_feed_forward_length(int(args.share_expert_dim))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(args.moe_router_scaling_factor))
    w.add_expert_weights_norm(bool(args.norm_expert_weight))
    w.add_swiglu_clamp_exp(limits(args.swiglu_limits))
    w.add_swiglu_clamp_shexp(limits(args.swiglu_limits_shared))


def add_minicpm3(w, args) -> None:
    """MiniCPM3 as llama.cpp's minicpm3 reads it: latent q and kv projections, the rotary part
    scaled as mlx-lm's SuScaledRoPE scales it (its scales folded into the weights)."""
    heads = int(args.num_attention_heads)
    sc = args.rope_scaling or {}
    old = int(sc.get("original_max_position_embeddings", 4096))
    longest = int(args.max_position_embeddings)
    w.add_context_length(longest)
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(int(args.num_hidden_layers))
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count(heads)
    w.add_head_count_kv(heads)  # every head its own key and value, as mlx-lm computes
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))
    w.add_q_lora_rank(int(args.q_lora_rank))
    w.add_kv_lora_rank(int(args.kv_lora_rank))
    w.add_key_length(int(args.qk_nope_head_dim + args.qk_rope_head_dim))
    w.add_value_length(int(args.hidden_size) // heads)
    w.add_rope_dimension_count(int(args.qk_rope_head_dim))
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_rope_scaling_orig_ctx_len(old)
    if longest > old:  # mlx-lm's SuScaledRoPE's scale of the rotary part
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(longest / old) / np.log(old))))


def add_kimi_linear(w, args) -> None:
    """Kimi Linear as llama.cpp's kimi-linear reads it: its delta-net (KDA) layers as layers
    without kv heads, its latent attention (MLA, no RoPE) as one latent kv head, routing with
    the correction bias and shared experts."""

    la = args.linear_attn_config
    kda = {int(i) for i in la["kda_layers"]}
    layers = int(args.num_hidden_layers)
    sigmoid = args.moe_router_activation_func == "sigmoid"
    w.add_context_length(int(args.model_max_length))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(layers)
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count(int(args.num_attention_heads))
    w.add_head_count_kv([0 if i + 1 in kda else 1 for i in range(layers)])
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))
    w.add_kv_lora_rank(int(args.kv_lora_rank))
    w.add_key_length(int(args.kv_lora_rank + args.qk_rope_head_dim))
    w.add_value_length(int(args.kv_lora_rank))
    w.add_key_length_mla(int(args.qk_nope_head_dim + args.qk_rope_head_dim))
    w.add_value_length_mla(int(args.v_head_dim))
    w.add_rope_dimension_count(int(args.qk_rope_head_dim))
    w.add_ssm_conv_kernel(int(la["short_conv_kernel_size"]))
    w.add_kda_head_dim(int(la["head_dim"]))
    w.add_expert_count(int(args.num_experts))
    w.add_expert_used_count(int(args.num_experts_per_token))
    w.add_expert_feed_forward_length(int(args.moe_intermediate_size))
    w.add_expert_shared_count(int(args.num_shared_experts))
    w.add_leading_dense_block_count(int(args.first_k_dense_replace))
    add_routing(
        w,
        sigmoid=sigmoid,
        scale=args.routed_scaling_factor,
        n_group=args.num_expert_group if args.use_grouped_topk else 1,
        topk_group=args.topk_group,
    )


def add_deci(w, model) -> None:
    """Nemotron-NAS as llama.cpp's deci reads it: heads, kv heads and MLP widths per layer (no-op
    and linear sublayers as tensors.deci_layers writes them)."""
    args, layers = model.args, deci_layers(model)
    head_dim = int(args.hidden_size) // int(args.num_attention_heads)
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(len(layers))
    w.add_head_count([x[0] for x in layers])
    w.add_head_count_kv([x[1] for x in layers])
    w.add_feed_forward_length([x[2] for x in layers])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))


def add_gemma4(w, args) -> None:
    """Gemma 4's layout as llama.cpp's gemma4 reads it: full layers with their own head size,
    kv heads and a partial ("proportional") rotation base, sliding ones with theirs; the last
    num_kv_shared_layers reading earlier layers' keys, their MLP twice as wide."""
    layers = args.num_hidden_layers
    sliding = [t == "sliding_attention" for t in args.layer_types]
    full_rope = args.rope_parameters.get("full_attention", {})
    swa_rope = args.rope_parameters.get("sliding_attention", {})
    w.add_sliding_window(int(args.sliding_window))
    if args.final_logit_softcapping:
        w.add_final_logit_softcapping(float(args.final_logit_softcapping))
    w.add_shared_kv_layers(int(args.num_kv_shared_layers))
    w.add_embedding_length_per_layer_input(int(args.hidden_size_per_layer_input or 0))
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(int(args.global_head_dim))
    w.add_value_length(int(args.global_head_dim))
    w.add_key_length_swa(int(args.head_dim))
    w.add_value_length_swa(int(args.head_dim))
    shared_from = layers - int(args.num_kv_shared_layers)
    ff = int(args.intermediate_size)
    wide = [ff if i < shared_from else 2 * ff for i in range(layers)]
    w.add_feed_forward_length(wide if args.use_double_wide_mlp else ff)
    kv, kv_full = int(args.num_key_value_heads), args.num_global_key_value_heads
    w.add_head_count_kv([kv if s else int(kv_full) for s in sliding] if kv_full else kv)
    w.add_rope_dimension_count(int(args.global_head_dim))
    swa_dims = args.head_dim * float(swa_rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count_swa(int(swa_dims))
    w.add_rope_freq_base(float(full_rope.get("rope_theta", 1e6)))
    w.add_rope_freq_base_swa(float(swa_rope.get("rope_theta", 1e4)))
