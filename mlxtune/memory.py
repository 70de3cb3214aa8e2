"""Memory planning: an estimate of a run's peak memory before it starts, the device's budget,
and what would fit instead. The automatic sizes chosen from it are ``autosize``'s; what a
running step does about memory is ``engine.memory``.

The estimate adds what a step holds at its peak: the weights as loaded, fp32 master copies, the
optimizer's state, the gradients (and their fp32 accumulation), the activations the backward
pass keeps for every layer, and the logits the loss builds. Activations are counted per token
and layer from the architecture (a SwiGLU transformer block keeps its norms, q/k/v, attention
output, gate/up/product and residuals); attention scores only where the attention tier builds
them. A layer under gradient checkpointing keeps only its input, and one such layer at a time
holds its recomputed activations; a quantized base counts as packed. ``tests/test_memory.py``
holds the estimate to within a factor of MLX's measured peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import qat, tensor
from .adapters import LoRALinear
from .engine.memory import GB
from .errors import UserInputError
from .fsdp import ShardedUnit
from .kernels.chunked import chunk_elements, chunk_size
from .kernels.flash import block_for, uses_fused
from .kernels.tune import tier_at
from .models import VisionLM, checkpointed_layers, is_quantized
from .models.capabilities import delta_layout
from .models.configs import active_intermediate, text_config

OVERHEAD = 1.10  # allocator rounding and small temporaries


def run_budget(recipe) -> tuple[float, str]:
    """(bytes, what they are) a run may plan to use: ``memory.limit_gb``, else what the device
    can give. The plan and the automatic sizes both weigh their estimates against it."""
    if recipe.memory.limit_gb is not None:
        return recipe.memory.limit_gb * GB, "memory.limit_gb"
    info = mx.device_info()
    for key, what in (
        ("max_recommended_working_set_size", "the GPU's recommended working set"),
        ("total_memory", "the GPU's memory"),
        ("memory_size", "the device's memory"),
    ):
        if key in info:
            return float(info[key]), what
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return float("inf"), "unknown"
    return float(total), "this machine's RAM"


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know about a run."""

    weight_bytes: int  # every weight, as held (quantized ones packed)
    trainable: int  # trainable elements
    trainable_bytes: int  # ... as held
    trainable_16bit: int  # trainable elements held in 16 bits (they get fp32 masters)
    full: bool  # every weight trains
    act_bytes: int  # bytes per element of model.dtype
    layers: int
    hidden: int
    intermediate: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # 2 x kv heads x head_dim
    heads: int
    vocab: int
    batch: int
    length: int  # positions the model reads per row (the longest padded batch)
    accumulation: int
    optimizer_bytes: int  # the optimizer's state (its arrays, as initialised)
    masters: bool
    attention_scores: bool  # the attention tier builds [T, T] scores
    logits_full: bool  # the loss builds [tokens, vocab] logits
    logit_chunk: int  # logits per chunk when it does not
    checkpointed: int = 0  # layers that recompute their activations in the backward pass
    quantizable: int = 0  # dense linear/embedding weight elements 4-bit quantization would pack
    chunked_attention: bool = False  # short rows then go to MLX's fused attention (see below)
    native_attention: bool = False  # MLX's fused attention at every length
    rows_per_example: int = 1  # rows a batch holds per train.batch_size unit (2: pairs)
    sequences_per_example: int = 1  # sequences an example packs as (2: pairs)
    reference_forward: bool = False  # a forward without backward a step (DPO's reference)
    reference_bytes: int = 0  # weights kept for the reference (a copy of the trainable ones)
    objective_bytes: int = 0  # what the objective's loss holds besides (distillation's logits)
    drawn_logits: bool = False  # a curvature pass draws labels from whole logits (sophia)
    generation_rows: int = 0  # rows generated at once while training (RL), their KV caches
    generation_length: int = 0  # ... of this capacity (positions)
    micro_key: str | None = None  # the key that sets rows a pass (RL), else train.batch_size
    trained_inputs: int | None = None  # elements a token of a layer's trained linear inputs
    fused_score_arrays: int = 4  # [T, T] arrays a fused attention's backward holds at once
    tower_row_bytes: float = 0.0  # a vision model's tower pass, a row's share (measured)
    tower_trains: bool = False  # ... its backward too, while the step's gradients are held
    delta_layers: int = 0  # layers mixing by the gated delta rule (hybrids), chunkwise
    delta_token: int = 0  # fp32 elements a token of one of them keeps (delta.saved_per_token)
    head_chunk_bytes: int = 0  # a quantized head's rows the chunked loss de-quantizes at once
    # the transformer blocks, whole: what distributed.strategy: fsdp divides among its ranks
    block_weight_bytes: int = 0  # their weights, as held
    block_trainable: int = 0  # their trainable elements
    block_trainable_bytes: int = 0  # ... as held
    block_trainable_16bit: int = 0  # ... held in 16 bits
    sharded: int = 1  # ranks the blocks are divided among (fsdp); the figures above are a rank's
    # quantization-aware training (train.qat): a block's prepared weights, fake-quantized
    qat_block_bytes: int = 0  # ... the copies its forward computes with (kept for the backward)
    qat_block_grad_bytes: int = 0  # ... a LoRA layer's merged-weight gradient, in the backward


