"""Kernel tiers chosen by measurement: the policy against made-up times and memory, the cache,
the choice by shape in the kernels' entry points, and a run that writes its table and a second
one that reads the times back."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import tiny_recipe
from mlxtune import Trainer, kernels
from mlxtune.config import recipe_from_dict
from mlxtune.console import Console
from mlxtune.kernels import tune
from mlxtune.kernels.tune import Case, TimeCache, Tuned, cached_clock, decide
from mlxtune.loop import tiers as run_tiers

ATT = Case("attention", (2, 4, 2, 64, 16), "float32")


def clock_of(times: dict, calls: list | None = None):
    """A clock that reads ``times[tier]`` (raising for a tier missing from it) and notes calls."""

    def seconds_of(tier, case, **_):
        if calls is not None:
            calls.append(tier)
        if tier not in times:
            raise RuntimeError(f"{tier} cannot run this shape")
        return times[tier]

    return seconds_of


def peaks_of(peaks: dict):
    return lambda tier, case, **_: peaks[tier]


def test_the_fastest_tier_that_fits_is_chosen_and_one_over_the_budget_is_never_timed():
    calls = []
    d = decide(
        ATT,
        ["native", "chunked", "metal"],
        clock_of({"native": 0.5, "chunked": 0.2, "metal": 0.1}, calls),
        peaks_of({"native": 10.0, "chunked": 5.0, "metal": 50.0}),
        budget=20.0,
    )
    assert d.tier == "chunked" and d.why == "the fastest that fits"
    assert calls == ["native", "chunked"]  # metal's step does not fit: never run
    over = next(r for r in d.rows if r.tier == "metal")
    assert over.seconds is None and "budget" in over.note


def test_a_tier_that_fails_is_passed_over_and_none_fitting_takes_the_leanest():
    d = decide(
        ATT,
        ["native", "chunked"],
        clock_of({"chunked": 0.9}),
        peaks_of({"native": 1, "chunked": 2}),
        10,
    )
    assert d.tier == "chunked"  # native raised: never chosen, however lean
    assert next(r for r in d.rows if r.tier == "native").note.startswith("failed: native cannot")
    lean = decide(
        ATT, ["native", "chunked"], clock_of({}), peaks_of({"native": 30, "chunked": 12}), 10
    )
    assert lean.tier == "chunked" and "leanest" in lean.why


def test_the_default_keeps_a_shape_where_it_measured_within_the_edge_of_the_fastest():
    both = ["native", "chunked"]
    fits = peaks_of({"native": 1, "chunked": 1})

    def chosen(native, chunked, budget=9):
        times = {"native": native, "chunked": chunked}
        return decide(ATT, both, clock_of(times), fits, budget, default="chunked")

    near = chosen(0.100, 0.104)  # 4% slower: the default stays
    assert near.tier == "chunked" and "within 5% of the fastest that fits (native)" in near.why
    assert chosen(0.100, 0.106).tier == "native"  # 6% slower: the fastest takes the shape
    assert chosen(0.2, 0.1).why == "the fastest that fits"
    # a default over the budget is never kept, however close its time
    over = decide(
        ATT,
        both,
        clock_of({"native": 0.100, "chunked": 0.101}),
        peaks_of({"native": 1, "chunked": 20}),
        9,
        default="chunked",
    )
    assert over.tier == "native"


def test_a_named_tier_is_used_as_named_and_said_to_be_slow_past_twice_the_fastest():
    times = {"native": 0.1, "chunked": 0.25}
    both = ["native", "chunked"]

    def named_chunked():
        return decide(ATT, both, clock_of(times), peaks_of(dict.fromkeys(both, 1)), 9, "chunked")

    slow = named_chunked()
    assert slow.tier == "chunked" and "2.5x slower than native" in slow.why
    times["chunked"] = 0.19
    ok = named_chunked()
    assert ok.tier == "chunked" and ok.why == "named in the recipe"


def at(t: int, tier: str, heads: int = 4, dim: int = 16):
    """The decision for attention at length ``t`` where ``tier`` alone was timed."""
    case = Case("attention", (1, heads, 2, t, dim), "float32")
    return decide(case, [tier], clock_of({tier: 1.0}), peaks_of({tier: 0}), 1)


def test_tuned_runs_each_call_in_the_tier_of_the_next_measured_shape_up():
    tuned = Tuned("attention", [at(512, "chunked"), at(64, "native"), at(128, "native")])
    assert [tuned.tier_at(t) for t in (1, 64, 65, 128, 129, 512, 4096)] == [
        "native",
        "native",
        "native",
        "native",
        "chunked",
        "chunked",
        "chunked",
    ]
    assert str(tuned) == "measured: native, chunked from 512"


def test_the_entry_points_run_the_tier_tuned_for_the_call(monkeypatch):
    calls = []
    for name in ("native", "chunked"):
        fn = kernels.ATTENTION_IMPLS[name]
        monkeypatch.setitem(
            kernels.ATTENTION_IMPLS, name, lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a)
        )

    tuned = Tuned("attention", [at(16, "native", 2, 8), at(64, "chunked", 2, 8)])
    for t in (12, 40):
        q = mx.random.normal((1, 2, t, 8))
        out = kernels.attention(q, q, q, scale=0.3, impl=tuned)
        want = kernels.attention(q, q, q, scale=0.3, impl="reference")
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
    assert calls == ["native", "chunked"]


def test_the_cache_is_keyed_by_device_version_dtype_and_shape(tmp_path):
    path = tmp_path / "times.json"
    c = TimeCache(path, device="gpu: A")
    c.record(ATT, "native", 0.25)
    c.save()
    again = TimeCache(path, device="gpu: A")
    assert again.seconds(ATT, "native") == 0.25
    assert again.seconds(ATT, "chunked") is None
    other_dtype = Case("attention", ATT.dims, "bfloat16")
    other_shape = Case("attention", (2, 4, 2, 128, 16), "float32")
    packed = Case("attention", ATT.dims, "float32", segments=True)
    assert all(again.seconds(c, "native") is None for c in (other_dtype, other_shape, packed))
    assert TimeCache(path, device="gpu: B").seconds(ATT, "native") is None
    # another device's times stay beside this one's
    b = TimeCache(path, device="gpu: B")
    b.record(ATT, "native", 0.5)
    b.save()
    assert TimeCache(path, device="gpu: A").seconds(ATT, "native") == 0.25
    # times taken under another MLX version (or other kernel sources) are dropped
    data = json.loads(path.read_text())
    data["gpu: A"]["mlx"] = "0.0.1"
    path.write_text(json.dumps(data))
    assert TimeCache(path, device="gpu: A").seconds(ATT, "native") is None
    data["gpu: B"]["kernels"] = "another"
    path.write_text(json.dumps(data))
    assert TimeCache(path, device="gpu: B").seconds(ATT, "native") is None
    path.write_text("{not json")
    assert TimeCache(path, device="gpu: A").seconds(ATT, "native") is None


def test_a_cached_clock_reads_back_what_it_measured(tmp_path):
    calls = []
    clock = cached_clock(TimeCache(tmp_path / "t.json", "cpu: x"), clock_of({"native": 0.3}, calls))
    assert clock("native", ATT) == 0.3 and clock("native", ATT) == 0.3
    assert calls == ["native"] and clock.hits == 1


def test_a_tier_far_behind_is_timed_once_and_the_cached_clock_bounds_it(
    tmp_path, real_kernel_clock
):
    ticks = iter(range(0, 1000, 5))  # each timed run takes 5 ticks
    once = Case("loss", (16, 40, 8), "float32")
    # run 1 took 5 > 4: not repeated; a bound it stays under does not cut the repeats
    assert tune.time_case("chunked", once, clock=lambda: next(ticks), bound=4) == 5
    assert next(ticks) == 10
    assert tune.time_case("chunked", once, clock=lambda: next(ticks), bound=6) == 5
    assert next(ticks) == 45  # three runs: six ticks taken
    bounds = []

    def clock(tier, case, bound=None):
        bounds.append(bound)
        return {"native": 0.4, "chunked": 0.1, "reference": 0.3}[tier]

    timed = cached_clock(TimeCache(tmp_path / "t.json", "cpu: x"), clock)
    for tier in ("native", "chunked", "reference"):
        timed(tier, ATT)
    assert bounds == [None, tune.LOST_BY * 0.4, tune.LOST_BY * 0.1]
    timed("native", once)
    assert bounds[-1] is None  # each shape its own fastest


def test_a_gpu_tier_is_timed_only_once_it_passed_its_check(monkeypatch):
    monkeypatch.setattr(kernels, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "self_check", lambda tier: "differs from the reference")
    assert run_tiers.candidates("attention") == ["native", "chunked"]
    monkeypatch.setattr(kernels, "self_check", lambda tier: None)
    assert run_tiers.candidates("loss") == ["reference", "chunked", "metal"]


def test_time_case_times_forward_and_backward_compiled(real_kernel_clock):
    ticks = iter(range(100))
    s = tune.time_case("chunked", Case("loss", (16, 40, 8), "float32"), clock=lambda: next(ticks))
    assert s == 1  # each timed run between two ticks of the clock
    assert tune.time_case("native", Case("attention", (1, 2, 1, 24, 8), "float32", True)) > 0


def _recipe(model_dir, data_dir, **kernels_cfg):
    return recipe_from_dict(
        tiny_recipe(
            data_dir, model_dir, kernels=kernels_cfg, train={"max_steps": 1, "progress": False}
        )
    )


def test_a_run_writes_its_table_and_the_next_reads_the_times_back(
    llama_dir, data_dir, tmp_path, monkeypatch, real_kernel_clock
):
    tr = Trainer(_recipe(llama_dir, data_dir), tmp_path / "a", console=Console(quiet=True))
    table = json.loads((tmp_path / "a" / "config_resolved.json").read_text())["kernels"]
    for op in ("attention", "loss"):
        assert table[op], op
        for row in table[op]:
            assert row["chosen"] in row["ms"] and row["ms"][row["chosen"]] > 0
        assert table["tiers"][op] == str(tr.tiers[op])
    assert table["cache"]["read_back"] == 0
    log = (tmp_path / "a" / "log.txt").read_text()
    assert "kernels.attention: auto -> " in log and "kernels: loss, forward and backward" in log

    def no_clock(tier, case, **_):
        raise AssertionError("timed again")

    monkeypatch.setattr(tune, "time_case", no_clock)
    again = Trainer(_recipe(llama_dir, data_dir), tmp_path / "b", console=Console(quiet=True))
    second = json.loads((tmp_path / "b" / "config_resolved.json").read_text())["kernels"]
    assert second["cache"]["read_back"] == sum(
        sum(v is not None for v in row["ms"].values())
        for op in ("attention", "loss")
        for row in table[op]
    )
    assert {op: str(again.tiers[op]) for op in ("attention", "loss")} == table["tiers"]


def test_autotune_off_keeps_the_fixed_defaults(llama_dir, data_dir, tmp_path, monkeypatch):
    def no_clock(tier, case, **_):
        raise AssertionError("timed")

    monkeypatch.setattr(tune, "time_case", no_clock)
    tr = Trainer(
        _recipe(llama_dir, data_dir, autotune=False), tmp_path / "r", console=Console(quiet=True)
    )
    assert tr.tiers == {"loss": "chunked", "attention": "chunked"}
    table = json.loads((tmp_path / "r" / "config_resolved.json").read_text())["kernels"]
    assert table == {"tiers": {"loss": "chunked", "attention": "chunked"}}


def test_a_named_tier_runs_as_named_and_the_log_warns_when_it_is_slow(
    llama_dir, data_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        tune, "time_case", lambda tier, case, **_: {"reference": 0.5}.get(tier, 0.1)
    )
    tr = Trainer(
        _recipe(llama_dir, data_dir, loss="reference"), tmp_path / "r", console=Console(quiet=True)
    )
    assert tr.tiers["loss"] == "reference"
    log = (tmp_path / "r" / "log.txt").read_text()
    assert "WARNING: kernels.loss: reference at loss N=" in log and "5.0x slower than" in log


def test_a_resumed_run_decides_by_the_times_its_run_measured(
    llama_dir, data_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(tune, "time_case", lambda tier, case, **_: {"native": 0.1}.get(tier, 0.3))
    r = tiny_recipe(
        data_dir, llama_dir, train={"max_steps": 2, "progress": False}, checkpoints={"every": 1}
    )
    first = Trainer(recipe_from_dict(r), tmp_path / "run", console=Console(quiet=True))
    first.run()
    assert first.tiers["attention"] == "native"
    # another machine's cache (here: none), whose clock would choose otherwise
    monkeypatch.setenv("MLXTUNE_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(tune, "time_case", lambda tier, case, **_: {"chunked": 0.1}.get(tier, 0.3))
    r["train"]["max_steps"] = 3
    again = Trainer(
        recipe_from_dict(r), tmp_path / "run", console=Console(quiet=True), resume="step-000001"
    )
    assert again.tiers == first.tiers
    fresh = Trainer(recipe_from_dict(r), tmp_path / "new", console=Console(quiet=True))
    assert fresh.tiers["attention"] == "chunked"  # what the new clock says, without the record


def test_a_tier_whose_step_would_not_fit_is_left_out_and_the_log_says_so(
    llama_dir, data_dir, tmp_path
):
    from dataclasses import replace

    from mlxtune.memory import shape_of

    tr = Trainer(
        _recipe(llama_dir, data_dir, autotune=False), tmp_path / "r", console=Console(quiet=True)
    )
    shape = shape_of(tr)
    (case,) = run_tiers.cases(shape, "float32", False, True)["attention"]  # short rows: one
    peaks = {t: run_tiers.step_peak(shape, t, case) for t in ("native", "chunked")}
    assert peaks["native"] > peaks["chunked"]  # MLX's attention builds more of the scores
    lines = []
    r = replace(tr.recipe, kernels=replace(tr.recipe.kernels, autotune=True))
    clock = clock_of({"native": 0.1, "chunked": 0.5, "reference": 0.1})
    budget = (peaks["native"] + peaks["chunked"]) / 2
    tiers, table = run_tiers.measure_tiers(
        r, dict(tr.tiers), shape, budget, False, lines.append, clock
    )
    assert tiers["attention"] == "chunked"  # the faster native does not fit
    assert table["attention"][0]["ms"]["native"] is None
    assert any(
        line.startswith(f"kernels.attention: native left out at {case.label()}:") for line in lines
    )


def test_doctor_kernels_times_a_models_shapes_and_keeps_the_times(llama_dir, capsys, monkeypatch):
    from mlxtune.cli import main

    cfg = json.loads((llama_dir / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    timed = []

    def clock(tier, case, **_):
        timed.append((tier, case))
        return {"chunked": 2e-3}.get(tier, 1e-3)

    monkeypatch.setattr(tune, "time_case", clock)
    assert main(["doctor", "--kernels", str(llama_dir)]) == 0
    out = capsys.readouterr().out
    want = {
        ("attention", (1, heads, kv, t, d), packed) for t in (512, 2048) for packed in (0, 1)
    } | {("loss", (t, cfg["vocab_size"], cfg["hidden_size"]), 0) for t in (512, 2048)}
    assert {(c.op, c.dims, int(c.segments)) for _, c in timed} == want
    assert {t for t, _ in timed} == {"native", "chunked", "reference"}
    # every shape's row, the faster tier starred
    assert out.count("native 1.00*, chunked 2.00") == 4, out
    assert out.count("reference 1.00*, chunked 2.00") == 2, out
    assert "(0 read back)" in out
    monkeypatch.setattr(tune, "time_case", lambda *a, **k: pytest.fail("timed again"))
    assert main(["doctor", "--kernels", str(llama_dir)]) == 0
    assert f"({len(timed)} read back)" in capsys.readouterr().out


def test_doctor_kernels_of_a_recipe_prints_its_runs_table(llama_dir, data_dir, tmp_path, capsys):
    import yaml

    from mlxtune.cli import main

    recipe = tiny_recipe(data_dir, llama_dir, train={"max_steps": 1, "progress": False})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["doctor", "--kernels", str(tmp_path / "r.yaml")]) == 0
    out = capsys.readouterr().out
    assert "kernels: attention, forward and backward compiled" in out
    assert "kernels: loss, forward and backward compiled" in out
    # the suite's clock times the fixed default fastest: auto takes it at every shape
    assert "kernels.attention: chunked" in out and "kernels.loss: chunked" in out
