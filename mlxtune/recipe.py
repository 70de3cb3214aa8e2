"""The recipe: one YAML file that describes a whole run, as typed, validated dataclasses.

Each field carries a docstring (the string under it); ``field_docs`` reads them back, so the
schema is also the documentation. ``load_recipe`` reads YAML with ``safe_load`` semantics only,
applies ``key.sub=value`` overrides, and turns every problem into a ``UserInputError`` naming
the file, line and key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .errors import UserInputError
from .rundir import NOT_PLAIN, NOT_UNDER_HERE, is_plain_name, is_under_here

# --------------------------------------------------------------------------------------------
# Schema


@dataclass
class TokenizerTrainConfig:
    """Train a sentencepiece tokenizer on the recipe's training data."""

    vocab_size: int = 1000
    """Vocabulary size, special tokens included."""
    model_type: Literal["unigram", "char"] = "unigram"
    """sentencepiece model type: "unigram" (sub-words) or "char" (one token per character)."""
    character_coverage: float = 1.0
    """Share of characters the vocabulary must cover (sentencepiece's character_coverage)."""
    max_sentences: int = 200000
    """At most this many training texts are fed to the tokenizer trainer."""


@dataclass
class TokenizerConfig:
    """Where the tokenizer comes from."""

    path: str | None = None
    """A directory with tokenizer files; by default the model's own directory."""
    train: TokenizerTrainConfig | None = None
    """Train a new sentencepiece tokenizer on the training data instead of loading one."""
    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's own."""


@dataclass
class QuantizeConfig:
    """Quantize the base model when it loads (QLoRA): its linear layers and embedding are held
    in bits per weight, the adapters train in full precision on top."""

    bits: Literal[4, 8] = 4
    """Bits per weight: 4 or 8."""
    group_size: Literal[32, 64, 128] = 64
    """Weights per scale and bias; a layer whose input size is not a multiple of it stays
    unquantized."""


@dataclass
class ModelConfig:
    """The model to train: a local directory in Hugging Face layout, a Hub id, or an architecture."""

    path: str | None = None
    """A local model directory (config.json + *.safetensors) or a Hugging Face Hub id."""
    arch: dict | None = None
    """Build a new model from this architecture config (Hugging Face config.json keys, with
    model_type) and train it from scratch; vocab_size defaults to the tokenizer's."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model's floating-point weights during training."""
    trust_remote_code: bool = False
    """Allow a model directory to run its own Python code (config.json's model_file)."""
    seed: int = 0
    """Seed for the random initialisation of a model built from arch."""
    quantize: QuantizeConfig | None = None
    """Quantize the base as it loads, for example {bits: 4, group_size: 64} (QLoRA: LoRA or DoRA
    adapters train on the quantized base); null keeps the weights as they are. A model that is
    quantized already (config.json with "quantization") loads quantized without this."""


@dataclass
class DataConfig:
    """Training and evaluation data: JSONL files, one example per line."""

    train: str = ""
    """Training JSONL file (paths are relative to the recipe file)."""
    valid: str | None = None
    """Validation JSONL file; when absent, valid_fraction of train is held out."""
    test: str | None = None
    """Held-out JSONL file for the task metric (exact match); defaults to the validation set."""
    format: Literal["auto", "text", "completion", "instruction", "chat", "tokens"] = "auto"
    """Example format; "auto" detects it from the keys of the first example."""
    max_length: int = 2048
    """Longest example in tokens; longer ones are truncated or dropped (see overlong)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What to do with examples longer than max_length."""
    min_length: int = 2
    """Examples shorter than this many tokens are dropped."""
    mask_prompt: bool = True
    """Compute the loss on completions/assistant turns only, not on prompts."""
    add_eos: bool = True
    """Append the end-of-sequence token, which the model learns to produce."""
    valid_fraction: float = 0.05
    """Share of the training file held out for validation when no valid file is given."""
    bucket_size: int = 16
    """Batches are formed from groups of bucket_size x batch_size examples sorted by length,
    which keeps padding small; 1 turns bucketing off."""
    pad_to_multiple: int = 8
    """Batch lengths are rounded up to a multiple of this, so few shapes are compiled."""
    packing: Literal["off", "pack", "stream"] = "off"
    """"pack": several examples share a row of pack_length tokens (best-fit), each attending only
    to itself; "stream": the examples, in a shuffled order, as one token stream cut into rows
    (pretraining text; documents run on into the next row and are not truncated); "off": one
    example a row, padded."""
    pack_length: int | None = None
    """Tokens per packed row; default max_length (pack needs at least max_length)."""
    mask_boundary_loss: bool = True
    """Packed rows: never train on a document's first token predicted from the one before it."""
    train_on_eos: bool = True
    """With add_eos: the EOS token is a target (the model learns to stop); false keeps it as a
    separator only."""