# [block, T] arrays the chunked attention's slabs add to a step's peak: a layer's attention
# alone holds several (scores, probabilities, their gradient), but in a compiled step they
# overlap the layer's other buffers; one, measured on the CPU (4 heads, T=4096, checkpointed)
SLAB_ARRAYS = 1


def estimate(s: Shape) -> dict[str, float]:
    """Peak bytes by component, and ``total``."""
    tokens = s.batch * s.length
    # what the backward pass needs: norm inputs, q/k/v (after RoPE) and the attention output,
    # and four of the MLP's width (gate, up and two of SwiGLU's intermediates: what a compiled
    # step was measured to keep); the inputs of trained linear layers on top
    per_token_layer = 2 * s.hidden + 2 * s.q_dim + s.kv_dim + 4 * s.intermediate
    if s.trained_inputs is not None:
        per_token_layer += s.trained_inputs
    elif s.full:
        per_token_layer += 2 * s.hidden + s.q_dim + s.intermediate
    else:  # LoRA on q_proj and v_proj: their shared input
        per_token_layer += s.hidden
    # a checkpointed layer keeps only its input; one of them at a time recomputes the rest
    kept = s.layers - s.checkpointed
    again = 1 if s.checkpointed else 0
    in_flight = 1 + (1 if s.reference_forward else 0)  # + a layer of the reference's forward
    acts = tokens * per_token_layer * s.act_bytes * (kept + again + in_flight)
    acts += tokens * s.hidden * s.act_bytes * s.checkpointed
    acts += tokens * 4 * s.hidden * s.act_bytes  # embeddings, final norm, their gradients
    if s.delta_layers:  # what the chunkwise rule keeps, in the layers that keep theirs
        acts += tokens * s.delta_token * 4 * (max(s.delta_layers - s.checkpointed, 0) + again)
    if s.attention_scores:  # scores and probabilities kept per layer, and the backward's
        acts += s.batch * s.heads * s.length * s.length * 4 * (2 * (kept + again) + 3)
    elif s.native_attention or (s.chunked_attention and uses_fused(s.batch, s.heads, s.length)):
        # MLX's fused attention: one layer's scores at a time, in its backward (scores,
        # probabilities and their gradients); the chunked tier's short rows on the CPU, whose
        # backward goes by query blocks, about two such arrays (measured)
        arrays = 4 if s.native_attention else s.fused_score_arrays
        acts += s.batch * s.heads * s.length * s.length * 4 * arrays
    elif s.chunked_attention:  # one slab at a time (see SLAB_ARRAYS)
        block = block_for(s.batch, s.heads, s.length, s.layers)
        slab = s.batch * s.heads * block * s.length * 4
        acts += slab * SLAB_ARRAYS
    if s.logits_full:
        logits = tokens * s.vocab * (4 * 3 + s.act_bytes)
    else:
        logits = min(s.logit_chunk, tokens * s.vocab) * 4 * 3
    logits += s.head_chunk_bytes
    if s.drawn_logits:  # Sophia's curvature pass: the whole [tokens, vocab] logits, the draw's
        logits = max(logits, tokens * s.vocab * (4 * 3 + s.act_bytes))
    # generating (before the step, its activations gone): the batched KV cache and each row's
    # last logits, cast to fp32 and filtered to sample
    generation = s.generation_rows * (
        s.generation_length * s.layers * s.kv_dim * s.act_bytes + s.vocab * (s.act_bytes + 4 * 3)
    )
    # a vision model's tower runs before the step (its backward after it, holding the step's
    # gradients, where adapters in it train): its pass is a peak of its own
    tower = s.tower_row_bytes * s.batch
    gathered, qat_part = _block_copies(s, kept + again)
    out = {
        "weights": float(s.weight_bytes + s.reference_bytes),
        "masters": float(4 * s.trainable_16bit if s.masters else 0),
        # the state, and its new values while the update runs
        "optimizer": float(2 * s.optimizer_bytes),
        # the gradients as computed, their fp32 unscaled copy, the accumulator, and the
        # updated weights before they replace the old
        "gradients": float(
            2 * s.trainable_bytes + 4 * s.trainable + (4 * s.trainable if s.accumulation > 1 else 0)
        ),
        "activations": float(acts),
        "logits": float(logits + s.objective_bytes),
    }
    if gathered:
        out["gathered"] = gathered
    if qat_part:
        out["qat"] = float(qat_part)
    step = out["gradients"] + out["activations"] + out["logits"] + gathered + qat_part
    held = out["weights"] + out["masters"] + out["optimizer"]
    if generation:
        out["generation"] = float(generation)
    if tower:
        out["tower"] = float(tower)
        tower += out["gradients"] if s.tower_trains else 0.0
    out["total"] = (held + max(step, generation, tower)) * OVERHEAD
    return out


