"""GRPO throughput and memory: mlxtune against mlx-lm-lora's GRPO trainer (PyPI ``mlx-lm-lora``).

    python bench/compare_grpo.py                  # tiny llama, 32k vocab, 20 steps, ~5 min
    python bench/compare_grpo.py --quick          # 8 steps, ~2 min
    python bench/compare_grpo.py --batch 2 --group 4 --max-completion 64
    python bench/compare_grpo.py --beta 0.04      # with the KL to the reference (both sides)
    python bench/compare_grpo.py --micro 32       # and a row of mlxtune in passes of 32 rows
    python bench/compare_grpo.py --model-dir PATH # any HF-layout llama dir
    python bench/compare_grpo.py --peer-only      # mlx-lm-lora alone (--mlxtune-only too)

One invocation trains, on the same model and the same prompts, with the same LoRA (q_proj/v_proj
of every block, rank ``--rank``, scale ``--scale``, dropout 0), online GRPO: each step ``--batch``
prompts, each completed ``--group`` times by the policy as it is (temperature 1, top-p 1, no
top-k, at most ``--max-completion`` tokens, stopping only at the tokenizer's EOS), scored by the
same reward function (``reward`` below), advantages within each group, the clipped-ratio loss
(epsilon 0.2; on-policy, so the ratio is 1) with the "grpo" normalisation (each completion's token
mean, averaged over the completions: mlx-lm-lora's default ``grpo_loss_type``), ``--beta`` times
the KL to the reference (0 by default: no reference pass on either side), Adam at a constant
``--lr`` without clipping, for ``--steps`` steps:

1. mlxtune with ``objective: {type: grpo, loss: grpo, num_generations: G, ...}`` and its defaults
   otherwise (the generation engine: each prompt read once and its cache shared by its group;
   one compiled step over the B x G rows);
2. mlx-lm-lora's ``train_grpo``, given what its CLI gives it (``--reference``): a second loaded
   copy of the model as ``ref_model`` (``train.load_reference_model`` loads one for GRPO whatever
   the beta; at beta 0 it is held but never run);
3. (with ``--micro N``) mlxtune again with ``objective.micro_batch_size: N``: the step's rows in
   training passes of N completions (row 1 takes mlxtune's default, as many as fill about 1,024
   positions), gradients accumulated (the same update); ``--micro 32`` (B x G) shows what one
   pass over the whole batch costs and saves.

Each runs in its own Python process (this script re-invoked with ``--mlxtune-worker`` or
``--peer-worker SPEC.json``, printing one ``MLXTUNE_RESULT {json}`` / ``MLX_LM_LORA_RESULT {json}``
line), so each peak memory is its own (bench/compare_preference.py's set-up: both run it with
bench/harness.py). Prints a table (stderr) with steps/s, completion tokens/s, generation tokens/s, the
mean completion length, peak GB, the ratios mlxtune / peer and whether the targets are met
(>= 2x the peer's steps/s, <= 0.6x its peak memory), then one JSON line (stdout) with every figure.

A step is generation and training both, timed alike on both sides: each step's wall time (the
prompts' batch, generating its completions, scoring them, the step and waiting for it). mlxtune
runs with ``train.log_every: 1`` (each metrics row one step, ``step_time_s``; its
``generation_s`` is the generation's part); mlx-lm-lora with ``steps_per_report=1`` (its
``iterations_per_second`` = 1 / that step's wall time; ``generate_grpo`` is wrapped to time the
generation's part). ``steps_per_sec`` is the steady state: steps after the first whose input
shapes had been compiled before (both compile per shape; the shapes are recorded: mlxtune's
engine arrays, mlx-lm-lora's padded inputs of each loss chunk); ``_median`` is 1 / the median
steady step, ``_with_compiles`` counts every step after the first. Sampled completions differ
between the trainers, so lengths may too: ``completion_tokens_per_sec`` (completion tokens
trained on a second, steady steps) is the length-normalised figure and ``generation_tokens_per_sec``
the generation's alone; both are reported with each side's mean completion length (stop tokens
counted: both train on a sampled EOS). Memory: mlxtune's is the metrics rows' ``peak_memory_gb``
(reset right before the first step, generation included; the last row is written before the
run's final evaluation, which completes one batch of ``valid`` prompts); mlx-lm-lora's is
``mx.get_peak_memory()`` after ``train_grpo``, reset right before it. Each worker also reports
``other_cores``: the CPU the rest of the machine used while it trained, in cores (/proc/stat's
busy time less its own): on 2 cores a run beside other work (a test suite) is slower by far more
than noise, and its ratios are not to be trusted.

The prompts: ``--prompts`` rows of random lowercase words, ``--prompt-chars`` characters each,
given to both as a system turn (``SYSTEM``) and a user turn rendered with the tokenizer's chat
template and its generation prompt (mlxtune: chat messages; mlx-lm-lora: ``GRPODataset``'s
prompt/system/answer rows, as its CLI reads them); both workers return the first ``--check``
prompts' token ids and the bench compares them (``WARNING: tokenization:`` lines, the JSON's
``tokenization_mismatches``). All prompts have one length (the char-level tokenizer), so each side
compiles one shape unless a completion stops early.

The model: bench/lora_runs.py's tiny llama (hidden 256, 4 layers, fp32, random) at ``--vocab``
(32,768), the model bench/compare_preference.py trains. Its char-level tokenizer has 32 entries,
and the random model samples about uniformly over all 32,768 ids, so nearly every completion would
decode to nothing and every reward would tie. The bench gives the built model's tokenizer an added
(non-special) token for each id it lacks: uppercase letter strings (A, B, ..., AA, ...), which no
prompt contains, so prompts encode as before; completions now decode to uppercase text, and every
completion runs the full ``--max-completion`` tokens on both sides (EOS has a 1 in 32,768 chance a
token). The weights are the same. (``--model-dir``: used as it is.)

The reward (``reward``, the same function on both sides): the share of a completion's letters
(either case) that are among its row's ``answer`` letters (13 random letters a row): text only, no
token ids and no prompt text (mlxtune hands reward functions the rendered prompt, mlx-lm-lora the
raw user string), about 0.5 with a spread of a few hundredths within a group.

The peer side, and what it does differently (mlx-lm-lora 5.10.2, ``trainer/grpo_trainer.py``):

- Model and LoRA as bench/compare_preference.py's peer worker (``mlx_lm.utils.load``,
  ``linear_to_lora_layers`` with keys q_proj/v_proj on the last ``--layers`` blocks, frozen base).
  ``train_grpo`` sets no wired limit (its DPO trainer does), so no ``device_info`` patch is needed.
- Data: ``CacheDataset(GRPODataset(rows, tokenizer))`` as the CLI builds it: tuples (prompt ids,
  answer ids, prompt, answer, type); batches of ``--batch`` prompts from a random permutation of
  the length-sorted batches. Rewards are called as ``f(prompts=, completions=, answer=, types=)``.
- ``GRPOTrainingArgs``: group_size, max_completion_length, temperature 1, top_p 1, top_k 0,
  min_p 0, epsilon 0.2, beta, ``grpo_loss_type="grpo"``, token-level importance sampling, no
  gradient checkpointing, no validation, ``steps_per_report=1``. (Its CLI passes no top_p/top_k:
  the dataclass defaults are 0.95 and 20.) ``end_answer_token=""``: no stop string besides EOS
  (the default "</answer>" is added as a stop sequence).
- Generation (``generate_grpo``): mlx-lm's ``BatchGenerator`` with each prompt's prefill cache
  forked to its group, but ``completion_batch_size=batch_size``: at most ``--batch`` completions
  decode at a time, so B x G completions take G rounds of up to M decode steps. Not compiled.
- The loss: ``nn.value_and_grad`` over chunks of ``--batch`` completions (B x G rows in G
  chunks, each its own forward, backward and ``mx.eval``; gradients summed with weights); full
  [rows, L, vocab] fp32 logits per chunk; ``mx.compile`` only on the log-prob selection and the
  objective, not the model. Advantages use the group's population standard deviation (mlxtune:
  the sample one, ddof 1): a factor sqrt(G / (G - 1)) on the advantages, not on the cost.
- Process set-up: ``import mlxtune`` before ``mlx.core`` loads (its OpenBLAS and malloc set-up),
  as in bench/compare_preference.py, so both sides run the same BLAS and allocator settings.

Install the peer without touching mlx / mlx-lm / transformers / numpy / torch:

    .venv/bin/pip install --no-deps mlx-lm-lora==5.10.2
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

SCRIPT = Path(__file__).resolve()
RESULT_TAG, MLXTUNE_TAG = harness.RESULT_TAG, harness.MLXTUNE_TAG
FULL_STEPS, QUICK_STEPS = 20, 8
SYSTEM = "you are a terse assistant"  # the tiny tokenizer's alphabet only
ANSWER_LETTERS = 13


def reward(prompts, completions, completion_ids=None, answer=None, **_):
    """The share of each completion's letters (either case) that are among its row's ``answer``
    letters; 0 for a completion without letters. mlxtune calls it as ``f(prompts, completions,
    completion_ids, answer=...)``, mlx-lm-lora as ``f(prompts=, completions=, answer=, types=)``:
    it reads the completion text and the answer only."""
    out = []
    for text, ans in zip(completions, answer, strict=True):
        letters = [c for c in text.lower() if c.isalpha()]
        keep = set(str(ans).lower())
        out.append(sum(c in keep for c in letters) / len(letters) if letters else 0.0)
    return out


# --------------------------------------------------------------------------- the caller's side


def _in_child(flag: str, spec: dict, tag: str, what: str, opts: harness.RunOptions) -> dict:
    return harness.in_child(SCRIPT, flag, spec, tag, what, opts.timeout, opts.verbose)


def run_mlx_lm_lora_grpo(
    model_dir: Path,
    rows: list[dict],
    opts: harness.RunOptions,
    *,
    layers: int,
    group: int,
    max_completion: int,
    reference: str = "copy",
) -> dict:
    """Train mlx-lm-lora's online GRPO (LoRA on q_proj/v_proj) in a child process; return its
    figures (see ``_peer_worker``). ``rows``: dicts with "prompt", "answer" and "system" strings.
    ``opts``: both sides' options (``batch_size``: prompts a step; ``samples``: also return the
    first that many prompts' token ids). ``group``: completions a prompt, ``max_completion``:
    tokens a completion at most. ``reference``: "copy" (a second loaded model, as its CLI) or
    "none" (``ref_model=None``)."""
    if reference not in ("copy", "none"):
        raise ValueError(f"reference must be copy or none, not {reference!r}")
    spec = harness.child_spec(
        model_dir, rows, **opts.spec(), layers=layers, group=group, max_completion=max_completion,
        reference=reference,
    )  # fmt: skip
    return _in_child("--peer-worker", spec, RESULT_TAG, "mlx-lm-lora GRPO", opts)


def run_mlxtune_grpo(
    model_dir: Path,
    rows: list[dict],
    valid_rows: list[dict],
    opts: harness.RunOptions,
    *,
    group: int,
    max_completion: int,
    micro: int | None = None,
    dtype: str = "float32",
) -> dict:
    """Train mlxtune's online GRPO (LoRA on q_proj/v_proj of every block) in a child process;
    return its figures, named as ``run_mlx_lm_lora_grpo``'s. ``rows``/``valid_rows``: as
    ``run_mlx_lm_lora_grpo``'s, handed to mlxtune as chat messages (``as_messages``); the valid
    prompts are only read by the run's final evaluation (after the timing). ``micro``: the
    recipe's ``objective.micro_batch_size`` (None: its default)."""
    spec = harness.child_spec(
        model_dir, [as_messages(r) for r in rows], **opts.spec(),
        valid_rows=[as_messages(r) for r in valid_rows], group=group,
        max_completion=max_completion, micro=micro, dtype=dtype,
    )  # fmt: skip
    return _in_child("--mlxtune-worker", spec, MLXTUNE_TAG, "mlxtune GRPO", opts)