@dataclass
class AdapterConfig:
    """Which weights train: LoRA, DoRA or full fine-tuning."""

    type: Literal["lora", "dora", "full"] = "lora"
    """"lora", "dora" (weight-decomposed LoRA) or "full" (every weight trains)."""
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Linear layers to adapt, by name (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj, ...), or ["all-linear"]."""
    layers: Any = None
    """Transformer layers to adapt: null (all), N (the last N), "a-b" (a to b inclusive) or a
    list of layer indices."""
    init_from: str | None = None
    """Start from an existing mlx-lm or PEFT adapter directory (its rank and layers must match)."""


@dataclass
class OptimizerConfig:
    """The optimizer. Weight decay applies to matrices only, never to norms or biases."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    """"adamw" (decoupled weight decay), "adam" or "sgd" (with momentum)."""
    lr: float = 1e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's beta1 and beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    bias_correction: bool = True
    """Adam's bias correction of the moment estimates (as in the Adam paper and PyTorch)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to weights with two or more dimensions."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; null turns clipping off (grad_norm is still
    reported)."""


@dataclass
class ScheduleConfig:
    """The learning-rate schedule, as a function of the optimizer step."""

    name: Literal["constant", "linear", "cosine", "warmup_cosine"] = "cosine"
    """"constant", "linear" (decay to min_lr), "cosine" (to min_lr), or "warmup_cosine"
    (cosine with a warmup of 5% of the steps unless warmup_steps is set)."""
    warmup_steps: int | None = None
    """Linear warmup from 0 to lr over this many optimizer steps."""
    min_lr: float = 0.0
    """The learning rate the decaying schedules end at."""


@dataclass
class TrainConfig:
    """The training loop."""

    batch_size: int = 4
    """Examples per micro-batch."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step; gradients are weighted by valid tokens."""
    max_steps: int | None = None
    """Optimizer steps to train for; when absent, epochs decides."""
    epochs: float | None = None
    """Passes over the training data (may be fractional); used when max_steps is absent."""
    seed: int = 0
    """Seed for data order, dropout and adapter initialisation."""
    log_every: int = 10
    """Write a metrics row and a console line every N optimizer steps."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy, in [0, 1)."""
    progress: bool = True
    """Show a progress bar with ETA when writing to a terminal."""
    grad_checkpointing: bool | int = False
    """Recompute transformer blocks' activations in the backward pass instead of keeping them
    (less memory, more compute): true for every block, an integer k for every k-th (blocks 0,
    k, 2k, ...), false for none."""


@dataclass
class EvalConfig:
    """Validation loss, perplexity and a task metric."""

    every: int | None = 100
    """Evaluate every N optimizer steps (and always at the end); null: only at the end."""
    max_batches: int | None = None
    """Evaluate on at most this many validation batches; null: the whole validation set."""
    batch_size: int | None = None
    """Validation batch size; defaults to the training batch size."""
    exact_match: int = 0
    """Greedy-generate answers for this many held-out prompts before and after training and
    report the exact-match accuracy (completion, instruction and chat data); 0 turns it off."""
    max_new_tokens: int = 64
    """Longest generated answer for the exact-match metric."""