def _block_copies(s: Shape, held: int) -> tuple[float, float]:
    """What the blocks hold besides their own weights while the step runs, for the ``held``
    blocks that keep their forward's arrays (the rest recompute them): (fsdp's gathered
    weights and gradients, QAT's quantized copies)."""
    gathered = 0.0
    if s.sharded > 1 and s.layers:  # fsdp: whole blocks while they compute
        # each block's weights whole while it runs (kept for the backward where it is not
        # checkpointed), and one block's whole gradients with their all-reduced copy
        block = s.block_weight_bytes / s.layers
        gathered = block * (s.layers - s.checkpointed + 1) + 2 * 4 * s.block_trainable / s.layers
    # QAT: each block computes with fake-quantized copies of its weights, kept for the
    # backward (a checkpointed block's made again there), and an adapted layer's gradient
    # reaches its merged weight whole before it reaches A and B
    return gathered, float(s.qat_block_bytes * held + s.qat_block_grad_bytes)


def describe(parts: dict[str, float]) -> str:
    shown = [f"{k} {v / GB:.2f}" for k, v in parts.items() if k != "total" and v >= 0.005 * GB]
    return f"{parts['total'] / GB:.2f} GB ({', '.join(shown) or 'all parts under 0.01 GB'})"


# linear layers that read one input: the attention's projections read the attention norm's
# output, the MLP's gate and up the MLP norm's
_SHARED_INPUT = {
    "q_proj": "attention",
    "k_proj": "attention",
    "v_proj": "attention",
    "gate_proj": "mlp",
    "up_proj": "mlp",
}


