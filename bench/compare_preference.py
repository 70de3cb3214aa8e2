"""DPO throughput and memory: mlxtune against mlx-lm-lora's DPO trainer (PyPI ``mlx-lm-lora``).

    python bench/compare_preference.py                 # tiny llama, 32k vocab, 40 steps, ~5 min
    python bench/compare_preference.py --quick         # 12 steps, ~2 min
    python bench/compare_preference.py --vocab 32 --batch 8 --steps 30
    python bench/compare_preference.py --model-dir PATH  # any HF-layout llama dir
    python bench/compare_preference.py --no-precomputed  # without the extra mlxtune row
    python bench/compare_preference.py --peer-only       # mlx-lm-lora alone (--mlxtune-only too)

One invocation trains, on the same model and the same preference pairs, with the same LoRA
(q_proj/v_proj of every block, rank ``--rank``, scale ``--scale``, dropout 0), ``--batch`` pairs a
step, Adam at a constant ``--lr`` without clipping, DPO's sigmoid loss at ``--beta``, for
``--steps`` steps:

1. mlxtune with ``objective: {type: dpo, loss: sigmoid, reference: auto}`` (the reference is the
   base with the LoRA adapters off: no second model) and its defaults otherwise (kernels auto,
   length-bucketed batches rounded to 8 positions, the head and loss over target rows only);
2. mlx-lm-lora's ``train_dpo`` with a second loaded copy of the model as the reference, as its
   CLI does (``--reference`` for its other two);
3. (unless ``--no-precomputed``) mlxtune again with ``reference: precomputed``: the reference
   log-probs of every pair computed once before training (in ``setup_s``), so a step runs no
   reference pass. Its difference from row 1 is what the reference pass costs mlxtune.

Each runs in its own Python process (this script re-invoked with ``--mlxtune-worker`` or
``--peer-worker SPEC.json``, printing one ``MLXTUNE_RESULT {json}`` / ``MLX_LM_LORA_RESULT {json}``
line), so each peak memory is its own and nothing one sets (wired limit, compile cache, malloc)
reaches the other. Prints a table (stderr) with pairs/s, peak GB, the ratios mlxtune / peer and
MFU, whether the project's targets are met (at the 32k vocabulary: >= 1.5x the peer's pairs/s,
<= 0.6x its peak memory), then one JSON line (stdout) with every figure.

The same tokens: mlxtune gets each pair as chat messages (``as_chat``: a user turn, and one
assistant turn per completion), which it renders with the tokenizer's chat template, as
mlx-lm-lora's ``DPODataset`` renders the strings. Both workers return their encoding of the first
``--check`` pairs and the bench compares them: the token ids of each sequence and the tokens
scored (mlx-lm-lora: every token from the generation prompt's length on); any difference prints
a ``WARNING: tokenization:`` line and is listed in the JSON's ``tokenization_mismatches``.

Timing, both sides alike: each step's wall time (building the batch, the step, waiting for it),
``pairs_per_sec`` = batch x steps / seconds over the steady steps: those after the first whose
input shapes had been compiled before (both trainers ``mx.compile`` their step per shape;
``pairs_per_sec_with_compiles`` counts every step after the first, ``pairs_per_sec_median`` is
batch / the median steady step). mlxtune runs with ``train.log_every: 1`` so that each metrics row
is one step (``step_time_s``): it then waits for every step, and the host no longer prepares the
next batch while the previous step runs (a small cost, against mlxtune); the engine's
``arrays`` is wrapped to record each step's input shapes (mlxtune's compile key: the padded
length and the number of target rows). Its peak memory is the metrics rows' ``peak_memory_gb``
(the loop resets it right before the first step; the last row is written before the run's final
evaluation, which reads one batch of ``valid`` pairs, so no training pair is held out).

MFU: model FLOPs of the real (unpadded) tokens per second over the fp32 matmul peak (the better
of a reading at the start and one at the end, as bench/compare_mlx_lm.py): the policy's forward
and backward (4 a weight a token, the LoRA count of compare_mlx_lm) plus the reference's forward
(2 a weight a token) where the step runs one (not with ``precomputed``), for the dataset's mean
pair (both trainers see the same pairs: mlxtune an epoch at a time, mlx-lm-lora a random batch
each step).

The peer side: ``run_mlx_lm_lora_dpo`` trains its offline DPO with LoRA on the given model and
preference rows and returns pairs per second and peak memory.

Install the peer without touching mlx / mlx-lm / transformers / numpy / torch:

    .venv/bin/pip install --no-deps mlx-lm-lora==5.10.2

(A plain ``pip install mlx-lm-lora`` would not change those either here, but pulls in
``datasets`` with pandas and pyarrow, which only its Hugging Face dataset loader imports. Its DPO
path needs only mlx, mlx-lm, numpy, transformers, tqdm, pyyaml and jinja2, all already present.)

What the worker does, and what it mirrors of ``mlx_lm_lora.train --train-mode dpo``:

- Model: ``mlx_lm.utils.load(model_dir)``, frozen, then ``mlx_lm.tuner.utils.linear_to_lora_layers``
  (the function mlx-lm-lora's ``utils.from_pretrained`` calls) with rank/scale/dropout 0 and
  ``keys`` = every ``q_proj``/``v_proj`` in a block, on the last ``layers`` blocks (``-1``: all).
  The CLI cannot restrict the keys (its ``build_lora_config`` drops them: it LoRAs every linear
  layer of a block), so the LoRA is built directly, like bench/compare_mlx_lm.py does for mlx-lm.
- Reference model (``reference=``): ``"copy"`` (default) is what the CLI does
  (``train.load_reference_model``: a second full ``load`` of the same weights, frozen);
  ``"shared"`` is a second module over the policy's base weight buffers (no extra weight
  memory; the same numbers since the base is frozen); ``"none"`` passes ``ref_model=None``, which
  mlx-lm-lora silently turns into a *reference-free* loss (reference scores of zero).
- Data: ``trainer.datasets.DPODataset`` (prompt/chosen/rejected rows rendered with the
  tokenizer's chat template; the generation prompt's length masks the prompt out of the scores)
  wrapped in ``CacheDataset``, as the CLI does.
- Training: ``trainer.dpo_trainer.train_dpo`` (its own compiled step and loop), sigmoid loss
  (``loss_type="sigmoid"`` passed to ``train_dpo`` itself: ``DPOTrainingArgs.loss_type`` is not
  read by it), ``beta``, Adam at a constant ``lr``, no clipping, no gradient checkpointing, no
  validation, batches of ``batch_size`` pairs (2 x batch_size sequences through the policy and
  2 x batch_size through the reference), padded to the batch's longest sequence. Its batches
  are fixed (the pairs sorted by the chosen sequence's length, cut into runs of batch_size, a
  last partial one dropped); ``train_dpo`` starts ``iterate_dpo_batches`` afresh every step, so
  each step trains on one of them drawn at random (with replacement), not epoch by epoch.
- Timing: ``steps_per_report=1`` so that its ``TrainingCallback.on_train_loss_report`` fires
  every step with ``iterations_per_second`` = 1 / (that step's wall time: batch building, the
  compiled step and its ``mx.eval``). ``dpo_trainer.iterate_dpo_batches`` is wrapped to record
  each step's padded batch shape. Its step is ``mx.compile``d with fixed shapes, so every new
  padded length traces and compiles again (once: the compile cache keeps every shape, and a
  dataset has at most len/batch_size distinct batches). ``pairs_per_sec`` is the steady state:
  steps after the first whose shape was already compiled. ``pairs_per_sec_with_compiles`` counts
  every step after the first.
- Memory: ``mx.reset_peak_memory()`` right before ``train_dpo``, ``mx.get_peak_memory()`` right
  after: it covers what is live during training (both models' weights, LoRA and Adam state,
  activations), not the loading.
- Process set-up: ``import mlxtune`` before ``mlx.core`` loads (its import-time set-up), so on
  Linux the peer gets the same OpenBLAS and malloc settings as mlxtune (bench/compare_mlx_lm.py gives mlx-lm the same). On an MLX build
  whose ``mx.device_info()`` has no ``max_recommended_working_set_size`` (the CPU backend),
  ``train_dpo`` would raise a KeyError setting its wired limit: the worker adds the key as 0
  (``mx.set_wired_limit(0)``, a no-op there).

The default run builds bench/lora_runs.py's tiny llama (hidden 256, 4 layers, fp32, the
char-level tokenizer of recipes/models/reverse-tiny with its chat template) at ``--vocab``
(32,768) and makes ``--pairs`` (64) synthetic preference pairs (prompt, chosen and rejected each
40-120 characters, i.e. tokens with that tokenizer; rendered, about 180 tokens a sequence).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402

REPO = HERE.parent
RESULT_TAG, MLXTUNE_TAG = harness.RESULT_TAG, harness.MLXTUNE_TAG
FULL_STEPS, QUICK_STEPS = 40, 12


# --------------------------------------------------------------------------- the caller's side


def run_mlx_lm_lora_dpo(
    model_dir: Path,
    train_rows: list[dict],
    opts: harness.RunOptions,
    *,
    layers: int,
    reference: str = "copy",
) -> dict:
    """Train mlx-lm-lora's DPO (LoRA on q_proj/v_proj) in a child process; return its figures.

    ``train_rows``: dicts with "prompt", "chosen", "rejected" (and optionally "system") strings.
    ``opts``: both sides' options; its ``batch_size``: pairs a step; its ``max_length``: longest
    sequence (prompt + response, rendered), longer ones are cut; its ``samples``: also return the
    token ids of the first that many pairs as it encodes them (``samples``: the chosen and
    rejected ids and the generation prompt's length). ``layers``: LoRA on the last ``layers``
    blocks, -1 for all. ``reference``: "copy" (a second loaded model, as mlx-lm-lora's CLI),
    "shared" (the policy's base weights), "none" (reference-free). Returns a dict with at least
    ``pairs_per_sec`` (steady state), ``peak_memory_gb`` and ``steps``; see ``_worker`` for the
    rest.
    """
    if reference not in ("copy", "shared", "none"):
        raise ValueError(f"reference must be copy, shared or none, not {reference!r}")
    spec = _spec(model_dir, train_rows, opts, layers=layers, reference=reference)
    return _in_child("--peer-worker", spec, RESULT_TAG, "mlx-lm-lora DPO", opts)


def _in_child(flag: str, spec: dict, tag: str, what: str, opts: harness.RunOptions) -> dict:
    return harness.in_child(__file__, flag, spec, tag, what, opts.timeout, opts.verbose)


# the numbers of a spec, as the types the workers read (the rest go as given)
_NUMBERS = dict(
    rank=int, scale=float, layers=int, batch_size=int, steps=int, lr=float, beta=float,
    max_length=int, seed=int, samples=int,
)  # fmt: skip


def _spec(model_dir, rows, opts: harness.RunOptions, **kw) -> dict:
    """``harness.child_spec`` of ``opts`` and ``kw``, the numbers (``_NUMBERS``) made ints and
    floats."""
    kw = {k: _NUMBERS[k](v) if k in _NUMBERS else v for k, v in {**opts.spec(), **kw}.items()}
    return harness.child_spec(model_dir, rows, **kw)


def as_chat(row: dict) -> dict:
    """A prompt/chosen/rejected row of strings as chat messages (a user turn, and an assistant
    turn for each completion; a "system" string becomes a system turn before the user's): the
    rows mlx-lm-lora's DPODataset builds from the strings, so both render through the same chat
    template."""
    prompt = [{"role": "system", "content": row["system"]}] if "system" in row else []
    prompt.append({"role": "user", "content": row["prompt"]})
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": row["chosen"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]}],
    }


def run_mlxtune_dpo(
    model_dir: Path,
    train_rows: list[dict],
    valid_rows: list[dict],
    opts: harness.RunOptions,
    *,
    reference: str = "auto",
    dtype: str = "float32",
    objective: dict | None = None,
) -> dict:
    """Train mlxtune's DPO (LoRA on q_proj/v_proj of every block) in a child process; return
    its figures, named as ``run_mlx_lm_lora_dpo``'s. ``objective``: another objective section
    on the same pairs instead (bench/compare_kto.py's KTO, ``unpair: true``).

    ``train_rows``/``valid_rows``: prompt/chosen/rejected strings, handed to mlxtune as chat
    messages (``as_chat``); the validation pairs are only read by the run's final evaluation
    (one batch, after the timing), so that no training pair is held out. ``reference``:
    mlxtune's ``objective.reference`` (auto: the base with the adapters off). ``opts``'s
    ``samples``: also return the first that many pairs as mlxtune encodes them."""
    if reference not in ("auto", "copy", "precomputed"):
        raise ValueError(f"reference must be auto, copy or precomputed, not {reference!r}")
    spec = _spec(
        model_dir, [as_chat(r) for r in train_rows], opts,
        valid_rows=[as_chat(r) for r in valid_rows], reference=reference, dtype=dtype,
        objective=objective,
    )  # fmt: skip
    return _in_child("--mlxtune-worker", spec, MLXTUNE_TAG, "mlxtune DPO", opts)


# --------------------------------------------------------------------------- the child process


def _worker(spec_path: str) -> None:
    setup = harness.process_setup()  # before mlx.core is imported

    import mlx.core as mx
    import mlx_lm_lora
    from mlx.utils import tree_map
    from mlx_lm.utils import load
    from mlx_lm_lora.trainer import dpo_trainer
    from mlx_lm_lora.trainer.datasets import CacheDataset, DPODataset

    spec = json.loads(Path(spec_path).read_text())

    # train_dpo does mx.set_wired_limit(mx.device_info()["max_recommended_working_set_size"]);
    # MLX's CPU backend has no such key. 0 there: set_wired_limit(0) is a no-op on CPU.
    _device_info = mx.device_info

    def device_info():
        info = dict(_device_info())
        info.setdefault("max_recommended_working_set_size", 0)
        return info

    mx.device_info = device_info

    # (its seeds: iterate_dpo_batches draws batches with np.random)
    model, tokenizer, ref_model = harness.load_peer(spec)
    if spec["reference"] == "shared":
        ref_model, _ = load(spec["model_dir"], lazy=True)
        # The policy's base weights (frozen: never updated), as new array objects over the same
        # buffers (stop_gradient's output shares its input's buffer: no copy). Handing it the very
        # same array objects fails: they are inputs of train_dpo's compiled step (model.state), and
        # mx.compile refuses them used from outside ("uncaptured inputs").
        shared = tree_map(mx.stop_gradient, model.parameters())
        mx.eval(shared)
        ref_model.update(shared)
        ref_model.freeze()

    keys = harness.peer_lora(model, spec)

    dataset = CacheDataset(DPODataset(spec["rows"], tokenizer))
    lengths = [
        (len(dataset[i]["chosen"]), len(dataset[i]["rejected"]), dataset[i]["chosen_prompt_length"])
        for i in range(len(dataset))
    ]

    # Every step's padded batch: train_dpo calls next(iterate_dpo_batches(...)) once per step,
    # looking the name up in its module, so a wrapper there sees each batch it trains on.
    shapes: list[tuple] = []
    original_iterate = dpo_trainer.iterate_dpo_batches

    def recording_iterate(*args, **kwargs):
        for batch in original_iterate(*args, **kwargs):
            chosen, rejected, chosen_masks, rejected_masks = batch
            shapes.append((tuple(chosen.shape), tuple(rejected.shape)))
            yield batch

    dpo_trainer.iterate_dpo_batches = recording_iterate

    rec = harness.report_recorder()
    args = harness.peer_training_args(
        dpo_trainer.DPOTrainingArgs, spec, beta=spec["beta"], loss_type="sigmoid"
    )
    wall, peak, _ = harness.train_peer(
        dpo_trainer.train_dpo, spec, model, ref_model, dataset, args, rec, loss_type="sigmoid"
    )

    if len(rec.rows) != spec["steps"] or len(shapes) != spec["steps"]:
        raise SystemExit(f"expected {spec['steps']} reports, got {len(rec.rows)} / {len(shapes)}")
    step_s = [1.0 / r["iterations_per_second"] for r in rec.rows]
    steady, _, _ = harness.steady_steps(shapes)
    steady_tokens = sum(rec.rows[i]["tokens_per_second"] * step_s[i] for i in steady)
    steady_tokens_s = sum(step_s[i] for i in steady)
    b = spec["batch_size"]
    result = {"trainer": f"mlx-lm-lora {mlx_lm_lora.__version__}"}
    # (with no steady step, every step had a new shape: all but the first)
    result.update(harness.steady_rates(shapes, step_s, b))
    result.update(
        {
            "peak_memory_gb": peak,
            "steps": spec["steps"],
            # response (scored) tokens of chosen + rejected, as its own tokens/s counts them
            "response_tokens_per_sec": steady_tokens / steady_tokens_s if steady_tokens_s else None,
            "step_seconds": [round(s, 4) for s in step_s],
            "batch_lengths": [s[0][1] for s in shapes],
            "loss_first": rec.rows[0]["train_loss"],
            "loss_last": rec.rows[-1]["train_loss"],
            "train_wall_s": wall,
            "batch_size_pairs": b,
            "reference": spec["reference"],
            "lora_keys": keys,
            "trainable_params": harness.trainable_params(model),
            "pairs": len(dataset),
            "mean_chosen_tokens": sum(c for c, _, _ in lengths) / len(lengths),
            "mean_rejected_tokens": sum(r for _, r, _ in lengths) / len(lengths),
            "mean_prompt_tokens": sum(p for _, _, p in lengths) / len(lengths),
            **harness.peer_sizes(model, ref_model if spec["reference"] == "copy" else None, setup),
            "samples": [
                {
                    "chosen": [int(t) for t in dataset[i]["chosen"]],
                    "rejected": [int(t) for t in dataset[i]["rejected"]],
                    "prompt_length": int(dataset[i]["chosen_prompt_length"]),
                }
                for i in range(min(spec.get("samples", 0), len(dataset)))
            ],
        }
    )
    print(RESULT_TAG + json.dumps(result), flush=True)


def _mlxtune_worker(spec_path: str) -> None:
    harness.process_setup()  # first: mlxtune's OpenBLAS and malloc set-up, before mlx.core loads

    # isort: split

    spec = json.loads(Path(spec_path).read_text())
    b = spec["batch_size"]
    objective = spec.get("objective") or {
        "type": "dpo",
        "beta": spec["beta"],
        "loss": "sigmoid",
        "reference": spec["reference"],
    }
    recipe = harness.lora_adam_recipe("bench-dpo", spec, objective)
    trainer, setup_s = harness.quiet_trainer(recipe, spec)  # for precomputed: its reference pass

    # Every step's batch, as the arrays its compiled step takes: the engine turns each batch into
    # them once a step (one micro-batch: no accumulation, no out-of-memory split here).
    steps: list[dict] = []
    engine = trainer.engine
    arrays_of = engine.arrays

    def recording_arrays(batch):
        out = arrays_of(batch)
        steps.append(
            {
                "shape": tuple(sorted((k, tuple(v.shape)) for k, v in out.items())),
                "pairs": batch.n_pairs,
                "length": int(batch.tokens.shape[1]),  # tokens a row, padding included
            }
        )
        return out

    engine.arrays = recording_arrays

    ds = trainer.train_set.examples
    harness.start_timing()
    t0 = time.perf_counter()
    summary = trainer.run()
    wall = time.perf_counter() - t0
    engine.arrays = arrays_of
    steps = steps[: spec["steps"]]  # then the final evaluation's batch

    rows = [r for r in trainer.run_dir.read_jsonl("metrics.jsonl") if "step_time_s" in r]
    if len(rows) != spec["steps"] or len(steps) != spec["steps"]:
        raise SystemExit(f"expected {spec['steps']} rows, got {len(rows)} / {len(steps)}")
    if any(s["pairs"] != b for s in steps):
        raise SystemExit(f"a step without {b} pairs: {[s['pairs'] for s in steps]}")
    step_s = [r["step_time_s"] for r in rows]
    result = harness.mlxtune_figures(trainer, rows, summary)
    result.update(harness.steady_rates([s["shape"] for s in steps], step_s, b))
    result.update(
        {
            "steps": spec["steps"],
            "step_seconds": [round(s, 4) for s in step_s],
            "batch_lengths": [s["length"] for s in steps],
            "loss_first": rows[0]["loss"],
            "loss_last": rows[-1]["loss"],
            "train_wall_s": wall,
            "setup_s": setup_s,
            "first_step_s": rows[0].get("first_step_compile_time_s"),
            "batch_size_pairs": b,
            "reference": spec["reference"],
            "reference_resolved": getattr(trainer.objective, "reference", None),
            "pairs": len(ds),
            "mean_chosen_tokens": sum(len(e.ids) for e in ds) / len(ds),
            "mean_rejected_tokens": sum(len(e.rejected_ids) for e in ds) / len(ds),
            "samples": [
                {
                    "chosen": list(map(int, e.ids)),
                    "rejected": list(map(int, e.rejected_ids)),
                    "chosen_mask": list(map(int, e.mask)),
                    "rejected_mask": list(map(int, e.rejected_mask)),
                }
                for e in ds[: spec.get("samples", 0)]
            ],
        }
    )
    print(MLXTUNE_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- the bench


def make_pairs(n: int, seed: int = 0, lo: int = 40, hi: int = 120) -> list[dict]:
    """``n`` synthetic preference rows, prompt/chosen/rejected each ``lo``-``hi`` characters
    (bench/lora_runs.py's ``words``: the tiny tokenizer's alphabet)."""
    from lora_runs import words

    rng = random.Random(seed)
    return [
        {
            "prompt": words(rng, rng.randint(lo, hi)),
            "chosen": words(rng, rng.randint(lo, hi)),
            "rejected": words(rng, rng.randint(lo, hi)),
        }
        for _ in range(n)
    ]


def check_tokens(ours: list[dict], peer: list[dict]) -> list[str]:
    """Where mlxtune's and mlx-lm-lora's encodings of the same pairs differ: the token ids of
    each sequence, then the tokens each scores (mlx-lm-lora: every token from the generation
    prompt's length on). No lines: they agree."""
    out = []
    for i, (a, b) in enumerate(zip(ours, peer, strict=False)):
        for key in ("chosen", "rejected"):
            if a[key] != b[key]:
                out.append(harness.ids_differ(f"pair {i} {key}", a[key], b[key]))
                continue
            theirs = [0] * b["prompt_length"] + [1] * (len(b[key]) - b["prompt_length"])
            mine = a[f"{key}_mask"]
            if mine[1:] != theirs[1:]:
                out.append(
                    f"pair {i} {key}: the same tokens, scored differently ({sum(mine[1:])} "
                    f"targets in mlxtune, {sum(theirs[1:])} in mlx-lm-lora)"
                )
    if len(ours) != len(peer):
        out.append(f"{len(ours)} pairs compared from mlxtune, {len(peer)} from mlx-lm-lora")
    return out


def dpo_flops_per_pair(vocab: int, tokens_per_pair: float, reference_pass: bool) -> float:
    """Model FLOPs of one pair's DPO step (both sequences): the policy's forward and backward
    (bench/lora_runs.py's LoRA count: 4 a weight a token) and, when the step runs one, the
    reference's forward (2 a weight a token), over the real tokens; attention at the sequences'
    mean length."""
    import lora_runs

    fpt = lora_runs.flops_per_token(vocab, tokens_per_pair / 2)
    return tokens_per_pair * fpt * (1.5 if reference_pass else 1.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(ap, FULL_STEPS, QUICK_STEPS)
    ap.add_argument("--pairs", type=int, default=64, help="training pairs")
    ap.add_argument("--batch", type=int, default=4, help="pairs a step")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument(
        "--reference",
        choices=["copy", "shared", "none"],
        default="copy",
        help="mlx-lm-lora's reference model (copy: as its CLI)",
    )
    ap.add_argument(
        "--mlxtune-reference",
        choices=["auto", "copy", "precomputed"],
        default="auto",
        help="mlxtune's objective.reference (auto: the base with the adapters off)",
    )
    ap.add_argument(
        "--no-precomputed",
        action="store_true",
        help="leave out the extra mlxtune row with reference: precomputed",
    )
    ap.add_argument("--check", type=int, default=4, help="pairs whose tokens are compared")
    args = ap.parse_args(argv)

    if harness.worker_or_checked(ap, args, _worker, _mlxtune_worker, FULL_STEPS, QUICK_STEPS):
        return

    sys.path.insert(0, str(HERE))
    import lora_runs  # noqa: E402  (the tiny llama, the matmul peak, FLOPs a token)

    rows = make_pairs(args.pairs, seed=args.seed)
    valid = make_pairs(max(args.batch, 4), seed=args.seed + 1)  # the final evaluation only
    opts = harness.run_options(args)
    ours: dict[str, dict] = {}
    peer = None
    t0 = time.perf_counter()
    peak = lora_runs.matmul_peak()
    with tempfile.TemporaryDirectory(prefix="compare-preference-") as tmp:
        model_dir, shape, vocab = harness.comparison_model(args, tmp)
        lora_runs.MODEL.clear()
        lora_runs.MODEL.update(shape)
        log = sys.stderr
        refs = [] if args.peer_only else [args.mlxtune_reference]
        if not (args.peer_only or args.no_precomputed) and args.mlxtune_reference != "precomputed":
            refs.append("precomputed")
        for i, ref in enumerate(refs):
            ours[ref] = run_mlxtune_dpo(model_dir, rows, valid, opts, reference=ref)
            r = ours[ref]
            print(f"  mlxtune ({ref} reference): {r['pairs_per_sec']:.2f} pairs/s, peak "
                  f"{r['peak_memory_gb']:.3f} GB, loss {r['loss_first']:.4f} -> "
                  f"{r['loss_last']:.4f}", file=log, flush=True)  # fmt: skip
            if i == 0 and not args.mlxtune_only:
                peer = run_mlx_lm_lora_dpo(
                    model_dir, rows, opts, layers=args.layers, reference=args.reference
                )
                print(f"  {peer['trainer']} ({args.reference} reference): "
                      f"{peer['pairs_per_sec']:.2f} pairs/s, peak {peer['peak_memory_gb']:.3f} "
                      f"GB, loss {peer['loss_first']:.4f} -> {peer['loss_last']:.4f}",
                      file=log, flush=True)  # fmt: skip
        if args.peer_only:
            peer = run_mlx_lm_lora_dpo(
                model_dir, rows, opts, layers=args.layers, reference=args.reference
            )
    peak = max(peak, lora_runs.matmul_peak())
    elapsed = time.perf_counter() - t0

    mismatch = []
    main_ref = args.mlxtune_reference
    if peer is not None and main_ref in ours:
        mismatch = check_tokens(ours[main_ref]["samples"], peer["samples"])
        for line in mismatch:
            print(f"WARNING: tokenization: {line}", file=sys.stderr)

    # model FLOPs of the real tokens: the same pairs on both sides
    some = peer or next(iter(ours.values()))
    tokens_per_pair = some["mean_chosen_tokens"] + some["mean_rejected_tokens"]
    table = []
    for who, r in [(f"mlxtune ({k})", v) for k, v in ours.items()] + (
        [(f"mlx-lm-lora ({args.reference})", peer)] if peer else []
    ):
        r.pop("samples", None)
        ref_pass = r["reference"] not in ("precomputed", "none")
        flops = r["pairs_per_sec"] * dpo_flops_per_pair(vocab, tokens_per_pair, ref_pass)
        r["model_gflops"] = flops / 1e9
        r["mfu"] = flops / peak
        r["padded_tokens_per_pair"] = 2 * statistics.mean(r["batch_lengths"])
        table.append((who, r))
    if peer is not None:
        for r in ours.values():
            r["pairs_per_sec_ratio"] = r["pairs_per_sec"] / peer["pairs_per_sec"]
            r["peak_memory_ratio"] = r["peak_memory_gb"] / peer["peak_memory_gb"]

    err = sys.stderr
    mod = lora_runs.MODEL
    name = str(args.model_dir) if args.model_dir else "tiny llama"
    print(
        f"{name} {mod['hidden_size']}x{mod['num_hidden_layers']} (ffn "
        f"{mod['intermediate_size']}, vocab {vocab:,}), LoRA r={args.rank} scale {args.scale} on "
        f"q_proj/v_proj; DPO sigmoid beta {args.beta}, Adam {args.lr} constant, no clipping; "
        f"{args.pairs} pairs ({tokens_per_pair:.0f} tokens a pair), {args.batch} a step, "
        f"{args.steps} steps; {some['device']}, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; "
        f"{elapsed:.0f} s",
        file=err,
    )
    print(
        f"{'trainer (reference)':28} {'pairs/s':>8} {'median':>7} {'w/ compiles':>11} "
        f"{'steady':>6} {'peak GB':>8} {'vs peer':>16} {'MFU':>6} {'loss first -> last':>19}",
        file=err,
    )
    for who, r in table:
        vs = (
            f"{r['pairs_per_sec_ratio']:5.2f}x {r['peak_memory_ratio']:5.2f}x mem"
            if "pairs_per_sec_ratio" in r
            else ""
        )
        med = r["pairs_per_sec_median"]
        print(
            f"{who:28} {r['pairs_per_sec']:8.2f} {med or float('nan'):7.2f} "
            f"{r['pairs_per_sec_with_compiles']:11.2f} {r['steady_steps']:>3}/{r['steps']:<2} "
            f"{r['peak_memory_gb']:8.3f} {vs:>16} {100 * r['mfu']:5.1f}% "
            f"{r['loss_first']:8.4f} -> {r['loss_last']:.4f}",
            file=err,
        )
    if peer is not None and main_ref in ours:
        r = ours[main_ref]
        speed, mem = r["pairs_per_sec_ratio"], r["peak_memory_ratio"]
        print(
            f"targets (mlxtune {main_ref} / mlx-lm-lora {args.reference}): pairs/s {speed:.2f}x "
            f"(>= 1.5x: {'met' if speed >= 1.5 else 'MISSED'}), peak memory {mem:.2f}x "
            f"(<= 0.6x: {'met' if mem <= 0.6 else 'MISSED'})",
            file=err,
        )
    same = f"the same token ids and scored tokens in the first {args.check} pairs"
    harness.say_tokenization(peer is not None and bool(ours), mismatch, same)

    out = {
        "size": "quick" if args.quick else "full",
        "model": str(args.model_dir) if args.model_dir else f"tiny-{vocab}",
        "vocab": vocab,
        "device": some["device"],
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "elapsed_s": round(elapsed, 1),
        "tokens_per_pair": round(tokens_per_pair, 1),
        "tokenization_mismatches": mismatch,
    }
    out.update(
        {
            k: v
            for k, v in vars(args).items()
            if k not in ("peer_worker", "mlxtune_worker", "model_dir", "verbose")
        }
    )
    if peer is not None and main_ref in ours:
        out["pairs_per_sec_ratio"] = round(ours[main_ref]["pairs_per_sec_ratio"], 3)
        out["peak_memory_ratio"] = round(ours[main_ref]["peak_memory_ratio"], 3)
    out["mlxtune"] = ours
    out["mlx_lm_lora"] = peer
    print(json.dumps(out))


if __name__ == "__main__":
    main()
