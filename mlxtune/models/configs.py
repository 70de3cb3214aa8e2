"""A model's config.json as mlx-lm's module for its family reads it.

transformers 5 writes some keys differently from the configs mlx-lm's modules were written
against: the RoPE base and scaling only inside ``rope_parameters`` (per layer type for families
with sliding-window layers), and the sliding-window layout as ``layer_types``. A module that
reads only the older keys would build the model silently at its defaults (a llama saved by
transformers 5 with a base of 100000 would run at 10000). ``normalise_config`` gives each module
the keys it reads, with the values transformers itself uses (``rope_parameters`` wins over a
top-level key, as it does in transformers), and refuses a setting the module cannot honour.
"""

from __future__ import annotations

import inspect

from ..errors import UserInputError
from .common import family_classes

# the per-layer-type sections of a nested ``rope_parameters``
_FULL, _SLIDING = "full_attention", "sliding_attention"
_LINEAR = "linear_attention"  # a hybrid's linear-attention layers (Qwen3-Next, Qwen3.5)


def args_fields(args_class) -> set[str]:
    """The config keys a family's ``ModelArgs`` takes (what its ``from_dict`` keeps)."""
    return set(inspect.signature(args_class).parameters)


def _annotated_str(args_class, name: str) -> bool:
    """Whether the family's ModelArgs declares ``name`` a string (``str`` or ``Optional[str]``)."""
    param = inspect.signature(args_class).parameters.get(name)
    if param is None:
        return False
    note = param.annotation
    return (
        note is str
        or (isinstance(note, str) and "str" in note)
        or str in getattr(note, "__args__", ())
    )


def _rope_type(params: dict) -> str:
    return params.get("rope_type") or params.get("type") or "default"


def _scaling(params: dict) -> dict | None:
    """A ``rope_parameters`` section as the ``rope_scaling`` dict mlx-lm reads (None for the
    plain rotation): both spellings of its type, the base left out."""
    kind = _rope_type(params)
    if kind == "default":
        return None
    out = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    out["type"] = out["rope_type"] = kind
    return out


def _check_rope_type(scaling: dict | None, where: str) -> None:
    """Refuse a RoPE type mlx-lm's rope builder does not know (it would fail later, or a
    family's own code would ignore it)."""
    if scaling is None:
        return
    from mlx_lm.models.rope_utils import initialize_rope

    try:
        initialize_rope(8, 10000.0, False, dict(scaling), 4096)
    except (ValueError, KeyError, TypeError) as e:
        raise UserInputError(
            f"RoPE type {_rope_type(scaling)!r} cannot be run by mlx-lm's rope ({type(e).__name__}: {e})",
            where,
        ) from None


def _sliding_pattern(layer_types: list, where: str) -> int:
    """mlx-lm's ``sliding_window_pattern`` (every n-th layer is full attention, the rest slide)
    that gives ``layer_types`` (the model's length + 1 when every layer slides); the same for
    a hybrid's ``full_attention_interval`` (the rest linear attention)."""
    n = len(layer_types)
    for p in range(1, n + 2):
        if all((t == _FULL) == ((i + 1) % p == 0) for i, t in enumerate(layer_types)):
            return p
    raise UserInputError(
        f"layer_types {layer_types} is not 'every n-th layer is full attention', the only "
        "layout this family's mlx-lm module builds",
        where,
    )


def normalise_config(config: dict, args_class, where: str = "config.json") -> dict:
    """``config`` with the keys ``args_class`` (the family's ModelArgs) reads filled in from the
    ones transformers 5 writes. ``where`` names the file in errors. The input is not changed."""
    config = dict(config)
    fields = args_fields(args_class)
    if isinstance(config.get("text_config"), dict):
        # a multimodal wrapper builds its language model from text_config
        text = config["text_config"]
        text_class = _text_args_class(text)
        if text_class is not None:
            config["text_config"] = normalise_config(text, text_class, where + " text_config")
    _aliased(config, fields)
    _legacy_layer_types(config, fields, args_class)
    rp = config.get("rope_parameters")
    # a top-level rope_scaling wins where both are given (transformers reads it first)
    if (
        isinstance(rp, dict)
        and rp
        and "rope_parameters" not in fields
        and not config.get("rope_scaling")
    ):
        _from_rope_parameters(config, rp, fields, where)
    lt = config.get("layer_types")
    if (
        isinstance(lt, list)
        and "layer_types" not in fields
        and "sliding_window_pattern" in fields
        and set(lt) <= {_FULL, _SLIDING}
    ):
        period = _sliding_pattern(lt, f"{where} layer_types")
        if _annotated_str(args_class, "sliding_window_pattern"):
            # a family that reads the pattern as letters (EXAONE 4: "LLLG"): a string the
            # config gives is kept, else the period is written in its letters
            if not isinstance(config.get("sliding_window_pattern"), str):
                letters = "".join("G" if (i + 1) % period == 0 else "L" for i in range(period))
                config["sliding_window_pattern"] = letters
        else:
            config["sliding_window_pattern"] = period
    if (
        isinstance(lt, list)
        and "layer_types" not in fields
        and "full_attention_interval" in fields
        and "full_attention_interval" not in config
        and set(lt) <= {_FULL, _LINEAR}
    ):
        config["full_attention_interval"] = _sliding_pattern(lt, f"{where} layer_types")
    return config


