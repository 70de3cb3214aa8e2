"""The recipe's schema: typed dataclasses, one a section, each field with its docstring.

The string under each field documents it; ``field_docs`` reads them back, so the schema is also
the documentation. Objectives defined elsewhere add their own ``objective`` section class with
``register_objective_config``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .machines import DistributedConfig, MemoryConfig  # noqa: F401  (part of the schema)
from .optimizers import (  # noqa: F401  (part of the schema, re-exported here)
    AdafactorConfig,
    MuonConfig,
    OptimizerConfig,
    ScheduleConfig,
    SophiaConfig,
)

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
class QATConfig:
    """Quantization-aware training: the blocks' linear layers compute with their weights (a
    LoRA/DoRA layer's merged weight) quantized and de-quantized exactly as the target format
    stores them, the gradient passed straight through; fused and GGUF exports then write those
    codes (docs/quantization.md)."""

    bits: int = 4
    """Bits per weight: affine takes 2, 3, 4, 5, 6 or 8; mxfp4 and nvfp4 4; mxfp8 8."""
    group_size: int = 64
    """Weights per scale (and bias): affine 32, 64 or 128; mxfp4 and mxfp8 32; nvfp4 16."""
    mode: Literal["affine", "mxfp4", "nvfp4", "mxfp8"] = "affine"
    """MLX's quantization format: affine (a scale and bias per group, as mlx-lm's 4-bit
    checkpoints; a 4-bit one exports to GGUF Q4_1), mxfp4 (GGUF MXFP4), nvfp4 (GGUF NVFP4)
    or mxfp8."""
    start_step: int = 0
    """Train in full precision until this optimizer step, then quantization-aware."""


@dataclass
class ModelConfig:
    """The model to train: a local directory in Hugging Face layout, a Hub id, or an architecture."""

    path: str | None = None
    """A local model directory (config.json + *.safetensors), a GGUF file (``*.gguf``: weights,
    config, tokenizer and chat template from the file), a file inside an installed Python
    package (``package:NAME/FILE``), or a Hugging Face Hub id."""
    arch: dict | None = None
    """Build a new model from this architecture config (Hugging Face config.json keys, with
    model_type) and train it from scratch; vocab_size defaults to the tokenizer's."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model's floating-point weights during training."""
    trust_remote_code: bool = False
    """Allow a model directory to run its own Python code (config.json's model_file)."""
    seed: int = 0
    """Seed for the random initialisation of a model built from arch."""
    dequantize: bool = False
    """A GGUF base's Q8_0/Q4_0/Q4_1 weights stay quantized under LoRA/DoRA (QLoRA over the file
    as it is); true de-quantizes them to ``dtype`` as every other type is."""
    quantize: QuantizeConfig | None = None
    """Quantize the base as it loads, for example {bits: 4, group_size: 64} (QLoRA: LoRA or DoRA
    adapters train on the quantized base); null keeps the weights as they are. A model that is
    quantized already (config.json with "quantization") loads quantized without this."""


@dataclass
class DataConfig:
    """Training and evaluation data: JSONL files, one example per line (or .csv/.tsv with a
    header, or .txt: a paragraph an example)."""

    train: str = ""
    """Training data file (paths are relative to the recipe file)."""
    valid: str | None = None
    """Validation JSONL file; when absent, valid_fraction of train is held out."""
    test: str | None = None
    """Held-out JSONL file for the task metric (exact match); defaults to the validation set."""
    format: str = "auto"
    """Example format: text, completion, instruction, chat, sharegpt, tokens, preference (pairs, for
    objective.type dpo, orpo, cpo or reward), or one registered with
    ``mlxtune.data.register_format``; "auto" detects it from the keys of the first example."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Arguments the chat template reads, for every chat example ({enable_thinking: false} for
    Qwen3's); a row's tools column reaches the template as its tools argument."""
    train_on_reasoning: bool = True
    """Chat data whose assistant turns carry reasoning (a reasoning_content or thinking field,
    shown by the chat template): train on it with the answer, or (false) keep it as context
    only, the answer after it trained on."""
    columns: dict | None = None
    """Fields under other names: {prompt: question, completion: answer} reads a row's question
    as the prompt and its answer as the completion (CSV/TSV columns, or JSONL keys)."""
    num_proc: int | Literal["auto"] = "auto"
    """Processes that encode a split: auto uses every core (up to 8) for a split of 20,000 rows
    or more, one below."""
    cache: bool = True
    """Keep each split's encoded examples on disk ($MLXTUNE_CACHE, default ~/.cache/mlxtune),
    keyed by the data's content, the tokenizer and these settings: a second run and every
    resume skip tokenization."""
    streaming: bool = False
    """Read the training data as a stream, a window of stream_window rows at a time, encoded
    as training goes, for data larger than memory (SFT: text, completion or chat rows;
    JSONL, text, CSV/TSV, Parquet, Arrow, a glob or saved dataset of them, or hf:): each
    window's examples are shuffled and batched, and a checkpoint records the place in the
    stream, so a resumed run trains on the batches an uninterrupted one would. Needs
    train.max_steps, and data.valid or a number of rows for data.valid_size (the first rows are
    held out). Not cached."""
    stream_window: int = 10000
    """Rows a window of the stream holds: its examples are shuffled and batched together (a
    larger window mixes more, and holds more in memory)."""
    bad_rows: Literal["error", "skip"] = "error"
    """A bad row (not JSON, a missing or wrong field, ...): an error naming its line, or skipped,
    counted by reason and named in the log (the first few)."""
    max_bad_fraction: float = 0.05
    """With bad_rows skip: a file with more than this share of bad rows is an error still."""
    max_length: int | Literal["auto"] = 2048
    """Longest example in tokens (see overlong); auto: the longest example, up to the model's
    context, shortened where even one example a step would not fit the memory budget
    (unpacked SFT data)."""
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
    valid_size: int | float | None = None
    """Held out of the training data for validation when no data.valid is given, instead of
    valid_fraction: a fraction below 1 (0.05) or a number of examples (200)."""
    test_size: int | float | None = None
    """Held out of the training data for the test metric (eval.exact_match) when no data.test is
    given: a fraction below 1 or a number of examples, drawn with the validation set from the
    whole data; null: the test set is the validation set."""
    split_seed: int | None = None
    """Seed of the held-out draws; null: train.seed."""
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
    """Tokens per packed row; default max_length (pack needs at least max_length), and for
    preference pairs, which pack whole, 2 x max_length."""
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
    """LoRA alpha; the update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale the update by alpha / sqrt(rank), so that its size does not
    shrink as the rank grows. Every export carries the scale (mlx-lm's scale, PEFT's
    use_rslora, the GGUF adapter's alpha)."""
    lora_plus_ratio: float | None = None
    """LoRA+: B's learning rate is this multiple of A's (and of the recipe's lr); null: the
    same. 16 is LoRA+'s suggestion; measured on quickstart-lora in docs/recipes.md."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Linear layers to adapt, by name (q_proj, v_proj, gate_proj, ...), or ["all-linear"]; a
    vision model's tower and projector too where named ("vision", "projector")."""
    layers: Any = None
    """Transformer layers to adapt: null (all), N (the last N), "a-b" (a to b inclusive) or a
    list of layer indices."""
    init_from: str | None = None
    """Start from an existing mlx-lm or PEFT adapter directory (its rank and layers must match)."""


@dataclass
class EarlyStoppingConfig:
    """Stop when an evaluation metric stops improving (checked at every evaluation)."""

    patience: int | None = None
    """Stop after this many evaluations in a row without an improvement of more than min_delta
    on the best so far; null: never stop early."""
    min_delta: float = 0.0
    """The least change that counts as an improvement."""
    metric: str = "eval_loss"
    """The evaluation metric watched: eval_loss, or another the objective reports (eval_ppl,
    eval_reward, eval_reward_accuracy, ...). The best checkpoint is the best by it too."""
    mode: Literal["min", "max"] | None = None
    """Whether lower or higher is better; null: higher for a metric whose name holds reward,
    accuracy or exact_match, lower for any other."""


@dataclass
class TrainConfig:
    """The training loop."""

    batch_size: int | Literal["auto"] = 4
    """Examples per micro-batch; auto: the largest power of two whose estimated peak fits 90%
    of the memory budget (SFT and preference objectives)."""
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
    neftune_noise_alpha: float | None = None
    """NEFTune (SFT): uniform noise of at most alpha / sqrt(T x D) added to every token
    embedding while training (T the row length, D the model width); 5 is the paper's usual
    value; null: off."""
    progress: bool = True
    """Show a progress bar with ETA when writing to a terminal."""
    grad_checkpointing: bool | int | Literal["auto"] = False
    """Recompute transformer blocks' activations in the backward pass instead of keeping them
    (less memory, more compute): true for every block, an integer k for every k-th (blocks 0,
    k, 2k, ...), false for none; auto: on only where it lets a larger batch fit (or the given
    batch fit at all)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stopping early on an evaluation metric."""
    qat: QATConfig | None = None
    """Quantization-aware training toward a quantized format; eval_loss is then the
    quantized model's, eval_loss_unquantized the full-precision weights'; null: off."""


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
    at_start: bool = False
    """Also evaluate before the first step (a new run; a resumed one has its row already),
    as step 0: where training starts from."""


@dataclass
class SamplesConfig:
    """Generation samples written to samples.jsonl while training."""

    every: int | None = None
    """Generate samples every N optimizer steps (and at the end); null: off."""
    prompts: list[str] = field(default_factory=list)
    """Prompts to complete, read as written (no chat template); when empty, the first
    validation prompts are used, read as in training and shown as the user's message."""
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
    """Keep a copy of the checkpoint with the best evaluation (lowest eval_loss, or by
    train.early_stopping.metric) in checkpoints/best."""
    load_best_at_end: bool = False
    """When training ends, put the best checkpoint's weights back: the final checkpoint, the
    exports and the summary's final evaluation are then the best model's (needs save_best and
    a validation set)."""
    save_final: bool = True
    """Save checkpoints/final at the end of training."""


@dataclass
class ExportConfig:
    """What the run writes into RUN_DIR/export when training ends."""

    formats: list[Literal["mlx-lm", "peft", "fused", "gguf", "gguf-adapter", "mlx-vlm"]] = field(
        default_factory=list
    )
    """"mlx-lm"/"peft": an adapter mlx-lm/PEFT loads; "fused": the model with the adapters merged
    in, Hugging Face layout (a vision model's read by transformers and mlx-vlm alike); "gguf": the fused model for
    llama.cpp (f16); "gguf-adapter": a LoRA for llama.cpp's --lora; "mlx-vlm": a vision model's adapter."""


@dataclass
class KernelsConfig:
    """Which implementation of the fused operations the trainer uses."""

    loss: Literal["auto", "reference", "chunked", "metal", "cuda"] = "auto"
    """linear_cross_entropy tier: "auto" (MLXTUNE_KERNELS, else measured: autotune), "reference"
    (the [tokens, vocab] logits, as mlx-lm), "chunked" (never builds them), "metal" or "cuda"."""
    attention: Literal["auto", "reference", "chunked", "native", "metal", "cuda", "off"] = "auto"
    """attention tier: "auto" (as the loss's), "reference", "chunked" (never builds the [T, T]
    scores), "native" (MLX's fused attention), "metal", "cuda", or "off" (mlx-lm's own)."""
    autotune: bool = True
    """Choose each "auto" tier by timing every tier at the run's shapes, the fastest that fits
    the memory budget (docs/kernels.md); a named tier is kept, warned past 2x slower."""


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
class ObjectiveConfig:
    """What the model learns from the data."""

    type: str = "sft"
    """The training objective: "sft" (next-token cross-entropy on the data's target tokens), or
    the name of an objective registered with its own keys (each documented by its class)."""

    def checks(self) -> tuple:
        """(ok, key, what it must be) for this section's own values: ``mlxtune validate`` and
        every run refuse a value that is not ok, naming where its key was set."""
        return ()


@dataclass
class SFTConfig(ObjectiveConfig):
    """Supervised fine-tuning: next-token cross-entropy on the data's target tokens."""

    type: str = "sft"
    """This objective."""
    loss: Literal["ce", "dft"] = "ce"
    """ce: the summed next-token cross-entropy over the target tokens; dft: dynamic fine-tuning
    (Wu et al., 2025), each target token's cross-entropy scaled by its probability under the
    model, held constant (no gradient flows through the scale), so tokens the model finds
    unlikely pull less. With dft the metrics rows log ``nll``, the plain cross-entropy, beside
    the loss, and evaluation reports the plain cross-entropy (its perplexity a perplexity)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the routers' load-balancing loss (Switch
    Transformer's, as transformers computes it for Mixtral and Qwen-MoE: the number of experts
    x the sum over experts of tokens routed there per token x mean router probability; k at
    uniform routing with k experts a token) added to the mean cross-entropy, and logged as
    ``router_aux_loss``. Mixtral and Qwen-MoE trained with 0.001-0.02. 0: off."""

    def checks(self) -> tuple:
        return ((self.router_aux_loss_coef >= 0, "router_aux_loss_coef", "at least 0"),)


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
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Data-parallel runs: how long a rank waits on the others."""
    objective: ObjectiveConfig = field(default_factory=SFTConfig)
    """The training objective and its settings."""
    report: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    """Also send the metrics rows, the resolved recipe and the samples to TensorBoard (event
    files in RUN_DIR/tensorboard) and/or Weights & Biases (in the mode the environment sets;
    WANDB_MODE=offline needs no network). Each is an optional extra: pip install
    'mlxtune[tensorboard]', 'mlxtune[wandb]'."""
    run_dir: str | None = None
    """Run directory, relative to the current directory and without '..'; --run-dir overrides
    it (and may name any folder)."""

    # Not part of the schema: where the recipe came from, for resolving relative paths.
    source: str | None = field(default=None, repr=False, metadata={"internal": True})
    # Not part of the schema: the dotted keys the recipe file and overrides wrote (a key absent
    # here holds its default), so settings that other settings make meaningless can be named.
    explicit: frozenset[str] = field(
        default=frozenset(), repr=False, compare=False, metadata={"internal": True}
    )

    def resolve_path(self, p: str | None) -> Path | None:
        """A path from the recipe, relative to the recipe file's folder."""
        if p is None:
            return None
        if p.startswith("hf:"):  # a Hub dataset, not a path
            return Path(p)
        path = Path(p).expanduser()
        if not path.is_absolute() and self.source:
            path = Path(self.source).parent / path
        return path

    def to_dict(self) -> dict:
        """The schema's keys and values as plain dicts and lists (no internal fields)."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("internal"):
                d.pop(f.name, None)
        return d


# --------------------------------------------------------------------------------------------
# Field docs


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name; a subclass's fields
    add to (and may replace) the docs of the dataclasses it derives from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
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
# Objectives


OBJECTIVE_CONFIGS: dict[str, type] = {"sft": SFTConfig}
"""The ``objective`` section's class for each objective.type a recipe may name."""


def register_objective_config(name: str, cls: type) -> None:
    """Let recipes name ``objective.type: NAME``; their ``objective`` section is then read and
    validated as ``cls``.

    ``cls`` is a dataclass deriving from ``ObjectiveConfig`` whose ``type`` defaults to ``name``
    (so an instance made in code knows its objective) and whose other fields each have a
    default and a docstring under them. Registering the same class again does nothing; another
    class under a taken name is refused.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an objective name is a non-empty string, got {name!r}")
    if not (
        isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, ObjectiveConfig)
    ):
        raise TypeError(
            f"objective {name!r}: {cls!r} is not a dataclass subclass of ObjectiveConfig"
        )
    taken = OBJECTIVE_CONFIGS.get(name)
    if taken is cls:
        return
    if taken is not None:
        raise ValueError(f"objective {name!r} is registered already, to {taken.__qualname__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if fields["type"].default != name:
        raise ValueError(
            f"objective {name!r}: {cls.__qualname__}.type must default to {name!r}, "
            f"not {fields['type'].default!r}"
        )
    docs = field_docs(cls)
    for f in fields.values():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"objective {name!r}: {cls.__qualname__}.{f.name} needs a default")
        if not docs.get(f.name):
            raise ValueError(
                f"objective {name!r}: {cls.__qualname__}.{f.name} needs a docstring under it"
            )
    OBJECTIVE_CONFIGS[name] = cls


def unregister_objective_config(name: str) -> None:
    """Forget ``objective.type: NAME`` (sft stays)."""
    if name == "sft":
        raise ValueError("the sft objective cannot be unregistered")
    OBJECTIVE_CONFIGS.pop(name, None)
