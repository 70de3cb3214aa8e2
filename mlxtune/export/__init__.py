"""Export a trained model to the formats other tools load, and import adapters back.

- ``mlx-lm``: adapter_config.json + adapters.safetensors (mlx-lm's names: lora_a [in, r],
  lora_b [r, out], an absolute scale), loaded by ``mlx_lm.load(base, adapter_path=...)``.
- ``peft``: adapter_config.json (r, lora_alpha, target_modules, base_model_name_or_path) +
  adapter_model.safetensors (``base_model.model.<module>.lora_A.weight`` [r, in] and
  ``lora_B.weight`` [out, r]; DoRA magnitudes as ``lora_magnitude_vector``), as PEFT saves.
- ``fused``: the base with the adapters merged in, Hugging Face layout.
- ``mlx-vlm``: a vision-language run's adapters as mlx-vlm loads them
  (``mlx_vlm.load(base, adapter_path=...)``); such a run's ``fused`` export is a folder
  mlx-vlm loads (its names, its image processor), the two formats it exports to yet.

A reward model's score head goes with every format: ``fused`` writes Hugging Face's
``*ForSequenceClassification`` layout (``score.weight``, one label), ``peft`` a ``SEQ_CLS``
adapter with ``score`` among its ``modules_to_save``, and the others ``reward_head.safetensors``
(``score.weight`` [1, hidden]) beside their files.

A checkpoint is self-describing (trainer_state.json names the base model, its config, the
tokenizer and the adapter), so ``load_trained`` rebuilds the trained model from it alone.

Modules: ``weights`` (a trained model as exports read it; adapters imported back), ``mlx_lm``,
``peft``, ``fused``, ``modelfile`` (Ollama), and ``gguf`` (GGUF models and adapters).
"""

from __future__ import annotations

from pathlib import Path

from .. import qat
from ..adapters import lora_scale
from ..errors import UserInputError
from ..models import DTYPES, VisionLM, is_gguf, reward_head_aside, shadow
from .fused import dequantize, fuse, write_fused
from .gguf import codes
from .gguf.codes import refusal as gguf_refusal
from .gguf.write import write_gguf_adapter, write_gguf_model
from .mlx_lm import mlx_lm_config, write_gguf_base, write_mlx_lm, write_reward_head
from .mlx_vlm import write_mlx_vlm, write_vision_fused
from .modelfile import modelfile
from .peft import peft_refusal, peft_weights, write_peft
from .weights import (
    REWARD_HEAD_FILE,
    VALUE_HEAD_FILE,
    TrainedModel,
    adapter_modules,
    adapter_settings,
    import_adapter,
    load_trainable_weights,
    read_adapter,
    read_trainable,
    release,
)

FORMATS = ("mlx-lm", "peft", "fused", "gguf", "gguf-adapter", "mlx-vlm")


def export(
    t: TrainedModel,
    fmt: str,
    out: Path,
    dtype: str | None = None,
    quantize: int | None = None,
    group_size: int | None = None,
    consume: bool = False,
):
    """Write format ``fmt`` into the (existing, empty) folder ``out``; returns a note for the
    user, or None. ``consume``: the trained model is this export's alone (a command that
    exports once, over a base read lazily: ``load_checkpoint(..., lazy=True)``); a fused or
    GGUF export drops each of its weights once written, and the model is left empty.

    A quantization-aware run (``t.qat``) exports fused and GGUF models quantized as it trained,
    with the codes it computed with; a ``dtype`` asks for the full-precision weights instead."""
    if t.adapter["type"] == qat.LEARNED and fmt != "fused" and (fmt != "gguf" or dtype is None):
        raise UserInputError(
            "a learned quantization's scales and biases ship in its quantized model: export "
            "--format fused (MLX's quantized checkpoint, as trained); it has no adapter, and "
            "GGUF's types would round its learned scales into another form (--format gguf "
            "--dtype f16 writes its de-quantized weights)",
            "export",
        )
    if t.qat is not None and fmt in ("fused", "gguf"):
        quantize, group_size = _as_trained(t.qat, fmt, dtype, quantize, group_size)
        if fmt == "gguf":  # the GGUF's type holds the trained codes (``_export_gguf``)
            quantize = group_size = None
    if quantize is not None and fmt != "fused":
        raise UserInputError(
            "--quantize applies to fused exports (gguf has --dtype q8_0)", "export"
        )
    if isinstance(t.model, VisionLM) and fmt not in ("mlx-vlm", "fused", "peft"):
        raise UserInputError(
            f"a vision-language run exports as mlx-vlm adapters (--format mlx-vlm), PEFT "
            f"adapters or a fused model; {fmt} exports of vision-language models are not "
            "written yet",
            "export",
        )
    if isinstance(t.model, VisionLM) and fmt == "fused":
        if quantize is not None:
            raise UserInputError("--quantize is for text models' fused exports", "--quantize")
        if dtype is not None and dtype not in DTYPES:
            raise UserInputError(f"--dtype for fused must be one of {', '.join(DTYPES)}", "export")
        write_vision_fused(t, out, dtype)
    elif fmt == "mlx-vlm":
        write_mlx_vlm(t, out)
    elif fmt == "mlx-lm":
        if t.adapter["type"] == "full":
            raise UserInputError(
                "mlx-lm adapters hold LoRA/DoRA weights; a full fine-tune exports as fused",
                "export",
            )
        write_mlx_lm(t, out)
    elif fmt == "peft":
        write_peft(t, out)
    elif fmt == "fused":
        if dtype is not None and dtype not in DTYPES:
            raise UserInputError(f"--dtype for fused must be one of {', '.join(DTYPES)}", "export")
        return write_fused(t, out, dtype, quantize, group_size or 64, consume)
    elif fmt == "gguf":
        _export_gguf(t, out, dtype, consume)
    elif fmt == "gguf-adapter":
        if t.adapter["type"] != "lora":
            raise UserInputError(
                "gguf-adapter holds LoRA weights; export a full or DoRA run as gguf", "export"
            )
        # the file's alpha is read as alpha / rank: rsLoRA's scale goes in as scale x rank
        a = t.adapter
        alpha = lora_scale(a["alpha"], a["rank"], a.get("rslora", False)) * a["rank"]
        path = write_gguf_adapter(t.model, t.model_config, alpha, out)
        write_reward_head(t.model, out)
        if t.base_dir:  # Ollama runs the adapter over the base it was trained on
            base = str(Path(t.base_dir).resolve())
            text = modelfile(t.tokenizer, base, f"./{path.name}", base_dir=t.base_dir)
            (out / "Modelfile").write_text(text)
    else:
        raise UserInputError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}", "export")