def _aliased(config: dict, fields: set) -> None:
    """Keys transformers 5 writes under another name than the one mlx-lm reads (Qwen3-MoE's
    ``num_local_experts`` for ``num_experts``), by the config class's own ``attribute_map``."""
    try:
        from transformers import CONFIG_MAPPING

        aliases = CONFIG_MAPPING[config.get("model_type")].attribute_map
    except (KeyError, ImportError, AttributeError):
        return
    for a, b in aliases.items():
        for want, have in ((a, b), (b, a)):
            if want in fields and want not in config and have in config:
                config[want] = config[have]


# the layer-type names transformers 5 writes -> the names checkpoints used before
_LEGACY = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}


def _legacy_layer_types(config: dict, fields: set, args_class) -> None:
    """``layer_types`` in the names the family's mlx-lm module compares against (Granite 4
    hybrids read "mamba"/"attention", which transformers 5 writes as "linear_attention"/
    "full_attention"): only names the module's source spells and the new one it does not."""
    lt = config.get("layer_types")
    if "layer_types" not in fields or not isinstance(lt, list):
        return
    try:
        source = inspect.getsource(inspect.getmodule(args_class))
    except (OSError, TypeError):
        return
    back = {
        new: old
        for old, new in _LEGACY.items()
        if f'"{old}"' in source and f'"{new}"' not in source
    }
    if any(t in back for t in lt):
        config["layer_types"] = [back.get(t, t) for t in lt]


# rope_parameters' keys -> the names some families' mlx-lm modules read them by
_ROPE_NAMES = (("rope_theta", "rotary_emb_base"), ("partial_rotary_factor", "rotary_pct"))


def _from_rope_parameters(config: dict, rp: dict, fields: set, where: str) -> None:
    nested = {k: v for k, v in rp.items() if k in (_FULL, _SLIDING) and isinstance(v, dict)}
    full = nested.get(_FULL, rp if not nested else None)
    sliding = nested.get(_SLIDING)
    key = f"{where} rope_parameters"
    if full is not None:
        if "rope_theta" in full:
            config["rope_theta"] = full["rope_theta"]
        if "partial_rotary_factor" in full and "partial_rotary_factor" in fields:
            config["partial_rotary_factor"] = full["partial_rotary_factor"]
        for name, mlx_lm_name in _ROPE_NAMES:  # the family's own names for them (GPT-NeoX's)
            if name in full and mlx_lm_name in fields and mlx_lm_name not in config:
                config[mlx_lm_name] = full[name]
        scaling = _scaling(full)
        if scaling is None and "rope_scaling" in fields and "rope_scaling" not in config:
            config["rope_scaling"] = None  # a family whose ModelArgs requires the key (GLM-4 MoE)
        if scaling is not None:
            if "rope_scaling" not in fields:
                raise UserInputError(
                    f"asks for RoPE type {_rope_type(full)!r}, and this family's mlx-lm module "
                    "reads no RoPE scaling: it would run the plain rotation",
                    key,
                )
            _check_rope_type(scaling, key)
            config["rope_scaling"] = scaling
    if sliding is not None:
        if _rope_type(sliding) != "default":
            raise UserInputError(
                f"asks for RoPE type {_rope_type(sliding)!r} on sliding-window layers, which "
                "mlx-lm's modules rotate plainly",
                key,
            )
        theta = sliding.get("rope_theta")
        if theta is not None:
            if "rope_local_base_freq" in fields:
                config["rope_local_base_freq"] = theta
            elif full is not None and theta != full.get("rope_theta"):
                raise UserInputError(
                    f"gives sliding-window layers their own RoPE base ({theta}), which this "
                    "family's mlx-lm module does not read",
                    key,
                )


def _text_args_class(text: dict):
    mt = text.get("model_type")
    if not isinstance(mt, str):
        return None
    try:
        from mlx_lm.utils import _get_classes

        return _get_classes(text)[1]
    except (ValueError, ImportError):
        return None


def rope_base(config: dict) -> float:
    """The RoPE base a config's model runs at: its own key, else inside ``rope_parameters``,
    else its family's default."""
    args_class = family_classes(config)[1]
    theta = normalise_config(config, args_class).get("rope_theta")
    rp = config.get("rope_parameters")
    if theta is None and isinstance(rp, dict):  # a family that reads rope_parameters itself
        theta = rp.get(_FULL, rp).get("rope_theta")
    if theta is None:
        p = inspect.signature(args_class).parameters.get("rope_theta")
        theta = None if p is None or p.default is inspect.Parameter.empty else p.default
    if theta is None:
        raise UserInputError("no rope_theta, and its family has no default", "config.json")
    return float(theta)


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


def text_config(cfg: dict) -> dict:
    """The language model's config: a multimodal wrapper's ``text_config``, else ``cfg``."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def _widest(width) -> int:
    """A width as configs write it: one number, or one per layer (Gemma 3n's MLP widths)."""
    if isinstance(width, (list, tuple)):
        return max((int(w) for w in width if w), default=0)
    return int(width or 0)


def active_intermediate(cfg: dict, hidden: int) -> int:
    """The MLP width a token's activations take: a mixture of experts' top-k experts (and its
    shared expert) each keep theirs."""
    dense = _widest(cfg.get("intermediate_size")) or 4 * hidden
    k = cfg.get("num_experts_per_tok")
    if not isinstance(k, int) or k < 1:
        return dense
    expert = _widest(cfg.get("moe_intermediate_size")) or dense
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    shared += expert * int(cfg.get("n_shared_experts") or 0)
    return max(dense, k * expert + shared)