@dataclass
class SamplesConfig:
    """Generation samples written to samples.jsonl while training."""

    every: int | None = None
    """Generate samples every N optimizer steps (and at the end); null: off."""
    prompts: list[str] = field(default_factory=list)
    """Prompts to complete; when empty, the first validation prompts are used."""
    count: int = 2
    """How many validation prompts to use when prompts is empty."""
    max_new_tokens: int = 64
    """Longest sample."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""


@dataclass
class CheckpointConfig:
    """Checkpoints: safetensors of the trainable weights, with metadata."""

    every: int | None = None
    """Save a checkpoint every N optimizer steps; null: only final (and best)."""
    keep_last: int = 3
    """Keep the last K step checkpoints; older ones are deleted."""
    save_best: bool = True
    """Keep a copy of the checkpoint with the lowest validation loss in checkpoints/best."""
    save_final: bool = True
    """Save checkpoints/final at the end of training."""


@dataclass
class ExportConfig:
    """What the run writes into RUN_DIR/export when training ends."""

    formats: list[Literal["mlx-lm", "peft", "fused", "gguf", "gguf-adapter"]] = field(
        default_factory=list
    )
    """"mlx-lm": an adapter mlx-lm loads; "peft": an adapter PEFT loads; "fused": the model with
    the adapters merged in, Hugging Face layout (config.json, model.safetensors, tokenizer);
    "gguf": the fused model for llama.cpp (f16); "gguf-adapter": a LoRA adapter for llama.cpp's --lora."""


@dataclass
class KernelsConfig:
    """Which implementation of the fused operations the trainer uses."""

    loss: Literal["auto", "reference", "chunked", "metal", "cuda"] = "auto"
    """linear_cross_entropy tier: "auto" (MLXTUNE_KERNELS, else the best for the device),
    "reference" (builds the [tokens, vocab] logits), "chunked" (portable MLX, never builds them),
    or the GPU kernels, "metal" or "cuda" (where MLX has that backend)."""
    attention: Literal["auto", "reference", "chunked", "metal", "cuda", "off"] = "auto"
    """attention tier in training: "auto" (MLXTUNE_KERNELS, else the best for the device),
    "reference", "chunked" (tiles that never build the [T, T] scores; MLX's fused attention for
    short rows), "metal" or "cuda" (GPU kernels), or
    "off" (mlx-lm's own attention)."""


@dataclass
class PrecisionConfig:
    """Mixed precision: fp32 master weights, loss scaling, and what a non-finite step does."""

    master_weights: bool = True
    """When model.dtype is bfloat16 or float16: keep an fp32 copy of every 16-bit trainable
    weight; the optimizer (and its state) works on the copies, the model computes in model.dtype.
    LoRA and DoRA adapters are fp32 already and need no copy."""
    loss_scale: Literal["auto", "dynamic", "static", "none"] = "auto"
    """Scale the loss before the backward pass so small float16 gradients do not flush to zero;
    the gradients are unscaled before clipping and the optimizer. "auto": dynamic for float16,
    none otherwise; "static": always init_scale."""
    init_scale: float = 65536.0
    """The first loss scale (2^16)."""
    growth_factor: float = 2.0
    """Dynamic scaling multiplies the scale by this after growth_interval finite steps in a row."""
    backoff_factor: float = 0.5
    """... and by this after a step whose gradients overflowed (that update is skipped)."""
    growth_interval: int = 2000
    """Finite steps in a row before the scale grows."""
    min_scale: float = 1.0
    """A step still non-finite at this scale is not an overflow: nonfinite decides."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient that loss scaling cannot explain: "stop" ends the run with
    exit 1 when the loop next reads its steps (at the next log step at the latest) and leaves the
    checkpoints as they were; "skip" drops that update and goes on."""
    max_skipped: int = 10
    """With nonfinite: skip, stop after this many non-finite steps in a row."""


@dataclass
class MemoryConfig:
    """Memory planning before the run, and what running out of memory mid-run does."""

    limit_gb: float | None = None
    """The memory the run may use, in GB; null: the device's (the GPU's recommended working set,
    or this machine's RAM on the CPU)."""
    check: Literal["refuse", "warn", "off"] = "refuse"
    """When the estimated peak is over the limit: "refuse" to start (exit 2, listing changes that
    would fit), "warn" and go on, or "off"."""
    oom_fallback: bool = True
    """On an out-of-memory failure mid-run: halve the micro-batch and double grad_accumulation
    (the same examples per step), say so, and retry the step."""