# linear layers whose input the step keeps whether they train or not: the MLP's down
# projection reads SwiGLU's product, one of the four MLP-wide arrays ``estimate`` counts in every
# layer (measured: a 4-bit llama of hidden 1024 and MLP 3584, rank-8 LoRA on every linear layer
# at 512 tokens, kept 45 MB a layer, 53 MB with this input counted again)
_KEPT_ANYWAY = ("down_proj", "w2")


def trained_inputs(block: nn.Module) -> int:
    """Elements per token of the inputs a transformer block keeps for its trained linear
    layers (adapters, or weights that train): an input several of them read counts once, and
    one every step keeps anyway (``_KEPT_ANYWAY``) not at all."""
    seen = {}
    whole = block.whole_shape if isinstance(block, ShardedUnit) else None  # fsdp: a piece's rows
    for name, m in block.named_modules():
        if name.rsplit(".", 1)[-1] in _KEPT_ANYWAY:
            continue
        if isinstance(m, LoRALinear):
            a = whole(f"{name}.lora_a") if whole else m.lora_a.shape
            dims = a[-1] if len(a) == 3 else a[0]
        elif isinstance(m, nn.Linear) and "weight" in m.trainable_parameters():
            dims = m.weight.shape[-1]
        else:
            continue
        seen[_SHARED_INPUT.get(name.rsplit(".", 1)[-1], name)] = int(dims)
    return sum(seen.values())


@dataclass(frozen=True)
class Planned:
    """What the memory plan reads of a run (a Trainer has the same names, so ``shape_of``
    reads a trainer's run too)."""

    recipe: object
    built: object
    objective: object
    tiers: dict
    optimizer: object
    engine: object


