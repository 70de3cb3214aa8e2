"""What GGUF knows of a family: how llama.cpp holds its tensors (``Family``), and, for a family
kept in a module of its own (``mlxtune.gguf.families``), everything else both directions read
(``FamilyFacts``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How llama.cpp holds one mlx-lm model type."""

    arch: str  # general.architecture
    permuted: bool = False  # q/k rows in llama.cpp's interleaved rope order (its LlamaModel)
    norm_plus_one: bool = False  # a (1 + w) RMSNorm, stored as w + 1 (gemma)
    # the router's top-k weights renormalised, as llama.cpp's graph for the arch fixes it
    # (None: the arch has no experts)
    norm_topk: bool | None = None


@dataclass(frozen=True)
class FamilyFacts:
    """One family's GGUF facts in one place, read by the export and by the import alike: its
    names, the metadata written for it, its config read back from that metadata, and what
    llama.cpp fixes for its architecture that a model may do otherwise."""

    model_type: str
    """mlx-lm's model type."""
    names: Family
    write_settings: Callable | None = None
    """``(writer, model_args)``: the metadata llama.cpp's loader reads, written whole."""
    read_config: Callable | None = None
    """``(GGUFModelFile, need)`` -> the Hugging Face config read back whole (``need(key)``: a
    metadata key the file must hold); the import adds ``architectures``."""
    refusal: Callable | None = None
    """``(arg, model_type)`` -> why llama.cpp would run this model otherwise, or None
    (``arg(name)``: the model's setting)."""