@dataclass
class Recipe:
    """A whole run."""

    name: str = "run"
    """Name of the run; the default run directory is runs/NAME-TIMESTAMP."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """The datasets."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """LoRA, DoRA or full fine-tuning."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    """Generation samples."""
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Exports at the end of the run."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Kernel tiers for the loss."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision and non-finite steps."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Memory planning and out-of-memory fallback."""
    run_dir: str | None = None
    """Run directory, relative to the current directory and without '..'; --run-dir overrides
    it (and may name any folder)."""

    # Not part of the schema: where the recipe came from, for resolving relative paths.
    source: str | None = field(default=None, repr=False, metadata={"internal": True})

    def resolve_path(self, p: str | None) -> Path | None:
        """A path from the recipe, relative to the recipe file's folder."""
        if p is None:
            return None
        path = Path(p).expanduser()
        if not path.is_absolute() and self.source:
            path = Path(self.source).parent / path
        return path

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        return d


# --------------------------------------------------------------------------------------------
# Field docs


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# --------------------------------------------------------------------------------------------
# YAML with line numbers (safe: compose builds nodes, never Python objects)


class _Lines:
    """Maps a dotted key path to the line it was written on."""

    def __init__(self, source: str, text: str):
        self.source = source
        self.lines: dict[str, int] = {}
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            node = None
        if node is not None:
            self._walk(node, "")

    def _walk(self, node, prefix: str):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                self.lines[key] = k.start_mark.line + 1
                self._walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                key = f"{prefix}[{i}]"
                self.lines[key] = v.start_mark.line + 1
                self._walk(v, key)

    def where(self, key: str) -> str:
        k = key
        while k:
            if k in self.lines:
                return f"{self.source}:{self.lines[k]}: {key}"
            k = k.rsplit(".", 1)[0] if "." in k else ""
        return f"{self.source}: {key}"


class _Overrides:
    """Remembers which keys came from the command line, to blame them properly."""

    def __init__(self, keys: dict[str, str]):
        self.keys = keys

    def lookup(self, key: str) -> str | None:
        for k, raw in self.keys.items():
            if key == k or key.startswith(k + ".") or key.startswith(k + "["):
                return f"override {raw!r}: {key}"
        return None


# --------------------------------------------------------------------------------------------
# Validation


