"""Llama 3's RoPE scaling as llama.cpp holds it: a ``rope_freqs`` tensor of per-frequency
divisors instead of settings. Written from the settings on export, and the settings read back
from the tensor on import (checked to give the very same divisors)."""

from __future__ import annotations

import numpy as np

from ..errors import UserInputError
from .tensors import dequantized

# llama.cpp architectures whose graph divides the rotary frequencies by a ``rope_freqs`` tensor
# (what its converter writes for a config with Llama 3's scaling). Falcon-H1's loads the tensor
# and does not use it: not listed, so that its Llama 3 scaling is refused rather than lost.
LLAMA3_ROPE_ARCHS = frozenset(
    {
        "llama",
        "llama4",
        "apertus",
        "deci",
        "exaone",
        "exaone4",
        "exaone-moe",
        "granite",
        "granitemoe",
        "minicpm",
    }
)

# mlx-lm's (and transformers') defaults for the settings a config may leave out
_DEFAULTS = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _wavelengths(base: float, head_dim: int) -> np.ndarray:
    return 2 * np.pi * float(base) ** (np.arange(0, head_dim, 2) / head_dim)


def llama3_rope_factors(base: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The divisor of each rotary frequency: 1 for short wavelengths, ``factor`` for long ones,
    a smooth blend between."""
    s = {**_DEFAULTS, **{k: v for k, v in scaling.items() if k in _DEFAULTS}}
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old = float(s["original_max_position_embeddings"])
    wavelen = _wavelengths(base, head_dim)
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high: no blended band
        smooth = (old / wavelen - low) / (high - low)
        blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return out.astype(np.float32)


def llama3_settings(factors: np.ndarray, base: float, head_dim: int) -> dict | None:
    """Llama 3 settings giving ``factors`` (None when no settings do). The original context is
    not determined by the divisors alone; 8192 is taken and the two thresholds fitted to it."""
    f = np.asarray(factors, np.float64).reshape(-1)
    wavelen = _wavelengths(base, head_dim)
    if f.shape != wavelen.shape or (f <= 0).any():
        return None
    factor = float(f.max())
    if factor <= 1.0:
        return None
    old = float(_DEFAULTS["original_max_position_embeddings"])
    tol = 1e-4 * factor
    middle = (f > 1 + tol) & (f < factor - tol)
    ones, full = wavelen[f <= 1 + tol], wavelen[f >= factor - tol]
    if not len(ones) or not len(full):
        return None
    if middle.sum() >= 2:
        # 1/f = (1 - s)/factor + s with s = (old/w - low)/(high - low): s is linear in 1/w
        s = (1 / f[middle] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[middle], s, 1)
        if a <= 0:
            return None
        low = -b * old / a
        high = low + old / a
    else:  # the long-wavelength threshold between the blended (or undivided) and the divided
        low = old / ((full.min() + wavelen[wavelen < full.min()].max()) / 2)
        if middle.any():  # one blended frequency fixes the other threshold
            s = (1 / f[middle][0] - 1 / factor) / (1 - 1 / factor)
            high = low + (old / wavelen[middle][0] - low) / s
        else:
            high = old / ((ones.max() + wavelen[wavelen > ones.max()].min()) / 2)
    settings = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(old),
    }
    again = llama3_rope_factors(base, head_dim, settings)
    return settings if np.allclose(again, f, rtol=1e-4, atol=1e-6) else None


def rope_settings(g, config: dict, fields: set) -> dict:
    """A GGUF file's RoPE settings in the config keys the family reads (``fields``): partial
    rotation, linear, yarn and Llama 3 scaling; what mlxtune cannot read is refused."""
    where, head_dim, out = str(g.path), config["head_dim"], {}
    rope_dims = g.get("rope.dimension_count", head_dim)
    if config["model_type"] == "phi3":
        out["partial_rotary_factor"] = rope_dims / head_dim
        out["original_max_position_embeddings"] = int(
            g.get("rope.scaling.original_context_length") or config["max_position_embeddings"]
        )
        if "rope_factors_long.weight" in g.tensors:
            raise UserInputError(
                "this phi3 model uses long-context rope factors (LongRoPE), which mlxtune "
                "does not read from GGUF yet",
                where,
            )
    elif config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text"):
        sections = [int(x) for x in g.get("rope.dimension_sections", [])][:3]
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": config["rope_theta"],
            "partial_rotary_factor": rope_dims / head_dim,
            "mrope_section": sections or [rope_dims // 2, 0, 0],
        }
    elif rope_dims != head_dim and "partial_rotary_factor" in fields:
        out["partial_rotary_factor"] = rope_dims / head_dim
    elif "rotary_dim" in fields:  # the rotated share as a width (MiniMax)
        out["rotary_dim"] = int(rope_dims)
    elif "rotary_pct" in fields:  # GPT-NeoX's
        out["rotary_pct"] = rope_dims / head_dim
    elif rope_dims != head_dim:
        raise UserInputError(
            f"{g.arch}.rope.dimension_count is {rope_dims}, not the head size {head_dim}, and "
            f"mlx-lm's {config['model_type']} rotates whole heads",
            where,
        )
    scaling = g.get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = g.get("rope.scaling.factor")
        original = g.get("rope.scaling.original_context_length")
        if scaling == "linear" and factor is not None:
            out["rope_scaling"] = {"type": "linear", "factor": float(factor)}
        elif scaling == "yarn" and factor is not None and original is not None:
            out["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": float(factor),
                "original_max_position_embeddings": int(original),
                "beta_fast": float(g.get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(g.get("rope.scaling.yarn_beta_slow", 1.0)),
            }
            for key in ("yarn_ext_factor", "yarn_attn_factor"):
                if g.get(f"rope.scaling.{key}") not in (None, 1.0):
                    raise UserInputError(
                        f"{g.arch}.rope.scaling.{key} is not 1, which mlx-lm's yarn cannot run",
                        where,
                    )
        else:
            raise UserInputError(
                f"rope scaling {scaling!r} is not read from GGUF (linear with a factor, and yarn "
                "with its original context, are)",
                where,
            )
    out.update(rope_freqs_settings(g, config, fields, head_dim))
    return out


def rope_freqs_settings(g, config: dict, fields: set, head_dim: int) -> dict:
    """The ``rope_scaling`` a file's ``rope_freqs`` tensor stands for ({} without one): Llama
    3's, where llama.cpp's architecture divides by it and the family reads ``rope_scaling``;
    any other is refused by name."""
    if "rope_freqs.weight" not in g.tensors or config["model_type"] == "gemma4_text":
        return {}  # Gemma 4's proportional rope: its own reading
    settings = None
    if (
        g.arch in LLAMA3_ROPE_ARCHS
        and "rope_scaling" in fields
        and g.get("rope.scaling.type") in (None, "none")
    ):
        factors = dequantized(g.tensors["rope_freqs.weight"])
        settings = llama3_settings(factors, config["rope_theta"], head_dim)
    if settings is None:
        raise UserInputError(
            "this model scales its rope frequencies per dimension (rope_freqs) in a way "
            "that is not Llama 3's, which mlxtune does not read",
            str(g.path),
        )
    return {"rope_scaling": settings}


__all__ = [
    "LLAMA3_ROPE_ARCHS",
    "llama3_rope_factors",
    "llama3_settings",
    "rope_freqs_settings",
    "rope_settings",
]