def as_messages(row: dict) -> dict:
    """A prompt/answer/system row as mlxtune's prompt row: the system and user turns as messages
    (rendered with the chat template and its generation prompt, as mlx-lm-lora's GRPODataset
    renders them), the answer as a field for the reward."""
    prompt = [{"role": "system", "content": row["system"]}] if "system" in row else []
    prompt.append({"role": "user", "content": row["prompt"]})
    return {"prompt": prompt, "answer": row["answer"]}


# --------------------------------------------------------------------------- the child process


def _timing(shapes: list, step_s: list[float], gen_s: list[float], tokens: list[int]) -> dict:
    """Steps/s (``harness.steady_rates``: the steps after the first whose shapes had been compiled
    before) and, over the same steady steps, completion tokens a second of step time and of
    generation time, and the mean generation and training seconds of a step."""
    out = harness.steady_rates(shapes, step_s, 1, unit="steps")
    steady, _, _ = harness.steady_steps(shapes)
    if not steady:  # no steady step: every step after the first
        steady = list(range(1, len(shapes))) or [0]
    step = sum(step_s[i] for i in steady)
    gen = sum(gen_s[i] for i in steady)
    tok = sum(tokens[i] for i in steady)
    out.update(
        {
            "completion_tokens_per_sec": tok / step,
            "generation_tokens_per_sec": tok / gen if gen else None,
            "generation_s_mean": gen / len(steady),
            "train_s_mean": (step - gen) / len(steady),
            "step_s_mean": step / len(steady),
            "completion_length_steady": tok / len(steady),
        }
    )
    return out