class _Validator:
    def __init__(self, lines: _Lines, overrides: _Overrides):
        self.lines = lines
        self.overrides = overrides

    def where(self, key: str) -> str:
        return self.overrides.lookup(key) or self.lines.where(key)

    def fail(self, key: str, msg: str):
        raise UserInputError(msg, self.where(key))

    def build(self, cls: type, data: Any, key: str):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.fail(key or "recipe", f"expected a mapping of keys, got {_show(data)}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        kwargs = {}
        for k, v in data.items():
            sub = f"{key}.{k}" if key else str(k)
            if k not in fields:
                close = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                allowed = ", ".join(fields)
                self.fail(sub, f"unknown key{hint} (known here: {allowed})")
            kwargs[k] = self.check(hints[k], v, sub)
        return cls(**kwargs)

    def check(self, tp, value, key: str):
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return value
        if origin in (Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            non_none = [a for a in args if a is not type(None)]
            if len(non_none) == 1:
                return self.check(non_none[0], value, key)
            for a in non_none:  # first that fits
                try:
                    return self.check(a, value, key)
                except UserInputError:
                    continue
            self.fail(key, f"unexpected value {_show(value)}")
        if value is None:
            self.fail(key, "a value is required here (got null)")
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, key)
        if origin is Literal:
            if isinstance(value, bool):  # YAML 1.1 reads a bare off/no as false, on/yes as true
                words = ("on", "yes", "true") if value else ("off", "no", "false")
                value = next((w for w in words if w in args), value)
            if value not in args:
                close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                choices = ", ".join(repr(a) for a in args)
                self.fail(key, f"{_show(value)} is not one of {choices}{hint}")
            return value
        if origin is list:
            if not isinstance(value, list):
                self.fail(key, f"expected a list, got {_show(value)}")
            return [self.check(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
        if tp is dict:
            if not isinstance(value, dict):
                self.fail(key, f"expected a mapping, got {_show(value)}")
            return value
        if tp is bool:
            if not isinstance(value, bool):
                self.fail(key, f"expected true or false, got {_show(value)}")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(key, f"expected an integer, got {_show(value)}")
            return value
        if tp is float:
            if isinstance(value, str):  # YAML 1.1 reads 1e-4 as a string
                try:
                    value = float(value)
                except ValueError:
                    self.fail(key, f"expected a number, got {_show(value)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.fail(key, f"expected a number, got {_show(value)}")
            try:
                value = float(value)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                self.fail(key, "expected a finite number")
            return value
        if tp is str:
            if not isinstance(value, str):
                self.fail(key, f"expected a string, got {_show(value)}")
            return value
        raise TypeError(f"recipe schema: unsupported type {tp} at {key}")


def _show(v) -> str:
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, (dict, list)):
        return type(v).__name__
    return repr(v)


def _check_values(r: Recipe, v: _Validator):
    """Impossible values and combinations."""

    def positive(key, x, allow_none=False):
        if x is None and allow_none:
            return
        if x is None or x <= 0:
            v.fail(key, f"must be greater than 0, got {x}")

    def in_range(key, x, lo, hi, hi_open=True):
        if x < lo or (x >= hi if hi_open else x > hi):
            bracket = ")" if hi_open else "]"
            v.fail(key, f"must be in [{lo}, {hi}{bracket}, got {x}")

    if not is_plain_name(r.name):
        v.fail("name", f"{r.name!r} {NOT_PLAIN}")
    if r.run_dir is not None and not is_under_here(r.run_dir):
        v.fail("run_dir", f"{r.run_dir!r} {NOT_UNDER_HERE}")
    if r.model.path is None and r.model.arch is None:
        v.fail(
            "model",
            "give model.path (a model directory or Hub id) or model.arch (train from scratch)",
        )
    if r.model.path is not None and r.model.arch is not None:
        v.fail("model.arch", "give model.path or model.arch, not both")
    q = r.model.quantize
    if q is not None:
        for name in ("bits", "group_size"):
            if not isinstance(getattr(q, name), int):
                v.fail(f"model.quantize.{name}", f"expected an integer, got {getattr(q, name)!r}")
        if r.model.arch is not None:
            v.fail(
                "model.quantize",
                "is for a loaded base (model.path); a model built from arch trains every weight",
            )
        if r.adapter.type == "full":
            v.fail(
                "model.quantize",
                "quantized weights cannot train: use adapter.type lora or dora (QLoRA)",
            )
    if r.model.arch is not None:
        if "model_type" not in r.model.arch:
            v.fail("model.arch", "needs model_type (for example llama)")
        if r.adapter.type != "full":
            v.fail("adapter.type", "a model trained from scratch needs adapter.type: full")
        if r.tokenizer.train is None and r.tokenizer.path is None:
            v.fail("tokenizer", "a model built from arch needs tokenizer.path or tokenizer.train")
    if r.tokenizer.train is not None:
        positive("tokenizer.train.vocab_size", r.tokenizer.train.vocab_size)
        positive("tokenizer.train.max_sentences", r.tokenizer.train.max_sentences)
        in_range(
            "tokenizer.train.character_coverage",
            r.tokenizer.train.character_coverage,
            0.9,
            1.0,
            False,
        )
    if not r.data.train:
        v.fail("data.train", "a training file is required")
    positive("data.max_length", r.data.max_length)
    if r.data.min_length < 0:
        v.fail("data.min_length", f"must be 0 or more, got {r.data.min_length}")
    in_range("data.valid_fraction", r.data.valid_fraction, 0.0, 1.0)
    positive("data.bucket_size", r.data.bucket_size)
    positive("data.pad_to_multiple", r.data.pad_to_multiple)
    if r.data.pack_length is not None:
        if r.data.pack_length < 2:
            v.fail("data.pack_length", f"a row needs at least 2 tokens, got {r.data.pack_length}")
        if r.data.packing == "off":
            v.fail("data.pack_length", "is for packed rows; set data.packing: pack or stream")
        if r.data.packing == "pack" and r.data.pack_length < r.data.max_length:
            v.fail(
                "data.pack_length",
                f"must hold the longest example (data.max_length {r.data.max_length}), "
                f"got {r.data.pack_length}",
            )
    if r.data.packing == "stream" and r.data.pack_length is None and r.data.max_length < 2:
        v.fail("data.max_length", "stream rows (max_length long) need at least 2 tokens")
    if r.data.packing != "off" and r.kernels.attention == "off":
        v.fail("data.packing", "packed rows need mlxtune's attention (kernels.attention not off)")
    a = r.adapter
    if a.type in ("lora", "dora"):
        positive("adapter.rank", a.rank)
        positive("adapter.alpha", a.alpha)
        in_range("adapter.dropout", a.dropout, 0.0, 1.0)
        if not a.targets:
            v.fail("adapter.targets", "name at least one layer (for example q_proj) or all-linear")
    o = r.optimizer
    positive("optimizer.lr", o.lr)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        v.fail("optimizer.betas", f"must be two numbers in [0, 1), got {o.betas}")
    positive("optimizer.eps", o.eps)
    if o.weight_decay < 0:
        v.fail("optimizer.weight_decay", f"must be 0 or more, got {o.weight_decay}")
    if o.name == "adam" and o.weight_decay > 0:
        v.fail("optimizer.weight_decay", "adam has no weight decay; use name: adamw")
    positive("optimizer.grad_clip", o.grad_clip, allow_none=True)
    s = r.schedule
    if s.warmup_steps is not None and s.warmup_steps < 0:
        v.fail("schedule.warmup_steps", f"must be 0 or more, got {s.warmup_steps}")
    if s.min_lr < 0 or s.min_lr > o.lr:
        v.fail("schedule.min_lr", f"must be between 0 and optimizer.lr ({o.lr}), got {s.min_lr}")
    t = r.train
    positive("train.batch_size", t.batch_size)
    positive("train.grad_accumulation", t.grad_accumulation)
    positive("train.log_every", t.log_every)
    if t.max_steps is None and t.epochs is None:
        v.fail("train", "give train.max_steps or train.epochs")
    positive("train.max_steps", t.max_steps, allow_none=True)
    positive("train.epochs", t.epochs, allow_none=True)
    in_range("train.label_smoothing", t.label_smoothing, 0.0, 1.0)
    positive("eval.every", r.eval.every, allow_none=True)
    positive("eval.max_batches", r.eval.max_batches, allow_none=True)
    positive("eval.batch_size", r.eval.batch_size, allow_none=True)
    if r.eval.exact_match < 0:
        v.fail("eval.exact_match", f"must be 0 or more, got {r.eval.exact_match}")
    positive("eval.max_new_tokens", r.eval.max_new_tokens)
    positive("samples.every", r.samples.every, allow_none=True)
    positive("samples.max_new_tokens", r.samples.max_new_tokens)
    positive("samples.count", r.samples.count)
    if r.samples.temperature < 0:
        v.fail("samples.temperature", f"must be 0 or more, got {r.samples.temperature}")
    p = r.precision
    positive("precision.init_scale", p.init_scale)
    if p.growth_factor <= 1:
        v.fail("precision.growth_factor", f"must be greater than 1, got {p.growth_factor}")
    in_range("precision.backoff_factor", p.backoff_factor, 0.0, 1.0)
    if p.backoff_factor == 0:
        v.fail("precision.backoff_factor", "must be greater than 0, got 0.0")
    positive("precision.growth_interval", p.growth_interval)
    positive("precision.min_scale", p.min_scale)
    if p.min_scale > p.init_scale:
        v.fail(
            "precision.min_scale", f"must not exceed init_scale ({p.init_scale}), got {p.min_scale}"
        )
    positive("precision.max_skipped", p.max_skipped)
    positive("memory.limit_gb", r.memory.limit_gb, allow_none=True)
    positive("checkpoints.every", r.checkpoints.every, allow_none=True)
    positive("checkpoints.keep_last", r.checkpoints.keep_last)
    for fmt in ("mlx-lm", "peft"):
        if fmt in r.export.formats and r.adapter.type == "full":
            v.fail("export.formats", f"{fmt} adapters need adapter.type lora or dora; use fused")
    if a.init_from is not None and a.type == "full":
        v.fail("adapter.init_from", "starting from an adapter needs adapter.type lora or dora")
    _check_layers(a.layers, v)
    gc = t.grad_checkpointing
    if not isinstance(gc, bool) and gc < 1:
        v.fail("train.grad_checkpointing", f"true, false or every k-th layer (k >= 1), got {gc}")


def _check_layers(layers, v: _Validator):
    if layers is None or layers == "all":
        return
    if isinstance(layers, bool):
        v.fail("adapter.layers", f"expected null, N, 'a-b' or a list, got {layers!r}")
    if isinstance(layers, int):
        if layers <= 0:
            v.fail("adapter.layers", f"must be greater than 0, got {layers}")
        return
    if isinstance(layers, str):
        parts = layers.split("-")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            if int(parts[0]) > int(parts[1]):
                v.fail("adapter.layers", f"range {layers!r} is empty")
            return
        v.fail("adapter.layers", f"expected 'a-b' (for example '0-11'), got {layers!r}")
    if isinstance(layers, list):
        if not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
        ):
            v.fail("adapter.layers", "a list of layer indices (integers 0 or more)")
        return
    v.fail("adapter.layers", f"expected null, N, 'a-b' or a list, got {_show(layers)}")


# --------------------------------------------------------------------------------------------
# Loading


def parse_override(raw: str) -> tuple[str, Any]:
    """``train.batch_size=8`` -> ("train.batch_size", 8); the value is read as YAML."""
    if "=" not in raw:
        raise UserInputError(f"expected key.sub=value, got {raw!r}", "override")
    key, _, text = raw.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserInputError(f"bad key in {raw!r}", "override")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise UserInputError(f"value of {raw!r} is not valid YAML: {e}", "override") from None
    return key, value


def apply_overrides(data: dict, overrides: list[str]) -> dict[str, str]:
    applied = {}
    for raw in overrides:
        key, value = parse_override(raw)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise UserInputError(
                    f"{part!r} is not a section, cannot set {key}", f"override {raw!r}"
                )
            node = node[part]
        node[parts[-1]] = value
        applied[key] = raw
    return applied


def recipe_from_dict(
    data: dict, source: str = "<recipe>", text: str = "", overrides: dict[str, str] | None = None
) -> Recipe:
    """Validate a recipe given as a dict (already loaded) and return it."""
    v = _Validator(_Lines(source, text), _Overrides(overrides or {}))
    recipe = v.build(Recipe, data, "")
    recipe.source = source if source != "<recipe>" else None
    _check_values(recipe, v)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe file."""
    path = Path(path)
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserInputError("recipe file not found", src) from None
    except UnicodeDecodeError as e:
        raise UserInputError(f"not UTF-8 text ({e.reason} at byte {e.start})", src) from None
    except OSError as e:
        raise UserInputError(f"cannot read recipe: {e.strerror}", src) from None
    data = parse_yaml(text, src)
    applied = apply_overrides(data, list(overrides))
    return recipe_from_dict(data, src, text, applied)


def parse_yaml(text: str, source: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e)
        raise UserInputError(f"YAML does not parse: {problem}", where) from None
    if data is None:
        raise UserInputError("the recipe is empty", source)
    if not isinstance(data, dict):
        raise UserInputError(
            "a recipe is a mapping of sections (model:, data:, train:, ...)", source
        )
    return data


def dump_yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
