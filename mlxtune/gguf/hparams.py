"""The metadata a GGUF file of each family holds, as llama.cpp's converter writes it and its
loader reads it; and what llama.cpp fixes per architecture that a model may do otherwise
(refused by name, never written to run differently)."""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserInputError
from ..models.configs import rope_base
from .names import FAMILIES, gguf_name
from .rope import llama3_rope_factors
from .tensors import deci_layers

# the common config keys the export reads -> the names older families' configs use instead
STANDARD_NAMES = {
    "num_hidden_layers": ("n_layer", "num_layers", "n_layers", "num_transformer_layers"),
    "hidden_size": ("n_embd", "d_model", "model_dim"),
    "num_attention_heads": ("n_head", "n_heads"),
    "max_position_embeddings": ("n_positions", "max_seq_len"),
}


def standard_config(config: dict) -> dict:
    """The config with the common keys filled in from an older family's names (GPT-2's
    ``n_layer``, EXAONE's ``num_layers``)."""
    out = dict(config)
    for key, olds in STANDARD_NAMES.items():
        if key not in out:
            have = next((o for o in olds if o in config), None)
            if have is not None:
                out[key] = config[have]
    return out


def model_args(model):
    """The ModelArgs a model was built with (``args``; Youtu's ``config``)."""
    args = getattr(model, "args", None)
    return args if args is not None else getattr(model, "config", None)


def _routing(arg, mt: str) -> str | None:
    family = FAMILIES[mt]
    if family.norm_topk is None:
        return None
    norm = arg("norm_topk_prob", True if mt in ("mixtral", "granitemoe") else None)
    if norm is not None and bool(norm) != family.norm_topk:
        return (
            f"llama.cpp's {family.arch} {'re' if family.norm_topk else 'does not re'}"
            f"normalise the routers' top-k weights; this model's norm_topk_prob is {norm}"
        )
    if arg("mlp_only_layers") or arg("decoder_sparse_step", 1) != 1:
        return f"llama.cpp's {family.arch} puts experts in every layer; this model does not"
    return None


def _unclamped(arg, mt: str) -> str | None:  # llama.cpp's SSM scans take the step as it is
    if float((arg("time_step_limit") or [0.0])[0]) > 0:
        return f"llama.cpp's {FAMILIES[mt].arch} does not clamp the SSM step from below; this model does"
    return None


def _gemma3(arg, mt: str) -> str | None:
    fixed = (
        ("sliding_window_pattern", 6),
        ("rope_local_base_freq", 10000.0),
        ("query_pre_attn_scalar", arg("head_dim")),
    )
    for key, value in fixed:
        if arg(key) is not None and float(arg(key)) != float(value):
            return f"llama.cpp's gemma3 fixes {key} at {value:g}; this model's is {arg(key):g}"
    return None


def _gemma4(arg, mt: str) -> str | None:
    full = (arg("rope_parameters") or {}).get("full_attention", {})
    if arg("enable_moe_block") or arg("attention_k_eq_v"):
        return "mlxtune writes Gemma 4's dense models to GGUF, not its experts or k = v form"
    if full.get("rope_type", "proportional") != "proportional":
        return "llama.cpp's gemma4 rotates full layers proportionally; this model does not"
    return None


def _smollm3(arg, mt: str) -> str | None:
    every4 = [int((i + 1) % 4 != 0) for i in range(arg("num_hidden_layers"))]
    layers = arg("no_rope_layers")
    if layers is not None and list(layers) != every4:
        return "llama.cpp's smollm3 leaves RoPE out of every 4th layer; this model does not"
    return None


def _olmoe(arg, mt: str) -> str | None:
    if (arg("num_key_value_heads") or arg("num_attention_heads")) != arg("num_attention_heads"):
        return (
            "llama.cpp's olmoe normalises keys over all heads at once, so it reads models with "
            "as many key/value heads as query heads; this model has fewer"
        )
    return None


def _ministral3(arg, mt: str) -> str | None:
    rp = arg("rope_parameters") or {}
    if arg("sliding_window") is not None:
        return (
            "llama.cpp's mistral3 attends over the whole context; this model's config sets a "
            "sliding_window"
        )
    if rp.get("mscale", rp.get("mscale_all_dim")) != rp.get("mscale_all_dim"):
        return "llama.cpp's mistral3 reads one yarn mscale; this model's two differ"
    return None


def _nemotron_h(arg, mt: str) -> str | None:
    if set(_pattern(arg("hybrid_override_pattern"))) - set("M*E"):
        return (
            "mlxtune writes Nemotron-H's mixture-of-experts form (Mamba, attention and expert "
            "layers); this model has dense MLP layers"
        )
    return _unclamped(arg, mt)


def _nemotron(arg, mt: str) -> str | None:
    if arg("hidden_act", "relu2") != "relu2":
        return (
            f"llama.cpp's nemotron squares a ReLU; this model's activation is {arg('hidden_act')}"
        )
    return None


def _gpt_oss(arg, mt: str) -> str | None:
    types = list(arg("layer_types") or [])
    alternate = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]
    if types != alternate:
        return (
            "llama.cpp's gpt-oss slides the window on even layers and attends fully on odd ones; "
            "this model's layer_types differ"
        )
    return None


def _short_conv(arg, mt: str) -> str | None:
    if int(arg("conv_L_cache", 0)) < 2:
        return "llama.cpp's lfm2 needs a short convolution of at least 2 taps"
    if mt == "lfm2_moe" and (
        float(arg("routed_scaling_factor", 1.0)) != 1.0 or not arg("use_expert_bias", True)
    ):
        return (
            "llama.cpp's lfm2moe mixes experts by their sigmoid weights with the expert bias, "
            "unscaled; this model scales them or has no expert bias"
        )
    return None


def _command_r(arg, mt: str) -> str | None:
    if bool(arg("use_qk_norm")) != (int(arg("num_hidden_layers")) >= 64):
        return (
            "llama.cpp's command-r holds q/k norms exactly when a model has 64 or more layers "
            f"(Command R+); this model has {arg('num_hidden_layers')} layers and "
            f"use_qk_norm {bool(arg('use_qk_norm'))}"
        )
    if arg("layer_norm_bias"):
        return "llama.cpp's command-r has LayerNorms without biases; this model's have biases"
    return None