def _peer_worker(spec_path: str) -> None:
    setup = harness.process_setup()  # before mlx.core is imported

    import mlx_lm_lora
    from mlx_lm_lora.trainer import grpo_trainer
    from mlx_lm_lora.trainer.datasets import CacheDataset, GRPODataset

    spec = json.loads(Path(spec_path).read_text())
    # (its seeds: iterate_grpo_batches permutes its batches with np.random, mlx-lm's sampler
    # draws from mlx's global key; "copy": train.load_reference_model, for GRPO whatever the beta)
    model, tokenizer, ref_model = harness.load_peer(spec)
    keys = harness.peer_lora(model, spec)
    dataset = CacheDataset(GRPODataset(spec["rows"], tokenizer))

    # Each step: generate_grpo once (timed here), then _prepare_grpo_inputs once a loss chunk
    # (its padded inputs: the shapes the compiled parts see). train_grpo and grpo_loss look both
    # names up in their module, so wrappers there see every call.
    steps: list[dict] = []
    generate = grpo_trainer.generate_grpo
    prepare = grpo_trainer._prepare_grpo_inputs

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        completions, texts, indices = generate(*args, **kwargs)
        steps.append(
            {
                "generation_s": time.perf_counter() - t0,
                "lengths": [int(c.size) for c in completions],
                "shapes": [],
            }
        )
        return completions, texts, indices

    def recording_prepare(batch, completions, batch_indices):
        out = prepare(batch, completions, batch_indices)
        steps[-1]["shapes"].append(tuple(out[0].shape))
        return out

    grpo_trainer.generate_grpo = timed_generate
    grpo_trainer._prepare_grpo_inputs = recording_prepare

    rec = harness.report_recorder()
    args = harness.peer_training_args(
        grpo_trainer.GRPOTrainingArgs,
        spec,
        group_size=spec["group"],
        beta=spec["beta"],
        epsilon=0.2,
        epsilon_high=None,
        max_completion_length=spec["max_completion"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        grpo_loss_type="grpo",
        importance_sampling_level="token",
    )
    wall, peak, other = harness.train_peer(
        grpo_trainer.train_grpo, spec, model, ref_model, dataset, args, rec,
        tokenizer=tokenizer,
        reward_funcs=[reward],
        end_answer_token="",  # EOS only: no "</answer>" stop sequence
    )  # fmt: skip

    n = spec["steps"]
    if len(rec.rows) != n or len(steps) != n:
        raise SystemExit(f"expected {n} reports, got {len(rec.rows)} / {len(steps)}")
    step_s = [1.0 / r["iterations_per_second"] for r in rec.rows]
    gen_s = [s["generation_s"] for s in steps]
    tokens = [sum(s["lengths"]) for s in steps]
    rows_a_step = spec["batch_size"] * spec["group"]
    result = {"trainer": f"mlx-lm-lora {mlx_lm_lora.__version__}"}
    result.update(_timing([tuple(s["shapes"]) for s in steps], step_s, gen_s, tokens))
    result.update(
        {
            "peak_memory_gb": peak,
            "steps": n,
            "step_seconds": [round(s, 4) for s in step_s],
            "generation_seconds": [round(s, 4) for s in gen_s],
            "completion_tokens": tokens,
            "mean_completion_length": sum(tokens) / (n * rows_a_step),
            "frac_truncated": sum(
                ln >= spec["max_completion"] for s in steps for ln in s["lengths"]
            )
            / (n * rows_a_step),
            "input_shapes": [s["shapes"][0] if s["shapes"] else None for s in steps],
            "loss_chunks": len(steps[-1]["shapes"]),
            "reward_first": rec.rows[0]["train_total_rewards_mean"],
            "reward_last": rec.rows[-1]["train_total_rewards_mean"],
            # its own report: the groups' mean population std (ours: sample std, ddof 1)
            "reward_group_std_mean": statistics.mean(
                r["train_grouped_rewards_std"] for r in rec.rows
            ),
            "loss_first": rec.rows[0]["train_loss"],
            "loss_last": rec.rows[-1]["train_loss"],
            "train_wall_s": wall,
            "other_cores": other,
            "batch_size_prompts": spec["batch_size"],
            "group": spec["group"],
            "reference": spec["reference"],
            "lora_keys": keys,
            "trainable_params": harness.trainable_params(model),
            "prompts": len(dataset),
            "mean_prompt_tokens": sum(len(dataset[i][0]) for i in range(len(dataset)))
            / len(dataset),
            "eos_ids": sorted(int(i) for i in tokenizer.eos_token_ids),
            **harness.peer_sizes(model, ref_model, setup),
            "samples": [
                [int(t) for t in dataset[i][0]]
                for i in range(min(spec.get("samples", 0), len(dataset)))
            ],
        }
    )
    print(RESULT_TAG + json.dumps(result), flush=True)


def _mlxtune_worker(spec_path: str) -> None:
    harness.process_setup()  # first: mlxtune's OpenBLAS and malloc set-up, before mlx.core loads

    # isort: split

    spec = json.loads(Path(spec_path).read_text())
    b, g, m = spec["batch_size"], spec["group"], spec["max_completion"]
    objective = {
        "type": "grpo",
        "num_generations": g,
        "max_completion_length": m,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "epsilon": 0.2,
        "beta": spec["beta"],
        "loss": "grpo",  # mlx-lm-lora's default normalisation
        "rewards": [{"function": f"{SCRIPT}:reward"}],
        "micro_batch_size": spec["micro"],
    }
    # data.max_length: a prompt's tokens, for GRPO
    recipe = harness.lora_adam_recipe("bench-grpo", spec, objective)
    trainer, setup_s = harness.quiet_trainer(recipe, spec)

    # Every step's micro-batches as the arrays its compiled step takes (the B x G rows, padded,
    # in the objective's training passes).
    steps: list[list] = []
    engine = trainer.engine
    arrays_of, step_of = engine.arrays, engine.step_or_fall_back

    def recording_step(*args, **kwargs):
        steps.append([])
        return step_of(*args, **kwargs)

    def recording_arrays(batch):
        out = arrays_of(batch)
        if steps:
            steps[-1].append(tuple(sorted((k, tuple(v.shape)) for k, v in out.items())))
        return out

    engine.arrays, engine.step_or_fall_back = recording_arrays, recording_step

    ds = trainer.train_set.examples
    harness.start_timing()
    cpu0 = harness.cpu_mark()
    t0 = time.perf_counter()
    summary = trainer.run()
    wall = time.perf_counter() - t0
    other = harness.other_cores(cpu0, harness.cpu_mark())
    engine.arrays, engine.step_or_fall_back = arrays_of, step_of
    n = spec["steps"]
    shapes = [tuple(s) for s in steps]

    rows = [r for r in trainer.run_dir.read_jsonl("metrics.jsonl") if "step_time_s" in r]
    if len(rows) != n or len(shapes) != n:
        raise SystemExit(f"expected {n} rows, got {len(rows)} / {len(shapes)}")
    step_s = [r["step_time_s"] for r in rows]
    gen_s = [r["generation_s"] for r in rows]
    tokens = [round(r["completion_length"] * b * g) for r in rows]
    result = harness.mlxtune_figures(trainer, rows, summary)
    result.update(_timing(shapes, step_s, gen_s, tokens))
    result.update(
        {
            "steps": n,
            "step_seconds": [round(s, 4) for s in step_s],
            "generation_seconds": [round(s, 4) for s in gen_s],
            "completion_tokens": tokens,
            "mean_completion_length": sum(tokens) / (n * b * g),
            "frac_truncated": statistics.mean(r["frac_truncated"] for r in rows),
            "input_shapes": [dict(s[0])["tokens"] for s in shapes],
            "micro_batches": len(shapes[-1]),
            "micro_batch_size": spec["micro"],
            "pass_rows": [dict(p)["tokens"][0] for p in shapes[-1]],
            "reward_first": rows[0]["reward"],
            "reward_last": rows[-1]["reward"],
            "reward_group_std_mean": statistics.mean(r["reward_std"] for r in rows),
            "frac_reward_zero_std": statistics.mean(r["frac_reward_zero_std"] for r in rows),
            "loss_first": rows[0]["loss"],
            "loss_last": rows[-1]["loss"],
            "train_wall_s": wall,
            "other_cores": other,
            "setup_s": setup_s,
            "first_step_s": rows[0].get("first_step_compile_time_s"),
            "batch_size_prompts": b,
            "group": g,
            "reference": "adapters off" if spec["beta"] > 0 else "none (beta 0)",
            "prompts": len(ds),
            "mean_prompt_tokens": sum(len(e.prompt_ids) for e in ds) / len(ds),
            "eos_ids": sorted(int(i) for i in trainer.objective.eos),
            "samples": [list(map(int, e.prompt_ids)) for e in ds[: spec.get("samples", 0)]],
        }
    )
    print(MLXTUNE_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- the bench


def letter_name(i: int) -> str:
    """0 -> A, 25 -> Z, 26 -> AA, ...: the added tokens' text."""
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(65 + r) + s
    return s


def full_vocabulary(model_dir: Path) -> int:
    """Give the saved tokenizer (tokenizer.json) an added, non-special token for each model id
    it has no entry for (uppercase letter strings, which lowercase prompts never contain), so
    that every id the model samples decodes to text. Returns how many it added."""
    cfg = json.loads((model_dir / "config.json").read_text())
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    have = {t["id"] for t in tok["added_tokens"]} | set(range(len(tok["model"]["vocab"])))
    new = [i for i in range(cfg["vocab_size"]) if i not in have]
    tok["added_tokens"] += [
        {
            "id": i,
            "content": letter_name(k),
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
        for k, i in enumerate(new)
    ]
    path.write_text(json.dumps(tok))
    return len(new)


def make_prompts(n: int, chars: int, seed: int = 0) -> list[dict]:
    """``n`` rows: a prompt of random lowercase words, exactly ``chars`` characters, the system
    turn ``SYSTEM``, and an answer of ``ANSWER_LETTERS`` distinct random letters (the reward's)."""
    from lora_runs import LETTERS, words

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = words(rng, chars + 8)[:chars].strip()
        text = (text + " " + "a" * chars)[:chars] if len(text) < chars else text
        answer = "".join(sorted(rng.sample(LETTERS, ANSWER_LETTERS)))
        rows.append({"prompt": text, "answer": answer, "system": SYSTEM})
    return rows


def check_prompts(ours: list, peer: list) -> list[str]:
    """Where mlxtune's and mlx-lm-lora's token ids of the same prompts differ."""
    out = []
    for i, (a, b) in enumerate(zip(ours, peer, strict=False)):
        if a != b:
            out.append(harness.ids_differ(f"prompt {i}", a, b))
    if len(ours) != len(peer):
        out.append(f"{len(ours)} prompts compared from mlxtune, {len(peer)} from mlx-lm-lora")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(ap, FULL_STEPS, QUICK_STEPS)
    ap.add_argument("--prompts", type=int, default=64, help="training prompts")
    ap.add_argument("--prompt-chars", type=int, default=64, help="characters a user prompt")
    ap.add_argument("--batch", type=int, default=4, help="prompts a step")
    ap.add_argument("--group", type=int, default=8, help="completions a prompt (G)")
    ap.add_argument("--max-completion", type=int, default=32, help="tokens a completion (M)")
    ap.add_argument("--beta", type=float, default=0.0, help="KL weight (0: no reference pass)")
    ap.add_argument("--max-length", type=int, default=1024, help="tokens a prompt at most")
    ap.add_argument(
        "--reference",
        choices=["copy", "none"],
        default="copy",
        help="mlx-lm-lora's ref_model (copy: a second loaded model, as its CLI)",
    )
    ap.add_argument(
        "--micro",
        type=int,
        default=0,
        help="also run mlxtune with objective.micro_batch_size N (completions a training pass)",
    )
    ap.add_argument("--check", type=int, default=4, help="prompts whose tokens are compared")
    args = ap.parse_args(argv)

    if harness.worker_or_checked(ap, args, _peer_worker, _mlxtune_worker, FULL_STEPS, QUICK_STEPS):
        return
    if args.beta > 0 and args.reference == "none":
        ap.error("--beta > 0 needs mlx-lm-lora's reference: --reference copy")

    rows = make_prompts(args.prompts, args.prompt_chars, seed=args.seed)
    valid = make_prompts(args.batch, args.prompt_chars, seed=args.seed + 1)  # final eval only
    opts = harness.run_options(args)
    common = dict(group=args.group, max_completion=args.max_completion)
    ours = ours_micro = peer = None
    added = 0
    log = sys.stderr
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compare-grpo-") as tmp:
        model_dir, shape, vocab = harness.comparison_model(args, tmp)
        if args.model_dir is None:  # the tiny llama: every id decodes (config.json unchanged)
            added = full_vocabulary(Path(model_dir))
        if not args.peer_only:
            for micro in [None] + ([args.micro] if args.micro > 0 else []):
                r = run_mlxtune_grpo(model_dir, rows, valid, opts, micro=micro, **common)
                if micro is None:
                    ours = r
                else:
                    ours_micro = r
                label = "" if micro is None else f" (micro {micro})"
                print(f"  mlxtune{label}: {r['steps_per_sec']:.3f} steps/s, peak "
                      f"{r['peak_memory_gb']:.3f} GB, completions "
                      f"{r['mean_completion_length']:.1f} tokens, reward {r['reward_first']:.3f} "
                      f"-> {r['reward_last']:.3f}; other work {r['other_cores']} cores",
                      file=log, flush=True)  # fmt: skip
        if not args.mlxtune_only:
            peer = run_mlx_lm_lora_grpo(
                model_dir, rows, opts, layers=args.layers, reference=args.reference, **common
            )
            print(f"  {peer['trainer']} ({args.reference} reference): "
                  f"{peer['steps_per_sec']:.3f} steps/s, peak {peer['peak_memory_gb']:.3f} GB, "
                  f"completions {peer['mean_completion_length']:.1f} tokens, reward "
                  f"{peer['reward_first']:.3f} -> {peer['reward_last']:.3f}; other work "
                  f"{peer['other_cores']} cores",
                  file=log, flush=True)  # fmt: skip
    elapsed = time.perf_counter() - t0

    mismatch = []
    if ours is not None and peer is not None:
        mismatch = check_prompts(ours["samples"], peer["samples"])
        for line in mismatch:
            print(f"WARNING: tokenization: {line}", file=sys.stderr)
    ratios = {}
    if ours is not None and peer is not None:
        for key in (
            "steps_per_sec",
            "steps_per_sec_median",
            "completion_tokens_per_sec",
            "generation_tokens_per_sec",
            "peak_memory_gb",
            "mean_completion_length",
        ):
            if ours.get(key) and peer.get(key):
                ratios[key] = ours[key] / peer[key]
        # the step's two parts, mlxtune's seconds over the peer's (lower is better)
        ratios["generation_s"] = ours["generation_s_mean"] / peer["generation_s_mean"]
        ratios["train_s"] = ours["train_s_mean"] / peer["train_s_mean"]
        if ours_micro is not None:
            ours_micro["steps_per_sec_ratio"] = ours_micro["steps_per_sec"] / peer["steps_per_sec"]
            ours_micro["peak_memory_ratio"] = ours_micro["peak_memory_gb"] / peer["peak_memory_gb"]

    err = sys.stderr
    some = ours or peer
    name = str(args.model_dir) if args.model_dir else "tiny llama"
    print(
        f"{name} {shape['hidden_size']}x{shape['num_hidden_layers']} (ffn "
        f"{shape['intermediate_size']}, vocab {vocab:,}), LoRA r={args.rank} scale {args.scale} on "
        f"q_proj/v_proj; GRPO (loss grpo, beta {args.beta}), {args.batch} prompts x {args.group} "
        f"completions of <= {args.max_completion} tokens a step (T 1), Adam {args.lr} constant; "
        f"{args.prompts} prompts ({some['mean_prompt_tokens']:.0f} tokens), {args.steps} steps; "
        f"{some['device']}; {elapsed:.0f} s",
        file=err,
    )
    print(
        f"{'trainer':22} {'steps/s':>8} {'median':>7} {'w/ comp':>7} {'steady':>6} "
        f"{'compl tok/s':>11} {'gen tok/s':>9} {'gen s':>6} {'train s':>7} {'length':>6} "
        f"{'peak GB':>8} {'reward first->last':>18}",
        file=err,
    )
    table = (
        ([("mlxtune", ours)] if ours else [])
        + ([(f"mlxtune (micro {args.micro})", ours_micro)] if ours_micro else [])
    ) + ([(f"mlx-lm-lora ({args.reference})", peer)] if peer else [])
    for who, r in table:
        print(
            f"{who:22} {r['steps_per_sec']:8.3f} {r['steps_per_sec_median'] or float('nan'):7.3f} "
            f"{r['steps_per_sec_with_compiles']:7.3f} {r['steady_steps']:>3}/{r['steps']:<2} "
            f"{r['completion_tokens_per_sec']:11.1f} {r['generation_tokens_per_sec'] or 0:9.1f} "
            f"{r['generation_s_mean']:6.2f} {r['train_s_mean']:7.2f} "
            f"{r['mean_completion_length']:6.1f} {r['peak_memory_gb']:8.3f} "
            f"{r['reward_first']:8.3f} -> {r['reward_last']:.3f}",
            file=err,
        )
    if ratios:
        speed, mem = ratios["steps_per_sec"], ratios["peak_memory_gb"]
        print(
            f"mlxtune / mlx-lm-lora: steps/s {speed:.2f}x, completion tokens/s "
            f"{ratios['completion_tokens_per_sec']:.2f}x, generation tokens/s "
            f"{ratios.get('generation_tokens_per_sec', float('nan')):.2f}x, a step's generation "
            f"{ratios['generation_s']:.2f}x and training {ratios['train_s']:.2f}x the time, peak "
            f"memory {mem:.2f}x",
            file=err,
        )
        print(
            f"targets: steps/s {speed:.2f}x (>= 2x: {'met' if speed >= 2 else 'MISSED'}), peak "
            f"memory {mem:.2f}x (<= 0.6x: {'met' if mem <= 0.6 else 'MISSED'})",
            file=err,
        )
        if ours_micro is not None:
            print(
                f"mlxtune (micro {args.micro}) / mlx-lm-lora: steps/s "
                f"{ours_micro['steps_per_sec_ratio']:.2f}x, peak memory "
                f"{ours_micro['peak_memory_ratio']:.2f}x",
                file=err,
            )
        lr_ = ratios["mean_completion_length"]
        if abs(lr_ - 1) > 0.05:
            print(
                f"NOTE: mlxtune's completions are {lr_:.2f}x the peer's length "
                f"({ours['mean_completion_length']:.1f} against "
                f"{peer['mean_completion_length']:.1f} tokens): compare completion tokens/s",
                file=err,
            )
        else:
            print(
                f"completion lengths: {ours['mean_completion_length']:.1f} (mlxtune) and "
                f"{peer['mean_completion_length']:.1f} (mlx-lm-lora) tokens",
                file=err,
            )
    same = f"the same token ids in the first {args.check} prompts"
    harness.say_tokenization(ours is not None and peer is not None, mismatch, same)

    for r in (ours, ours_micro, peer):
        if r is not None:
            r.pop("samples", None)
    out = {
        "size": "quick" if args.quick else "full",
        "model": str(args.model_dir) if args.model_dir else f"tiny-{vocab}",
        "vocab": vocab,
        "added_tokens": added,
        "device": some["device"],
        "elapsed_s": round(elapsed, 1),
        "tokenization_mismatches": mismatch,
    }
    out.update(
        {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("peer_worker", "mlxtune_worker", "verbose")
        }
    )
    if ratios:
        out["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
        out["steps_per_sec_ratio"] = round(ratios["steps_per_sec"], 3)
        out["peak_memory_ratio"] = round(ratios["peak_memory_gb"], 3)
        out["targets_met"] = {
            "steps_per_sec_2x": ratios["steps_per_sec"] >= 2,
            "peak_memory_0.6x": ratios["peak_memory_gb"] <= 0.6,
        }
    out["mlxtune"] = ours
    out["mlxtune_micro"] = ours_micro
    out["mlx_lm_lora"] = peer
    print(json.dumps(out))


if __name__ == "__main__":
    main()
