"""How a run ends, beside the loop: the best checkpoint's weights put back, the exports, the
summary, and a dry run's figures (one step, nothing written)."""

from __future__ import annotations

import time

import mlx.core as mx

from .. import distributed
from ..engine.memory import described, stage
from ..export import export
from ..models import value_head_aside
from ..runs.checkpoint import best_checkpoint


def restore_best(run_dir, engine, step: int, last_eval: dict, log) -> dict | None:
    """Put the best checkpoint's weights back (checkpoints.load_best_at_end); its evaluation
    (the keys of ``last_eval``), or None when the model at ``step`` is the best already or there
    is none."""
    best, info = best_checkpoint(run_dir)
    if best is None or info["step"] == step:
        return None
    engine.load_weights(best)
    log(f"restored the best checkpoint's weights (step {info['step']})")
    return {k: info[k] for k in last_eval if k in info}


def export_all(recipe, model, trained, run_dir, writing, log, stages: dict) -> None:
    """The recipe's export formats, each staged and renamed into RUN_DIR/export/FORMAT
    (``writing(what)``: around each write, which says what a failed one leaves); each one's
    time and memory into ``stages``."""
    # fused and gguf last (a vision model's fused export merges the adapters in place)
    fmts = sorted(recipe.export.formats, key=lambda f: f in ("fused", "gguf"))
    with value_head_aside(model):  # a PPO run's critic is no part of the policy
        for fmt in fmts:
            with writing(f"export/{fmt}"), run_dir.staged("export", fmt) as tmp:
                # a quantization-aware run's fused model is quantized as it trained
                fused_dtype = recipe.model.dtype if trained.qat is None else None
                dtype = fused_dtype if fmt == "fused" else None
                with stage(f"export/{fmt}", stages):
                    note = export(trained, fmt, tmp, dtype)
            took = described(stages[f"export/{fmt}"])
            log(f"exported {fmt} to {run_dir.path / 'export' / fmt} ({took})")
            if note:
                log(note)


def summary(pos, meter, run_dir, train_time: float, final_eval: dict, **more) -> dict:
    """The run's summary (summary.json, the console's last lines, ``run()``'s value); ``more``:
    ``stopped_early``, and the exact match ``before``/``after`` and the evaluation at the start
    (``start_eval``) where there are."""
    out = {
        "steps": pos.step,
        "train_time_s": round(train_time, 2),
        "final_loss": pos.last_loss,
        "final_eval_loss": final_eval["eval_loss"],
        "best_eval_loss": pos.best_eval,
        "stopped_early": more["stopped_early"],
        "mean_step_time_s": meter.mean_step_time(),
        "first_step_compile_time_s": meter.first_step,
        "tokens_seen": pos.tokens_seen,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "run_dir": str(run_dir.path),
        "stages": more.get("stages", {}),
    }
    if more.get("before") is not None:
        out["exact_match_before"], out["exact_match_after"] = more["before"], more["after"]
    if "eval_reward" in final_eval:  # a reinforcement-learning objective's held-out reward
        if more.get("start_eval") is not None:
            out["eval_reward_at_start"] = more["start_eval"]["eval_reward"]
        out["final_eval_reward"] = final_eval["eval_reward"]
    return out


def dry_run(recipe, objective, engine, world, batches) -> dict:
    """One step, its compile included: its loss, grad norm, time and peak memory."""
    t0 = time.perf_counter()
    micro = [next(batches)[1] for _ in range(recipe.train.grad_accumulation)]
    total = sum(objective.count(b) for b in micro)
    res = engine.step(engine.micro_batches(micro), total)
    with distributed.collectives(world):
        mx.eval(res.loss_sum, res.count, res.norm)
    return {
        "dry_run": True,
        "first_step_compile_time_s": round(time.perf_counter() - t0, 3),
        "loss": res.loss_sum.item() / max(res.count.item(), 1),
        "grad_norm": res.norm.item(),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


__all__ = ["dry_run", "export_all", "restore_best", "summary"]