def _rotate_half(arg, mt: str) -> str | None:
    if arg("rope_traditional"):
        return (
            f"mlxtune writes {mt} as llama.cpp's converter does, from rotate-half RoPE; this "
            "model's rope_traditional is set"
        )
    return None


def _minimax_m2(arg, mt: str) -> str | None:
    if not arg("use_qk_norm", True):
        return "llama.cpp's minimax-m2 normalises queries and keys; this model does not"
    return None


def _exaone4_layers(arg, mt: str) -> str | None:
    if _exaone4_local(arg) is not None and int(arg("num_hidden_layers")) != 64:
        return (
            "llama.cpp's exaone4 reads local and global layers only in a model of 64 layers "
            "(EXAONE 4.0 32B) and otherwise ropes every layer over the whole context; this "
            f"model has {arg('num_hidden_layers')} layers and sliding_window_pattern "
            f"{arg('sliding_window_pattern')!r}"
        )
    return None


def _internlm2(arg, mt: str) -> str | None:
    if arg("bias"):
        return (
            "llama.cpp's internlm2 has no bias on the attention output; this model's bias is set "
            "(on q/k/v and the output)"
        )
    return None


def _mamba(arg, mt: str) -> str | None:
    if arg("use_bias"):
        return "llama.cpp's mamba has no bias on the in and out projections; this model has"
    if int(arg("intermediate_size")) != 2 * int(arg("hidden_size")):
        return (
            "llama.cpp's mamba reads an inner size of twice the hidden size; this model's differs"
        )
    if arg("use_bcdt_rms") and float(arg("mixer_rms_eps", 1e-6)) != 1e-5:
        return (
            "llama.cpp's mamba normalises dt, B and C with the model's one RMS epsilon (mlx-lm's "
            "1e-5 elsewhere); this model's mixer_rms_eps differs"
        )
    return None


def _qwen(arg, mt: str) -> str | None:
    if not arg("no_bias", True):
        return "llama.cpp's qwen has no bias on the attention output, MLP or head; this model has"
    return None


def _exaone(arg, mt: str) -> str | None:
    if arg("attention_bias") or arg("mlp_bias"):
        return (
            "llama.cpp's exaone has no bias on the attention output or the MLP; this model's "
            "attention_bias or mlp_bias is set"
        )
    return _rotate_half(arg, mt)


def _apertus(arg, mt: str) -> str | None:
    if arg("mlp_bias"):
        return "llama.cpp's apertus has no bias on the MLP; this model's mlp_bias is set"
    return _rotate_half(arg, mt)


def _openelm(arg, mt: str) -> str | None:
    for key, what in (
        ("normalize_qk_projections", "normalises queries and keys"),
        ("share_input_output_layers", "ties the head to the embedding"),
        ("ffn_with_glu", "gates its MLP"),
    ):
        if not arg(key, True):
            return f"llama.cpp's openelm {what}; this model's {key} is off"
    return None


def _deepseek_v2(arg, mt: str) -> str | None:
    if arg("topk_method") == "group_limited_greedy" and int(arg("n_group") or 1) > 1:
        return (
            "llama.cpp's deepseek2 ranks expert groups by their two best scores and mlx-lm's "
            "DeepSeek-V2 by the best one; this model routes by group (group_limited_greedy)"
        )
    if arg("n_routed_experts") and not arg("n_shared_experts"):
        return (
            "llama.cpp's deepseek2 reads shared experts beside the routed ones; this model has none"
        )
    if int(arg("moe_layer_freq", 1)) != 1:
        return "llama.cpp's deepseek2 puts experts in every layer after the dense ones; this model does not"
    if arg("attention_bias"):
        return "llama.cpp's deepseek2 has no attention biases; this model has"
    return None


def _youtu(arg, mt: str) -> str | None:
    if not arg("rope_traditional", True):
        return (
            "llama.cpp's deepseek2 rotates interleaved pairs; this model's rope_traditional is off"
        )
    if arg("attention_bias") or arg("mlp_bias"):
        return "llama.cpp's deepseek2 has no biases; this model has"
    return None


def _ernie4_5_moe(arg, mt: str) -> str | None:
    layers = int(arg("num_hidden_layers"))
    end = arg("moe_layer_end_index")
    if arg("moe_gate_act", "softmax") != "softmax":
        return "llama.cpp's ernie4_5-moe routes by softmax; this model's moe_gate_act differs"
    if int(arg("moe_layer_interval", 1)) != 1 or (end is not None and int(end) < layers - 1):
        return (
            "llama.cpp's ernie4_5-moe puts experts in every layer from moe_layer_start_index on; "
            "this model's moe_layer_interval or moe_layer_end_index says otherwise"
        )
    if arg("use_bias"):
        return (
            "llama.cpp's ernie4_5-moe has no bias on the attention output or MLPs; this model has"
        )
    return None


def _dots1_fixed(arg, mt: str) -> str | None:
    if (arg("num_key_value_heads") or arg("num_attention_heads")) != arg("num_attention_heads"):
        return (
            "llama.cpp's dots1 reads as many key/value heads as query heads; this model has fewer"
        )
    if arg("norm_topk_prob") and int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's dots1 renormalises even one expert's weight and mlx-lm does not"
    if not arg("n_shared_experts"):
        return "llama.cpp's dots1 reads shared experts beside the routed ones; this model has none"
    if arg("mlp_bias"):
        return "llama.cpp's dots1 has no MLP biases; this model has"
    return None


def _bailing_fixed(arg, mt: str) -> str | None:
    if not arg("use_qk_norm"):
        return (
            "mlxtune writes Ling 2.0's layout (llama.cpp's bailingmoe2), which normalises "
            "queries and keys; this model does not (Ling 1's layout)"
        )
    if not (arg("num_shared_experts") and arg("moe_router_enable_shared_expert", True)):
        return "llama.cpp's bailingmoe2 reads shared experts beside the routed ones; this model has none"
    if arg("use_bias") or arg("use_qkv_bias"):
        return "llama.cpp's bailingmoe2 has no attention or MLP biases; this model has"
    if arg("norm_topk_prob") and int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's bailingmoe2 renormalises even one expert's weight and mlx-lm does not"
    return None


def _dbrx(arg, mt: str) -> str | None:
    if not float((arg("attn_config") or {}).get("clip_qkv") or 0) > 0:
        return "llama.cpp's dbrx clamps q/k/v only by a positive clip_qkv; this model's is not"
    return None