def shape_of(run) -> Shape:
    """The Shape of a run (a ``Planned``, or a Trainer): its model, data and recipe."""
    r, parts = run.recipe, run.built.components
    cfg = text_config(run.built.model_config)
    model = parts.model
    weights = tree_flatten(model.parameters())
    trainable = tree_flatten(model.trainable_parameters())
    hidden = int(cfg.get("hidden_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or hidden // max(heads, 1))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    # the longest batch sets the peak; the objective says how it lays batches out
    rows, length = run.objective.layout()
    reference = run.objective.reference_memory()
    generating = run.objective.generation_layout() or (0, 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    blocks = getattr(model, "layers", None)
    modules = [m for _, m in model.named_modules()]
    quantized = any(is_quantized(m) for m in modules)
    attention = tier_at(run.tiers["attention"], length)
    act_bytes = 4 if r.model.dtype == "float32" else 2
    loss_tier = tier_at(run.tiers["loss"], rows * length)
    dense_head, head_chunk = _quantized_head(parts.lm, loss_tier, rows * length, hidden, act_bytes)
    return Shape(
        weight_bytes=sum(v.nbytes for _, v in weights) + dense_head,
        trainable=sum(v.size for _, v in trainable),
        trainable_bytes=sum(v.nbytes for _, v in trainable),
        trainable_16bit=sum(v.size for _, v in trainable if v.dtype in (mx.bfloat16, mx.float16)),
        full=r.adapter.type == "full",
        act_bytes=act_bytes,
        layers=layers,
        hidden=hidden,
        intermediate=active_intermediate(cfg, hidden),
        q_dim=heads * head_dim,
        kv_dim=2 * kv_heads * head_dim,
        heads=heads,
        vocab=int(cfg.get("vocab_size") or len(parts.tokenizer._tokenizer)),
        batch=rows,
        length=length,
        accumulation=r.train.grad_accumulation,
        optimizer_bytes=sum(v.nbytes for _, v in tree_flatten(run.optimizer.state)),
        drawn_logits=bool(getattr(run.optimizer, "curvature_every", None)),
        masters=run.engine.masters is not None,
        attention_scores=attention in ("reference", "off"),
        chunked_attention=attention == "chunked",
        native_attention=attention == "native",
        logits_full=loss_tier == "reference",
        logit_chunk=chunk_elements(),
        checkpointed=checkpointed_layers(model),
        # dense linear/embedding elements 4-bit quantization would pack
        quantizable=0 if quantized else sum(m.weight.size for m in modules if _packable(m)),
        rows_per_example=max(1, rows // r.train.batch_size),
        sequences_per_example=run.objective.sequences_per_example,
        reference_forward=reference["forward"],
        reference_bytes=reference["bytes"],
        objective_bytes=reference.get("step_bytes", 0),
        generation_rows=generating[0],
        generation_length=generating[1],
        micro_key=run.objective.micro_key,
        trained_inputs=trained_inputs(blocks[0]) if blocks else None,
        fused_score_arrays=2 if mx.default_device() == mx.cpu else 4,
        tower_row_bytes=(
            model.tower_pass_bytes(parts.train_set, rows) / max(rows, 1)
            if isinstance(model, VisionLM)
            else 0.0
        ),
        tower_trains=bool(getattr(model, "tower_trains", False)),
        head_chunk_bytes=head_chunk,
        **(_blocks(blocks or []) if not tensor.is_split(model) else {}),
        **delta_layout(model, cfg),
        **_qat_blocks(blocks or [], act_bytes),
    )


def _qat_blocks(blocks, act_bytes: int) -> dict:
    """The Shape's QAT figures: a block's prepared weights (as fake-quantized copies, in their
    dtype) and, for adapted layers, their merged weights' gradients (in the activations'
    dtype); a learned quantization's layers likewise (their de-quantized weights and codes,
    and those weights' gradients on the way to the scales and biases); averages over the
    blocks."""
    copies = grads = 0
    for b in blocks:
        for _, m in b.named_modules():
            if qat.is_prepared(m):
                w = qat.merged_weight(m)  # a lazy graph: its shape and dtype, nothing computed
                copies += w.size * w.dtype.size
                grads += w.size * act_bytes if isinstance(m, LoRALinear) else 0
            elif qat.is_learned(m):  # its de-quantized weight and its codes as numbers
                size = m.scales.size * m.group_size  # (both kept for the scales' gradient)
                copies += 2 * size * m.scales.dtype.size
                grads += size * act_bytes
    n = max(len(blocks), 1)
    return {"qat_block_bytes": copies // n, "qat_block_grad_bytes": grads // n}


def _blocks(blocks) -> dict:
    """The Shape's whole figures of the transformer blocks (``block_*``) and ``sharded``: the
    ranks a fully sharded run divides them among."""
    weight = trainable = trainable_bytes = trainable_16 = 0
    sharded = 1
    for b in blocks:
        if isinstance(b, ShardedUnit):
            held, elements = b.whole_sizes()
            dtypes = {v.dtype for _, v in tree_flatten(b.trainable_parameters())}
            size = max((d.size for d in dtypes), default=4)
            weight, trainable = weight + held, trainable + elements
            trainable_bytes += elements * size
            trainable_16 += elements if size == 2 else 0
            sharded = b._group.size()
            continue
        weight += sum(v.nbytes for _, v in tree_flatten(b.parameters()))
        t = tree_flatten(b.trainable_parameters())
        trainable += sum(v.size for _, v in t)
        trainable_bytes += sum(v.nbytes for _, v in t)
        trainable_16 += sum(v.size for _, v in t if v.dtype in (mx.bfloat16, mx.float16))
    return {
        "block_weight_bytes": weight,
        "block_trainable": trainable,
        "block_trainable_bytes": trainable_bytes,
        "block_trainable_16bit": trainable_16,
        "sharded": sharded,
    }


def over_ranks(s: Shape, n: int) -> Shape:
    """``s`` as ``distributed.strategy: fsdp`` over ``n`` ranks would hold it: a rank keeps
    what lies outside the blocks and 1/n of the blocks' weights, trainable weights, fp32
    masters and optimizer state (n = 1: all of it, as data parallelism does)."""

    def part(total: int, block: int) -> int:
        return int(total - block / s.sharded + block / n)

    trainable = part(s.trainable, s.block_trainable)
    return replace(
        s,
        weight_bytes=part(s.weight_bytes, s.block_weight_bytes),
        trainable=trainable,
        trainable_bytes=part(s.trainable_bytes, s.block_trainable_bytes),
        trainable_16bit=part(s.trainable_16bit, s.block_trainable_16bit),
        # the optimizer's state follows the trainable elements
        optimizer_bytes=int(s.optimizer_bytes * trainable / max(s.trainable, 1)),
        sharded=n,
    )


def _packable(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % 64 == 0


def _quantized_head(lm, loss_tier: str, tokens: int, hidden: int, act_bytes: int):
    """(dense bytes, chunk bytes) a step holds of a quantized LM head: the chunked loss
    de-quantizes a chunk of its rows at a time (in fp32, about five chunks in flight: measured
    on the CPU, 84 MB for a 128k x 2048 head at 511 tokens); the other tiers, or a head with a
    bias, de-quantize it whole, which on the CPU peaks at twice the dense matrix."""
    head = lm.head
    if not is_quantized(head):
        return 0, 0
    vocab = head.scales.shape[0]
    if loss_tier == "chunked" and not lm.head_bias:
        columns = min(chunk_size(tokens, vocab), chunk_size(hidden, vocab, 4 * chunk_elements()))
        return 0, 5 * columns * hidden * 4
    return vocab * hidden * act_bytes * (2 if mx.default_device() == mx.cpu else 1), 0


def alternatives(s: Shape, budget: float, recipe) -> list[str]:
    """Concrete recipe changes that would fit the budget, each with its estimate."""
    out = []

    def fits(change: str, shape: Shape):
        total = estimate(shape)["total"]
        if total <= budget:
            out.append(f"{change} (about {total / GB:.2f} GB)")
            return True
        return False

    _smaller_batches(s, fits)
    _shorter_rows(s, recipe.data.packing, fits, budget)
    if s.attention_scores:
        fits(
            "kernels.attention: chunked (keeps no scores)",
            replace(s, attention_scores=False, chunked_attention=True),
        )
    if s.logits_full:
        fits("kernels.loss: chunked (never builds the logits)", replace(s, logits_full=False))
    if s.checkpointed < s.layers:
        fits(
            "train.grad_checkpointing: true (each layer recomputes its activations in the "
            "backward pass)",
            replace(s, checkpointed=s.layers),
        )
    if not s.full and s.quantizable:
        packed = s.quantizable * (0.5 + 2 * s.act_bytes / 64)  # 4 bits, a scale and bias per 64
        fits(
            "model.quantize: {bits: 4, group_size: 64} (QLoRA: the base held in 4 bits)",
            replace(s, weight_bytes=int(s.weight_bytes - s.quantizable * s.act_bytes + packed)),
        )
    if s.act_bytes == 4:
        half = replace(
            s,
            act_bytes=2,
            weight_bytes=s.weight_bytes // 2,
            trainable_bytes=s.trainable_bytes // 2 if s.full else s.trainable_bytes,
            trainable_16bit=s.trainable if s.full else 0,
            masters=s.full,
        )
        fits("model.dtype: bfloat16 (fp32 master weights are kept)", half)
    if s.sharded == 1 and s.block_weight_bytes:
        for n in (2, 4, 8):
            if fits(
                f"distributed.strategy: fsdp over {n} machines (mlx.launch --hostfile; each "
                f"rank holds 1/{n} of the blocks' weights, gradients and optimizer state)",
                over_ranks(s, n),
            ):
                break
    if s.full:
        lora = s.layers * 8 * ((s.hidden + s.q_dim) + (s.hidden + s.kv_dim // 2))
        fits(
            "adapter.type: lora (rank 8 on q_proj and v_proj)",
            replace(
                s,
                trainable=lora,
                trainable_bytes=4 * lora,
                trainable_16bit=0,
                masters=False,
                full=False,
                trained_inputs=s.hidden,
            ),
        )
    return out


def _smaller_batches(s: Shape, fits) -> None:
    """The largest halved train.batch_size (accumulating the rest) that ``fits``; where the
    objective sets a pass's rows by its own key, the largest halved value of that."""
    if s.micro_key is not None:
        rows = s.batch
        while rows > 1:
            rows //= 2
            if fits(f"{s.micro_key}: {rows} (the same update)", replace(s, batch=rows)):
                return
        return
    per = s.rows_per_example  # train.batch_size counts examples (pairs: two rows each)
    b, acc = s.batch // per, s.accumulation
    while b > 1:
        b //= 2
        acc *= 2
        per_step = s.batch // per * s.accumulation
        if fits(
            f"train.batch_size: {b} with train.grad_accumulation: {acc} "
            f"(the same {per_step} examples per step)",
            replace(s, batch=b * per, accumulation=acc),
        ):
            return


def longest_that_fits(length: int, ok, floor: int = 64, step: int = 64) -> int | None:
    """The longest length under ``length`` for which ``ok(length)`` holds (a peak that grows
    with the length): halvings first, then the gap above the first that fits bisected down to
    ``step``. None when not even the halving nearest ``floor`` (at least it) fits."""
    hi, lo = length, length // 2
    while lo >= floor and not ok(lo):
        hi, lo = lo, lo // 2
    if lo < floor:
        return None
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _shorter_rows(s: Shape, packing: str, fits, budget: float) -> None:
    """The longest row length that fits (to 64 tokens; at least 32), as the data keys that
    set it."""
    length = longest_that_fits(
        s.length, lambda n: estimate(replace(s, length=n))["total"] <= budget, floor=32
    )
    if length is None:
        return
    if packing == "off":
        change = f"data.max_length: {length + 1} (the longest that fits; longer examples are cut)"
    elif packing == "stream":
        change = f"data.pack_length: {length + 1} (shorter rows of the stream)"
    else:  # an example packs whole: each of its sequences at most its share of a row
        most = (length + 1) // s.sequences_per_example
        change = (
            f"data.pack_length: {length + 1} with data.max_length at most {most} "
            "(longer examples are cut)"
        )
    fits(change, replace(s, length=length))


def plan(shape: Shape, recipe, log) -> dict[str, float]:
    """Estimate a run's peak memory and weigh it against the budget (``memory.limit_gb``, else
    the device's); over it, refuse with the recipe changes that would fit (or, with
    ``memory.check: warn``, log them and go on). The estimate, by part."""
    m = recipe.memory
    est = estimate(shape)
    budget, what = run_budget(recipe)
    log(f"memory: estimated peak {describe(est)}; the budget is {budget / GB:.2f} GB ({what})")
    if shape.sharded > 1:
        whole = estimate(over_ranks(shape, 1))["total"]
        log(
            f"memory: that is a rank's, the blocks divided among {shape.sharded} ranks (fsdp); "
            f"each would need about {whole / GB:.2f} GB with distributed.strategy: data"
        )
    if est["total"] <= budget or m.check == "off":
        return est
    fits = alternatives(shape, budget, recipe)
    msg = (
        f"this run needs about {est['total'] / GB:.2f} GB at its peak, more than the "
        f"{budget / GB:.2f} GB of {what}; "
        + (
            "any of these would fit: " + "; ".join(fits)
            if fits
            else "no single change fits: combine a smaller train.batch_size, a shorter "
            "data.max_length, adapter.type: lora and model.dtype: bfloat16"
        )
        + " (memory.check: warn runs it anyway)"
    )
    if m.check == "warn":
        log(f"WARNING: {msg}")
        return est
    raise UserInputError(msg, recipe.source or "recipe")
