"""What ``generate`` and ``chat`` talk to: a model folder (a fused export too), a GGUF file or a
Hub id, or an mlxtune run's trained model, with an mlx-lm or PEFT adapter over it."""

from __future__ import annotations

from pathlib import Path

from ..adapters import apply_adapters
from ..errors import UserInputError
from ..export import adapter_modules, adapter_settings, import_adapter
from ..models import load_model, resolve_model_path
from ..tokenizer import model_tokenizer
from .checkpoint import load_trained


def load_for_generation(
    model: str | Path, adapter: str | Path | None = None, scale: float | None = None, warn=None
):
    """(model, tokenizer) from a Hugging Face layout directory (a fused export too) or an mlxtune
    run/checkpoint, with an optional mlx-lm or PEFT adapter; ``scale`` multiplies the adapter's.
    ``warn(message)`` hears of damaged checkpoints passed over in a run."""
    p = Path(model)
    if (p / "trainer_state.json").exists() or (p / "checkpoints").is_dir():
        t = load_trained(p, warn)
        m, tok = t.model, t.tokenizer
    else:
        path = resolve_model_path(str(model), None)
        m, _ = load_model(path)
        tok = model_tokenizer(path)
    if adapter is not None:
        s = adapter_settings(adapter)
        if s["type"] not in ("lora", "dora"):
            raise UserInputError(
                f"a {s['type']!r} adapter holds whole weights; load it as --model", str(adapter)
            )
        apply_adapters(
            m, s["type"], s["rank"], s["alpha"], 0.0, s["targets"], s["layers"], s["rslora"]
        )
        import_adapter(m, adapter)
    if scale is not None:
        mods = adapter_modules(m)
        if not mods:
            raise UserInputError(
                "--scale needs an adapter (--adapter, or a LoRA/DoRA run)", "--scale"
            )
        for _, mod in mods:
            mod.scale = mod.scale * scale
    m.eval()
    return m, tok