def _falcon_h1(arg, mt: str) -> str | None:
    if arg("mamba_norm_before_gate"):
        return "llama.cpp's falcon-h1 gates before its SSM norm; this model norms before the gate"
    if arg("mamba_rms_norm") and int(arg("mamba_n_groups", 1)) > 1:
        return (
            "llama.cpp's falcon-h1 normalises the SSM output per group and mlx-lm's Falcon-H1 "
            "over the whole of it; this model has mamba_n_groups > 1"
        )
    for key in ("mamba_proj_bias", "projectors_bias", "attention_bias"):
        if arg(key):
            return f"llama.cpp's falcon-h1 applies no bias where {key} puts one; this model sets it"
    if arg("rope_traditional"):
        return _rotate_half(arg, mt)
    return None


def _plamo(arg, mt: str) -> str | None:
    if int(arg("num_attention_heads")) % int(arg("n_shared_head", 8)):
        return "mlx-lm's PLaMo shares kv heads evenly only when n_shared_head divides the heads"
    return _rotate_half(arg, mt)


def _exaone_moe_fixed(arg, mt: str) -> str | None:
    moe = [bool(x) for x in arg("is_moe_layer")]
    if "sliding_attention" not in list(arg("layer_types")):
        return (
            "llama.cpp's exaone-moe ropes only its sliding layers, and mlx-lm's ropes every layer "
            "of a model without one; this model has none"
        )
    if True not in moe or moe != [False] * moe.index(True) + [True] * (len(moe) - moe.index(True)):
        return (
            "llama.cpp's exaone-moe puts experts in every layer after the leading dense ones; "
            "this model's is_moe_layer does otherwise"
        )
    if not arg("num_shared_experts"):
        return "llama.cpp's exaone-moe reads shared experts beside the routed ones; this model has none"
    return None


def _mimo2(arg, mt: str) -> str | None:
    if arg("n_shared_experts"):
        return "llama.cpp's mimo2 has no shared experts; this model has"
    if int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's mimo2 renormalises even one expert's weight and mlx-lm does not"
    if float(arg("routed_scaling_factor") or 1.0) != 1.0:
        return "llama.cpp's mimo2 does not scale the routed experts' weights; this model does"
    if (arg("head_dim"), arg("v_head_dim")) != (arg("swa_head_dim"), arg("swa_v_head_dim")):
        return "llama.cpp's mimo2 reads one head size for every layer; this model's differ"
    return None


def _mistral4(arg, mt: str) -> str | None:
    layers, vocab = int(arg("num_hidden_layers")), int(arg("vocab_size"))
    if arg("rope_interleave") is False:
        return "llama.cpp's mistral4 rotates interleaved pairs; this model's rope_interleave is off"
    if arg("q_lora_rank") and (layers in (26, 27) or (layers == 48 and vocab == 128256)):
        return (
            "llama.cpp's deepseek2 loader reads no q_lora_rank at this layer count (DeepSeek-V2 "
            "Lite's); this model has one"
        )
    if float(arg("rms_norm_eps")) != 1e-6:
        return (
            "mlx-lm's Mistral 4 normalises its latent q and kv at an epsilon of 1e-6 and "
            "llama.cpp at rms_norm_eps; this model's differs"
        )
    if not arg("n_shared_experts"):
        return (
            "llama.cpp's mistral4 reads shared experts beside the routed ones; this model has none"
        )
    if arg("attention_bias"):
        return "llama.cpp's mistral4 has no attention biases; this model has"
    return None


def _afmoe_fixed(arg, mt: str) -> str | None:
    types = list(arg("layer_types"))
    every4 = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(len(types))]
    if types != every4:
        return (
            "llama.cpp's afmoe ropes and slides every layer but every 4th; this model's "
            "layer_types differ"
        )
    if not arg("mup_enabled", True):
        return "llama.cpp's afmoe scales the embeddings by sqrt(hidden); this model does not"
    if arg("route_norm", True) and int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's afmoe renormalises even one expert's weight and mlx-lm does not"
    return None


def _step35(arg, mt: str) -> str | None:
    from types import SimpleNamespace

    fields = (
        "num_hidden_layers", "layer_types", "attention_other_setting", "partial_rotary_factors",
        "rope_theta", "head_dim", "num_attention_heads", "num_attention_groups",
    )  # fmt: skip
    layers = step35_layers(SimpleNamespace(**{k: arg(k) for k in fields}))
    for kind in (True, False):
        same = {(x[3], x[4]) for x in layers if x[0] == kind}
        if len(same) > 1:
            return (
                "llama.cpp's step35 reads one rotated share and RoPE base per layer type; this "
                "model's differ between layers of one type"
            )
    if arg("rope_scaling"):
        return "mlxtune writes Step 3.5 without RoPE scaling; this model's config sets one"
    if not float(arg("moe_router_scaling_factor", 3.0)):
        return "llama.cpp's step35 reads a routed scale of 0 as none; this model's is 0"
    return None


def _llama4_fixed(arg, mt: str) -> str | None:
    experts = int(arg("num_local_experts"))
    if int(arg("attention_chunk_size")) != 8192:
        return "llama.cpp's llama4 chunks attention by 8192 tokens; this model's chunk differs"
    if bool(arg("use_qk_norm")) != (experts != 128):
        return (
            "llama.cpp's llama4 normalises queries and keys exactly when a model has other than "
            f"128 experts; this model has {experts} and use_qk_norm {bool(arg('use_qk_norm'))}"
        )
    tuning = (
        bool(arg("attn_temperature_tuning", 4)),
        arg("floor_scale", 8192),
        arg("attn_scale", 0.1),
    )
    if tuning != (True, 8192, 0.1):
        return (
            "llama.cpp's llama4 tunes the unroped layers' attention temperature with a floor of "
            "8192 and a scale of 0.1; this model's differ"
        )
    if arg("attention_bias"):
        return "llama.cpp's llama4 has no bias on the attention output; this model has"
    return None


def _minicpm3(arg, mt: str) -> str | None:
    if arg("attention_bias"):
        return "llama.cpp's minicpm3 has no attention biases; this model has"
    if arg("rope_traditional"):
        return _rotate_half(arg, mt)
    return None