def _as_trained(spec: dict, fmt: str, dtype, quantize, group_size):
    """(quantize, group_size) of a quantization-aware run's fused or GGUF export: as it
    trained, unless ``dtype`` asks for full precision; another quantization is refused."""
    trained = f"this run trained quantization-aware at {qat.Spec(**spec).describe()}"
    if quantize is not None and (quantize, group_size or spec["group_size"], "affine") != (
        spec["bits"],
        spec["group_size"],
        spec["mode"],
    ):
        raise UserInputError(
            f"{trained}; other codes would lose what it learned: leave --quantize out (the "
            "export is quantized as it trained) or give --dtype for full precision",
            "--quantize",
        )
    if dtype is not None and quantize is None:
        return None, None  # full precision, asked for
    if dtype is not None:
        raise UserInputError(f"{trained}; give --dtype or --quantize, not both", "--dtype")
    if fmt == "gguf" and (why := gguf_refusal(spec)) is not None:
        raise UserInputError(f"{trained}. {why} (or give --dtype f16)", "export --format gguf")
    return spec["bits"], spec["group_size"]


def _export_gguf(t: TrainedModel, out: Path, dtype: str | None, consume: bool) -> None:
    """The ``gguf`` format: the fused model as one GGUF file, a Modelfile beside it (and a
    reward model's head)."""
    # a GGUF base names the file after itself, without its .gguf
    name = (
        (Path(t.base_dir).stem if Path(t.base_dir).is_file() else Path(t.base_dir).name)
        if t.base_dir
        else "model"
    )
    # the merge is lazy, on a copy the writer consumes: one weight computed at a time
    rows: dict = {}  # a large weight de-quantized a block of rows at a time
    trained_codes = None
    if t.qat is not None and dtype is None:  # the codes QAT computed with, as GGUF blocks
        layers = dict(t.model.named_modules())
        paths = qat.prepared(t.model)
        trained_codes = {
            "spec": t.qat,
            "names": {f"{p}.weight" for p in paths},
            # the dtype QAT quantized in (a lazy graph's: nothing computed)
            "dtype": qat.merged_weight(layers[paths[0]]).dtype,
        }
    model, config = dequantize(fuse(shadow(t.model)), t.model_config, rows=rows)
    source = Path(t.base_dir) if t.base_dir and is_gguf(t.base_dir) else None
    write_reward_head(t.model, out)
    if consume:
        release(t.model)
    with reward_head_aside(model):  # GGUF holds the language model; the head goes beside
        try:
            path = write_gguf_model(
                model, config, t.tokenizer, t.tokenizer_dir, out, dtype or "f16", name, source,
                consume=True, rows=rows, trained_codes=trained_codes,
            )  # fmt: skip
        except codes.CodesError as e:  # a shape the trained codes' GGUF type cannot pack
            raise UserInputError(
                f"{e} (export --dtype f16 for full precision)", "export --format gguf"
            ) from None
    del model
    rows.clear()
    text = modelfile(t.tokenizer, f"./{path.name}", base_dir=t.base_dir)
    (out / "Modelfile").write_text(text)


__all__ = [
    "FORMATS",
    "REWARD_HEAD_FILE",
    "TrainedModel",
    "VALUE_HEAD_FILE",
    "adapter_modules",
    "adapter_settings",
    "dequantize",
    "export",
    "fuse",
    "import_adapter",
    "load_trainable_weights",
    "mlx_lm_config",
    "modelfile",
    "peft_refusal",
    "peft_weights",
    "read_adapter",
    "read_trainable",
    "write_fused",
    "write_gguf_base",
    "write_mlx_lm",
    "write_mlx_vlm",
    "write_vision_fused",
    "write_peft",
    "write_reward_head",
]