def _kimi_linear(arg, mt: str) -> str | None:
    la = arg("linear_attn_config") or {}
    if int(la.get("num_heads", 0)) != int(arg("num_attention_heads")):
        return "llama.cpp's kimi-linear reads one head count for both kinds of layer; this model's differ"
    if float(arg("rms_norm_eps")) != 1e-6:
        return (
            "mlx-lm's Kimi Linear normalises its delta-net's q and k at an epsilon of 1e-6 and "
            "llama.cpp at rms_norm_eps; this model's differs"
        )
    if not arg("moe_renormalize", True) or int(arg("num_experts_per_token", 1)) == 1:
        return "llama.cpp's kimi-linear renormalises the top-k weights, even one's; this model does not"
    if int(arg("moe_layer_freq", 1)) != 1:
        return "llama.cpp's kimi-linear puts experts in every layer after the dense ones; this model does not"
    if not arg("num_shared_experts"):
        return (
            "llama.cpp's kimi-linear adds a shared expert in every MoE layer; this model has none"
        )
    if not arg("qk_rope_head_dim"):
        return "llama.cpp's kimi-linear keeps a rotary part in its latent keys; this model has none"
    return None


def _deci(arg, mt: str) -> str | None:
    if arg("hidden_act", "silu") != "silu":
        return f"llama.cpp's deci gates its MLP with SiLU; this model's activation is {arg('hidden_act')}"
    for i, block in enumerate(arg("block_configs") or []):
        ffn = block.ffn if hasattr(block, "ffn") else None
        attn = block.attention if hasattr(block, "attention") else None
        if ffn is not None and ffn.replace_with_linear:
            return f"llama.cpp's deci has no linear MLP; layer {i} of this model has one"
        if attn is not None and attn.replace_with_linear and arg("attention_bias"):
            return (
                "llama.cpp's deci applies no bias in a linear attention; this model's "
                f"layer {i} has one"
            )
    return None


# model type -> what llama.cpp fixes for its architecture, checked against the model
_FIXED = {
    "nemotron-nas": _deci,
    "kimi_linear": _kimi_linear,
    "minicpm3": _minicpm3,
    "llama4": _llama4_fixed,
    "step3p5": _step35,
    "afmoe": _afmoe_fixed,
    "mistral4": _mistral4,
    "mimo_v2_flash": _mimo2,
    "exaone_moe": _exaone_moe_fixed,
    "plamo": _plamo,
    "falcon_h1": _falcon_h1,
    "dbrx": _dbrx,
    "bailing_moe": _bailing_fixed,
    "dots1": _dots1_fixed,
    "ernie4_5_moe": _ernie4_5_moe,
    "deepseek_v2": _deepseek_v2,
    "youtu_llm": _youtu,
    "openelm": _openelm,
    "apertus": _apertus,
    "exaone": _exaone,
    "qwen": _qwen,
    "mamba": _mamba,
    "internlm2": _internlm2,
    "exaone4": _exaone4_layers,
    "minimax": _minimax_m2,
    "internlm3": _rotate_half,
    "cohere": _command_r,
    "gemma3_text": _gemma3,
    "gemma4_text": _gemma4,
    "smollm3": _smollm3,
    "olmoe": _olmoe,
    "ministral3": _ministral3,
    "nemotron_h": _nemotron_h,
    "nemotron": _nemotron,
    "mamba2": _unclamped,
    "granitemoehybrid": _unclamped,
    "gpt_oss": _gpt_oss,
    "lfm2": _short_conv,
    "lfm2_moe": _short_conv,
}


def refusal(model, config: dict) -> str | None:
    """What llama.cpp fixes for the architecture that this model does otherwise (None: none).
    llama.cpp's graphs hard-code some settings per architecture instead of reading them."""
    mt, args = config["model_type"], model_args(model)

    def arg(name, default=None):
        return getattr(args, name, config.get(name, default))

    check = _FIXED.get(mt)
    return _routing(arg, mt) or (check(arg, mt) if check else None)


def head_counts(config: dict) -> tuple[int, int, int]:
    if "num_attention_heads" not in config:  # an attention-free model (Mamba 2)
        return 0, 0, 0
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    if config.get("n_shared_head"):  # PLaMo's: each kv head shared by n_shared_head q heads
        n_kv = -(-n_head // int(config["n_shared_head"]))
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    return n_head, n_kv, head_dim


def _reader(args, config: dict):
    """``arg(name, default)``: the built model's setting, else the config's."""

    def arg(name, default=None):
        v = getattr(args, name, None)
        return config.get(name, default) if v is None else v

    return arg


def _kv_heads(mt: str, arg, n_kv: int, layers: int):
    """The kv heads: one number, or per layer where some layers have none (a Mamba or
    short-convolution layer)."""
    if mt == "granitemoehybrid":
        return [n_kv if t == "attention" else 0 for t in arg("layer_types")]
    if mt in ("lfm2", "lfm2_moe"):
        full = set(arg("full_attn_idxs") or [])
        return [n_kv if i in full else 0 for i in range(layers)]
    return n_kv


def _add_experts(w, arg, mt: str) -> None:
    experts = (
        arg("num_experts")
        or arg("num_local_experts")
        or arg("n_routed_experts")
        or arg("moe_num_experts")
    )
    if not experts:
        return
    w.add_expert_count(int(experts))
    w.add_expert_used_count(int(arg("num_experts_per_tok") or arg("moe_k")))
    if arg("moe_intermediate_size"):
        w.add_expert_feed_forward_length(int(arg("moe_intermediate_size")))
    if arg("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(arg("shared_expert_intermediate_size")))
    if arg("n_shared_experts") is not None:  # DeepSeek-style shared experts
        w.add_expert_shared_count(int(arg("n_shared_experts")))
    if arg("first_k_dense_replace") is not None:  # and leading dense blocks
        w.add_leading_dense_block_count(int(arg("first_k_dense_replace")))


def _layer_norm_eps(w, arg, mt: str) -> None:
    """A LayerNorm family's epsilon (StableLM, StarCoder2, Nemotron's norm_eps)."""
    eps = arg("layer_norm_eps") or arg("norm_epsilon") or arg("layer_norm_epsilon")
    if mt == "nemotron":
        eps = arg("norm_eps")
    if eps is not None:
        w.add_layer_norm_eps(float(eps))


def _sliding(w, arg, config: dict) -> None:
    """Gemma 2/3's, gpt-oss's and OLMo 3's windows (and the first two's soft caps)."""
    mt = config["model_type"]
    if mt == "gemma2":
        w.add_attn_logit_softcapping(float(arg("attn_logit_softcapping", 50.0)))
        w.add_final_logit_softcapping(float(arg("final_logit_softcapping", 30.0)))
        w.add_sliding_window(int(config.get("sliding_window") or 4096))
        return
    w.add_sliding_window(int(arg("sliding_window")))
    if mt == "gpt_oss":
        w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    if mt == "olmo3":  # OLMo 2 with a window on the layer_types' sliding layers
        w.add_sliding_window_pattern([t == "sliding_attention" for t in arg("layer_types")])
    if mt == "gemma3_text" and arg("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(arg("final_logit_softcapping")))


def _short_conv(w, arg, config: dict) -> None:
    """LFM2's short-convolution cache; LFM2-MoE's leading dense blocks and sigmoid routing."""
    import gguf

    w.add_shortconv_l_cache(int(arg("conv_L_cache")))
    if config["model_type"] == "lfm2_moe":
        w.add_leading_dense_block_count(int(arg("num_dense_layers")))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _delta_net(w, arg, config: dict) -> None:
    """Qwen3-Next's and Qwen3.5's gated delta-net layers between every interval-th full one."""
    w.add_ssm_conv_kernel(int(arg("linear_conv_kernel_dim")))
    w.add_ssm_state_size(int(arg("linear_key_head_dim")))
    w.add_ssm_group_count(int(arg("linear_num_key_heads")))
    w.add_ssm_time_step_rank(int(arg("linear_num_value_heads")))
    w.add_ssm_inner_size(int(arg("linear_value_head_dim") * arg("linear_num_value_heads")))
    w.add_full_attention_interval(int(arg("full_attention_interval")))
    if config["model_type"] != "qwen3_next":  # multimodal RoPE sections (text: any split is one)
        head_dim = head_counts(config)[2]
        rp = arg("rope_parameters") or {}
        rot = int(head_dim * float(arg("partial_rotary_factor") or 1.0)) // 2
        sections = list(rp.get("mrope_section") or [rot])
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _glm4_moe(w, arg, config: dict) -> None:
    """Sigmoid routing with a correction bias, grouped, scaled, renormalised."""
    import gguf

    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # shared, dense: _add_experts
    w.add_expert_weights_scale(float(arg("routed_scaling_factor") or 1.0))
    w.add_expert_weights_norm(bool(arg("norm_topk_prob")))
    w.add_expert_group_count(int(arg("n_group") or 1))
    w.add_expert_group_used_count(int(arg("topk_group") or 1))
    w.add_nextn_predict_layers(0)  # mlx-lm keeps no multi-token-prediction layer


def _exaone4_local(arg) -> list[bool] | None:
    """EXAONE 4's local ("L") layers, from its pattern string (None: every layer global)."""
    pattern = arg("sliding_window_pattern")
    if not pattern:
        return None
    return [pattern[i % len(pattern)] == "L" for i in range(int(arg("num_hidden_layers")))]


def _exaone4(w, arg, config: dict) -> None:
    """EXAONE 4's local layers (roped, windowed) beside its global ones (unroped)."""
    local = _exaone4_local(arg)
    if local is not None:
        w.add_sliding_window(int(arg("sliding_window")))
        w.add_sliding_window_pattern(local)


def _ernie_moe(w, arg, config: dict) -> None:
    """ERNIE 4.5's experts from layer moe_layer_start_index on, beside a shared MLP as wide as
    its shared experts together."""
    w.add_interleave_moe_layer_step(int(arg("moe_layer_interval", 1)))
    w.add_leading_dense_block_count(int(arg("moe_layer_start_index", 0)))
    shared = int(arg("moe_num_shared_experts", 0) or 0)
    w.add_expert_shared_count(shared)
    if shared:
        w.add_expert_shared_feed_forward_length(shared * int(arg("moe_intermediate_size")))


def _dots1(w, arg, config: dict) -> None:
    """dots.llm1: sigmoid routing with the correction bias, grouped, scaled, renormalised as
    the config says."""
    import gguf

    w.add_leading_dense_block_count(int(arg("first_k_dense_replace", 0)))
    w.add_expert_shared_count(int(arg("n_shared_experts") or 0))
    w.add_expert_weights_scale(float(arg("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(arg("norm_topk_prob")))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(int(arg("n_group") or 1))
    w.add_expert_group_used_count(int(arg("topk_group") or 1))


def _bailing(w, arg, config: dict) -> None:
    """Ling 2.0: leading dense layers, shared experts (the width per shared expert), routing
    by the config's score function with the expert bias, grouped, scaled, renormalised as the
    config says."""
    import gguf

    sigmoid = arg("score_function", "softmax") == "sigmoid"
    w.add_leading_dense_block_count(int(arg("first_k_dense_replace", 0)))
    w.add_expert_shared_count(int(arg("num_shared_experts")))
    shared = arg("moe_shared_expert_intermediate_size") or arg("moe_intermediate_size")
    w.add_expert_shared_feed_forward_length(int(shared))
    w.add_expert_weights_scale(float(arg("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(arg("norm_topk_prob")))
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
    grouped = int(arg("n_group") or 1) > 1
    w.add_expert_group_count(int(arg("n_group")) if grouped else 1)
    w.add_expert_group_used_count(int(arg("topk_group")) if grouped else 1)


def _plamo3(w, arg, config: dict) -> None:
    """PLaMo 3's sliding layers beside every pattern-th full one, as mlx-lm runs them: a
    window of window_size + 1 over a whole sequence, a RoPE base of their own."""
    layers, period = int(arg("num_hidden_layers")), int(arg("sliding_window_pattern", 8))
    w.add_sliding_window(int(arg("sliding_window") or arg("window_size", 2048)) + 1)
    w.add_sliding_window_pattern([(i + 1) % period != 0 for i in range(layers)])
    w.add_rope_freq_base_swa(float(arg("rope_local_theta", 10000.0)))


def _exaone_moe(w, arg, config: dict) -> None:
    """K-EXAONE: sliding (roped) and full (unroped) layers per layer, leading dense layers,
    sigmoid routing with the correction bias, shared experts, scaled and renormalised."""
    import gguf

    types = list(arg("layer_types"))
    w.add_sliding_window(int(arg("sliding_window")))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_leading_dense_block_count(list(arg("is_moe_layer")).index(True))
    shared = int(arg("num_shared_experts"))
    w.add_expert_shared_count(shared)
    w.add_expert_shared_feed_forward_length(shared * int(arg("moe_intermediate_size")))
    w.add_expert_weights_scale(float(arg("routed_scaling_factor")))
    w.add_expert_weights_norm(bool(arg("norm_topk_prob")) and int(arg("num_experts_per_tok")) > 1)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    grouped = int(arg("n_group") or 1) > 1 and int(arg("topk_group")) < int(arg("n_group"))
    w.add_expert_group_count(int(arg("n_group")) if grouped else 1)
    w.add_expert_group_used_count(int(arg("topk_group")) if grouped else 1)


def _afmoe(w, arg, config: dict) -> None:
    """AFMoE (Arcee Trinity): sliding layers beside every 4th full one, leading dense layers,
    routing by the config's score function with the expert bias, shared experts."""
    import gguf

    types = list(arg("layer_types"))
    w.add_sliding_window(int(arg("sliding_window")))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_leading_dense_block_count(int(arg("num_dense_layers", 0)))
    w.add_expert_shared_count(int(arg("num_shared_experts") or 0))
    w.add_expert_weights_scale(float(arg("route_scale", 1.0)))
    w.add_expert_weights_norm(bool(arg("route_norm", True)))
    sigmoid = arg("score_func", "sigmoid") == "sigmoid"
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
    grouped = int(arg("n_group") or 1) > 1 and int(arg("topk_group")) < int(arg("n_group"))
    w.add_expert_group_count(int(arg("n_group")) if grouped else 1)
    w.add_expert_group_used_count(int(arg("topk_group")) if grouped else 1)


def _llama4(w, arg, config: dict) -> None:
    """Llama 4: experts in every interleave_moe_layer_step-th layer beside a shared expert of
    their width, chunked attention and unroped layers as llama.cpp fixes them."""
    w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    w.add_interleave_moe_layer_step(int(arg("interleave_moe_layer_step")))


def _minimax(w, arg, config: dict) -> None:
    """MiniMax-M2: every layer's experts as wide as intermediate_size, sigmoid routing with the
    correction bias, renormalised."""
    import gguf

    w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _minicpm(w, arg, config: dict) -> None:
    """muP-style scales: the embeddings, each residual branch, the logits."""
    w.add_embedding_scale(float(arg("scale_emb")))
    w.add_residual_scale(float(arg("scale_depth")) / config["num_hidden_layers"] ** 0.5)
    w.add_logit_scale(float(arg("hidden_size")) / float(arg("dim_model_base")))


def _granite(w, arg, config: dict) -> None:
    """The four Granite scales, every one written: some llama.cpp builds need all."""
    w.add_attention_scale(float(arg("attention_multiplier")))
    w.add_embedding_scale(float(arg("embedding_multiplier")))
    w.add_residual_scale(float(arg("residual_multiplier")))
    w.add_logit_scale(float(arg("logits_scaling")))


def _granite_hybrid(w, arg, config: dict) -> None:
    _granite(w, arg, config)
    _add_granite_hybrid(w, arg)


def _cohere2(w, arg, config: dict) -> None:
    """Command R7B / A: sliding layers (roped) beside every pattern-th full one (unroped), a
    logit scale."""
    layers, period = config["num_hidden_layers"], int(arg("sliding_window_pattern"))
    w.add_sliding_window(int(arg("sliding_window")))
    w.add_sliding_window_pattern([(i + 1) % period != 0 for i in range(layers)])
    w.add_logit_scale(float(arg("logit_scale")))


def _mrope(w, arg, config: dict) -> None:
    """Qwen2-VL's multimodal RoPE sections (a text position is the same on every axis, so any
    split rotates alike)."""
    head_dim = head_counts(config)[2]
    scaling = arg("rope_scaling") or {}
    sections = list(scaling.get("mrope_section") or [head_dim // 2])
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _imrope(w, arg, config: dict) -> None:
    """Qwen3-VL's interleaved multimodal RoPE sections, as its converter writes them. llama.cpp
    leaves a text position's pairs past three times their section unrotated (its fourth
    position is 0): with Qwen3-VL's [24, 20, 20] of 64 pairs, the two slowest."""
    pairs = head_counts(config)[2] // 2
    scaling = arg("rope_scaling") or {}
    sections = list(
        scaling.get("mrope_section") or [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3]
    )
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


# model type -> the metadata it adds to the common keys
_EXTRA = {
    "gpt_neox": lambda w, arg, config: w.add_parallel_residual(
        bool(arg("use_parallel_residual", True))
    ),
    "qwen3_vl_text": _imrope,
    "qwen3_vl_moe_text": _imrope,
    "cohere": lambda w, arg, config: w.add_logit_scale(float(arg("logit_scale"))),
    "qwen2_vl_text": _mrope,
    "cohere2": _cohere2,
    "gemma2": _sliding,
    "gemma3_text": _sliding,
    "gpt_oss": _sliding,
    "olmo3": _sliding,
    "lfm2": _short_conv,
    "lfm2_moe": _short_conv,
    "qwen3_next": _delta_net,
    "qwen3_5_text": _delta_net,
    "qwen3_5_moe_text": _delta_net,
    "glm4_moe": _glm4_moe,
    "solar_open": _glm4_moe,
    "minimax": _minimax,
    "llama4": _llama4,
    "afmoe": _afmoe,
    "exaone_moe": _exaone_moe,
    "plamo3": _plamo3,
    "bailing_moe": _bailing,
    "dots1": _dots1,
    "ernie4_5_moe": _ernie_moe,
    "exaone4": _exaone4,
    "minicpm": _minicpm,
    "granite": _granite,
    "granitemoe": _granite,
    "granitemoehybrid": _granite_hybrid,
}


def add_hparams(w, config: dict, model=None):
    """The model's metadata as llama.cpp's loader for its architecture reads it."""
    mt, args = config["model_type"], model_args(model)
    arg = _reader(args, config)
    if mt == "mamba2":
        return _add_mamba2(w, args)
    if mt == "mamba":
        return _add_mamba(w, args)
    if mt == "openelm":
        return _add_openelm(w, model)
    if mt == "dbrx":
        return _add_dbrx(w, args)
    if mt == "falcon_h1":
        return _add_falcon_h1(w, args)
    if mt == "mimo_v2_flash":
        return _add_mimo2(w, args)
    if mt == "step3p5":
        return _add_step35(w, model)
    if mt == "minicpm3":
        return _add_minicpm3(w, args)
    if mt == "kimi_linear":
        return _add_kimi_linear(w, args)
    if mt == "nemotron-nas":
        return _add_deci(w, model)
    if FAMILIES[mt].arch in ("deepseek2", "mistral4"):
        return _add_mla(w, args, mt)
    if mt == "nemotron_h":
        return _add_nemotron_h(w, args)
    n_head, n_kv, head_dim = head_counts(config)
    layers = config["num_hidden_layers"]
    w.add_context_length(int(config.get("max_position_embeddings") or 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(layers)
    w.add_head_count(n_head)
    w.add_layer_norm_rms_eps(float(arg("rms_norm_eps") or _rms_eps(arg, mt) or 1e-5))
    w.add_vocab_size(config["vocab_size"])
    if mt == "gemma4_text":
        return _add_gemma4(w, args)
    w.add_feed_forward_length(_ffn_width(model, config))
    w.add_head_count_kv(_kv_heads(mt, arg, n_kv, layers))
    if FAMILIES[mt].arch not in UNROPED:
        _add_rope(w, arg, args, config, head_dim)
    if config.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    _add_experts(w, arg, mt)
    _layer_norm_eps(w, arg, mt)
    extra = _EXTRA.get(mt)
    if extra is not None:
        extra(w, arg, config)


# architectures with absolute positions (GPT-2's learned embeddings) or none (Mamba)
UNROPED = ("gpt2", "mamba")


def _rms_eps(arg, mt: str) -> float | None:
    """The RMSNorm epsilon of a family that names it otherwise (Qwen (1)'s
    layer_norm_epsilon)."""
    if mt in ("qwen", "exaone"):
        return arg("layer_norm_epsilon")
    return arg("norm_eps")


def _add_rope(w, arg, args, config: dict, head_dim: int) -> None:
    """The rotated share of each head and the RoPE base, as the model was built."""
    rotated = (
        arg("rotary_dim")
        or arg("rotary_pct")
        and head_dim * float(arg("rotary_pct"))  # GPT-NeoX's
        or head_dim * float(arg("partial_rotary_factor") or 1.0)
    )
    w.add_rope_dimension_count(int(rotated))
    theta = getattr(args, "rope_theta", None)  # as the model was built (config normalised)
    if theta is None and config["model_type"] == "qwen":
        theta = 10000.0  # mlx-lm's Qwen (1) rotates at MLX's default base, whatever the config
    if theta is None:
        theta = arg("rotary_emb_base")  # GPT-NeoX's
    theta = float(theta) if theta is not None else rope_base(config)
    alpha = _ntk_alpha(config)
    if alpha is not None:  # Hunyuan's NTK alpha: a larger base, as its converter writes it
        theta *= alpha ** (head_dim / (head_dim - 2))
    w.add_rope_freq_base(theta)


def _add_mla(w, args, mt: str) -> None:
    """Multi-head latent attention and routing as llama.cpp's deepseek2 reads them: one latent
    kv head of kv_lora_rank + the rotary part, decompressed per head. DeepSeek-V3's sigmoid
    routing, DeepSeek-V2's softmax one (never renormalised in mlx-lm), or no experts at all
    (Youtu)."""
    import gguf

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
    w.add_expert_weights_scale(float(getattr(args, "routed_scaling_factor", 1.0)))
    if mt != "deepseek_v2" and getattr(args, "norm_topk_prob", False):
        w.add_expert_weights_norm(True)
    softmax = ("deepseek_v2", "mistral4")  # the rest: the config's scoring function
    sigmoid = mt not in softmax and getattr(args, "scoring_func", "sigmoid") == "sigmoid"
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
    grouped = mt != "deepseek_v2" or getattr(args, "topk_method", "") == "group_limited_greedy"
    n_group, topk_group = (
        int(getattr(args, "n_group", None) or 1),
        getattr(args, "topk_group", None),
    )
    grouped = grouped and n_group > 1 and int(topk_group or 1) < n_group  # else: no groups
    w.add_expert_group_count(n_group if grouped else 1)
    w.add_expert_group_used_count(int(topk_group or 1) if grouped else 1)


def _pattern(value) -> str:
    """Nemotron-H's layer pattern as one string (configs give a string or a list)."""
    return value if isinstance(value, str) else "".join(value)


def _add_nemotron_h(w, args) -> None:
    """Nemotron-H as llama.cpp's nemotron_h_moe reads it: Mamba 2 layers (M), attention layers
    without RoPE (*) and expert layers (E), each kind's widths in per-layer arrays."""
    import gguf

    pattern = _pattern(args.hybrid_override_pattern)
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


def _add_granite_hybrid(w, arg) -> None:
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


def _add_mamba2(w, args) -> None:
    """Mamba 2 as llama.cpp's mamba2 reads it (no attention: zero heads, no MLP)."""
    w.add_context_length(int(getattr(args, "max_position_embeddings", None) or 2**20))
    w.add_embedding_length(int(args.hidden_size))
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(int(args.num_hidden_layers))
    w.add_ssm_conv_kernel(int(args.conv_kernel))
    w.add_ssm_inner_size(int(args.intermediate_size))
    w.add_ssm_state_size(int(args.state_size))
    w.add_ssm_time_step_rank(int(args.num_heads))
    w.add_ssm_group_count(int(args.n_groups))
    w.add_layer_norm_rms_eps(float(args.layer_norm_epsilon))
    w.add_vocab_size(int(args.vocab_size))


def _add_mamba(w, args) -> None:
    """Mamba 1 as llama.cpp's mamba reads it; mlx-lm's norms keep MLX's default epsilon."""
    w.add_context_length(2**20)
    w.add_embedding_length(int(args.hidden_size))
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(int(args.num_hidden_layers))
    w.add_ssm_conv_kernel(int(args.conv_kernel))
    w.add_ssm_inner_size(int(args.intermediate_size))
    w.add_ssm_state_size(int(args.state_size))
    w.add_ssm_time_step_rank(int(args.time_step_rank))
    w.add_ssm_dt_b_c_rms(bool(args.use_bcdt_rms))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(int(args.vocab_size))


def _add_openelm(w, model) -> None:
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


def _add_dbrx(w, args) -> None:
    """DBRX as llama.cpp's dbrx reads it: its attention and expert settings nested in the
    config, q/k/v clamped, LayerNorms without biases."""
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


def _add_falcon_h1(w, args) -> None:
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


def _add_mimo2(w, args) -> None:
    """MiMo-V2-Flash as llama.cpp's mimo2 reads it: sliding and full layers with heads of
    their own, attention sinks, the value scale, sigmoid routing with the correction bias
    (renormalised and unscaled, as llama.cpp fixes it)."""
    import gguf

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
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    grouped = int(args.n_group or 1) > 1 and int(args.topk_group) < int(args.n_group)
    w.add_expert_group_count(int(args.n_group) if grouped else 1)
    w.add_expert_group_used_count(int(args.topk_group) if grouped else 1)
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


def _add_step35(w, model) -> None:
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


def _add_minicpm3(w, args) -> None:
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


def _add_kimi_linear(w, args) -> None:
    """Kimi Linear as llama.cpp's kimi-linear reads it: its delta-net (KDA) layers as layers
    without kv heads, its latent attention (MLA, no RoPE) as one latent kv head, routing with
    the correction bias and shared experts."""
    import gguf

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
    w.add_expert_weights_scale(float(args.routed_scaling_factor))
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
    groups, used = int(args.num_expert_group or 1), int(args.topk_group or 1)
    grouped = args.use_grouped_topk and groups > 1 and used < groups
    w.add_expert_group_count(groups if grouped else 1)
    w.add_expert_group_used_count(used if grouped else 1)


def _add_deci(w, model) -> None:
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


def _add_gemma4(w, args) -> None:
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


def _ntk_alpha(config: dict) -> float | None:
    """Hunyuan's dynamic NTK alpha (a RoPE base raised once, at load), or None."""
    sc = config.get("rope_scaling") or {}
    if config["model_type"] == "hunyuan_v1_dense" and "alpha" in sc:
        return float(sc["alpha"])
    return None


def add_rope_scaling(w, config: dict) -> np.ndarray | None:
    """The model's RoPE scaling as llama.cpp reads it: linear as metadata, Llama 3's as the
    ``rope_freqs`` tensor (returned, for a llama file); any other kind is refused by name."""
    import gguf

    sc = config.get("rope_scaling") or {}
    if config["model_type"] in ("ministral3", "mistral4"):  # RoPE settings in rope_parameters
        sc = config.get("rope_parameters") or sc
    kind = sc.get("rope_type") or sc.get("type") or "default"
    if kind == "default" or _ntk_alpha(config) is not None:  # alpha: in the base
        return None
    arch = FAMILIES[config["model_type"]].arch
    betas = (float(sc.get("beta_fast", 32.0)), float(sc.get("beta_slow", 1.0)))
    if kind in ("yarn", "deepseek_yarn") and arch != "mistral3" and betas != (32.0, 1.0):
        raise UserInputError(
            f"llama.cpp's {arch} reads no yarn betas (it keeps 32 and 1); this model's "
            f"beta_fast and beta_slow are {betas[0]:g} and {betas[1]:g}",
            "export --format gguf",
        )
    if (
        kind == "yarn"
        and arch == "mistral4"
        and (sc.get("mscale"), sc.get("mscale_all_dim")) != (1, 1)
    ):
        raise UserInputError(
            "llama.cpp's mistral4 runs yarn as mlx-lm's Mistral 4 only with mscale and "
            "mscale_all_dim both 1; this model's differ",
            "export --format gguf",
        )
    if kind in ("yarn", "deepseek_yarn") and arch in ("deepseek2", "mistral4"):
        if sc.get("mscale", 1.0) != sc.get("mscale_all_dim", 0.0):
            raise UserInputError(
                "llama.cpp's deepseek2 reads one yarn mscale (mscale_all_dim); this model's "
                "mscale and mscale_all_dim differ",
                "export --format gguf",
            )
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(sc.get("mscale_all_dim", 0.0)))
        if arch == "mistral4" and sc.get("llama_4_scaling_beta") is not None:  # Llama 4's
            w.add_attn_temperature_scale(float(sc["llama_4_scaling_beta"]))
            w.add_attn_temperature_length(int(sc["original_max_position_embeddings"]))
        return None
    if kind == "yarn" and config["model_type"] == "ministral3":
        # Mistral's yarn: mscale_all_dim as the log multiplier, and Llama 4's position-wise
        # attention temperature (beta, over the original context)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        w.add_rope_scaling_yarn_log_mul(float(sc.get("mscale_all_dim", 0.0)))
        if sc.get("llama_4_scaling_beta") is not None:
            w.add_attn_temperature_scale(float(sc["llama_4_scaling_beta"]))
        return None
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(sc["factor"]))
        return None
    if kind == "yarn" and not {"mscale", "mscale_all_dim"} & set(sc):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        return None
    if kind == "llama3" and FAMILIES[config["model_type"]].arch in ("llama", "llama4"):
        return llama3_rope_factors(rope_base(config), head_counts(config)[2], sc)
    raise UserInputError(
        f"RoPE scaling {kind!r} of a {config['model_type']} model, as its config sets it, is "
        "not one llama.cpp reads from mlxtune's GGUF (linear, yarn without DeepSeek's mscale "
        "keys, and Llama 3's in llama files are)",
        "export --format gguf",
    )


def _ffn_width(model, config: dict) -> int:
    """The dense MLP's hidden width: LFM2 works its own out of block_ff_dim, so it is read off
    the weights there."""
    if config["model_type"] == "lfm2" and model is not None:
        for name, v in tree_flatten(model.parameters()):
            if name.endswith("feed_forward.w1.weight"):
                return int(v.shape[0])
    if config["model_type"] == "llama4":  # its dense layers' width (experts: intermediate_size)
        return int(config["intermediate_size_mlp"])
    if "intermediate_size" not in config and model is not None:  # GPT-2's: 4 x hidden
        mt, layers = config["model_type"], config["num_hidden_layers"]
        for name, v in tree_flatten(model.parameters()):
            if gguf_name(name, mt, layers) == "blk.0.ffn_up.weight":
                return int(v.shape[0])
    return int(config["intermediate_size"])
