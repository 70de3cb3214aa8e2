"""Run tracking: TensorBoard's event files read back with TensorBoard's own reader, and a W&B
offline run's records read back as W&B's protobufs, each against metrics.jsonl as the run wrote
it; a resumed run continues the same record without a step twice; a reporter that is not
installed is refused with its install command."""

import json
import struct
import sys

import pytest

from conftest import TIMING, make_crash, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.loop.report import scalars

TIMING = TIMING - {"time"}


def recipe(data_dir, llama_dir, report):
    return tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False},
        eval={
            "every": 3,
            "max_batches": 1,
            "at_start": True,
            "exact_match": 2,
            "max_new_tokens": 4,
        },
        samples={"every": 4, "count": 1, "max_new_tokens": 4},
        checkpoints={"every": 3},
        report=report,
    )


def run(r, run_dir, crash=None, resume=None):
    return Trainer(
        recipe_from_dict(r),
        run_dir=run_dir,
        console=Console(quiet=True),
        callbacks=[make_crash(crash)] if crash else [],
        resume=resume,
    ).run()


def metrics(run_dir) -> dict[tuple[str, int], float]:
    """Every number of every metrics.jsonl row, by (tag, step), tagged as the reporters tag it."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for tag, v in scalars(row).items():
            out[(tag, row["step"])] = v
    return out


def tensorboard_scalars(run_dir):
    """{(tag, step): value} of the scalars TensorBoard's app loads from RUN_DIR/tensorboard (its
    plugin event accumulator, which also purges text on a restart), and the accumulator."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        steps = [e.step for e in acc.Tensors(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)  # no step read twice
        for e in acc.Tensors(tag):
            got[(tag, e.step)] = float(make_ndarray(e.tensor_proto))
    return got, acc


def steps(acc, tag) -> list[int]:
    return sorted(e.step for e in acc.Tensors(tag))


def test_tensorboard_holds_every_row_the_recipe_and_samples_and_resumes_in_place(
    tmp_path, data_dir, llama_dir
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = recipe(data_dir, llama_dir, ["tensorboard"])
    run(r, tmp_path / "whole")
    want = metrics(tmp_path / "whole")
    got, acc = tensorboard_scalars(tmp_path / "whole")
    assert set(got) == set(want) and len(want) > 40
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k  # stored as float32
    assert {"train/loss", "train/lr", "eval/loss", "eval/ppl"} <= {tag for tag, _ in got}
    assert steps(acc, "eval/exact_match_before") == [0]
    assert steps(acc, "eval/exact_match_after") == [8]
    assert acc.SummaryMetadata("config").plugin_data.plugin_name == "text"
    config = acc.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert "max_steps: 8" in config and "tensorboard" in config
    assert acc.SummaryMetadata("samples").plugin_data.plugin_name == "text"
    assert steps(acc, "samples") == [4, 8]
    first = json.loads((tmp_path / "whole" / "samples.jsonl").read_text().splitlines()[0])
    text = acc.Tensors("samples")[0].tensor_proto.string_val[0].decode()
    assert first["prompt"] in text and first["completion"] in text
    # cut after step 5 (checkpoint at 3, rows of steps 4 and 5 written), resumed from step 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(r, tmp_path / "cut", crash=5)
    cut_file = next((tmp_path / "cut" / "tensorboard").iterdir())
    run(r, tmp_path / "cut", resume="latest")
    assert len(list((tmp_path / "cut" / "tensorboard").iterdir())) == 2 and cut_file.exists()
    resumed = metrics(tmp_path / "cut")
    got, acc = tensorboard_scalars(tmp_path / "cut")  # each step once, as the resumed run wrote it
    assert set(got) == set(resumed)
    for k, v in resumed.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    assert steps(acc, "samples") == [4, 8]  # step 4's written by both attempts, read once
    legacy = EventAccumulator(str(tmp_path / "cut" / "tensorboard"), size_guidance={"scalars": 0})
    legacy.Reload()  # the older loader purges scalars on the same event
    for tag in legacy.Tags()["scalars"]:
        assert {e.step: e.value for e in legacy.Scalars(tag)} == {
            step: v for (t, step), v in got.items() if t == tag
        }
        assert len(legacy.Scalars(tag)) == len({e.step for e in legacy.Scalars(tag)}), tag


def wandb_records(path):
    """The protobuf records of a .wandb file (W&B's leveldb-style log: a 7-byte header, then
    32 KiB blocks of records, each with a 7-byte header and split across blocks by type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, _, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B"
    pos, block, parts, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # whole
            out.append(body)
        elif kind == 2:  # first
            parts = body
        elif kind == 3:  # middle
            parts += body
        elif kind == 4:  # last
            out.append(parts + body)
    records = []
    for b in out:
        rec = pb.Record()
        rec.ParseFromString(b)
        records.append(rec)
    return records


def wandb_history(run_dir):
    """(run ids and names, {(tag, step): value}, config, the steps samples were logged at, each
    attempt's exit code)."""
    ids, got, config, samples, exits = set(), {}, {}, [], []
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add((rec.run.run_id, rec.run.display_name))
                config |= {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
                step = int(items["_step"])
                for k, v in items.items():
                    if k.startswith(("train/", "eval/")):
                        assert (k, step) not in got, (k, step)  # never logged twice
                        got[(k, step)] = v
                if any(k.startswith("samples/") for k in items):
                    samples.append(step)
            elif kind == "exit":
                exits.append(rec.exit.exit_code)
    return ids, got, config, samples, exits


def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for name in ("WANDB_NAME", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_offline_holds_every_row_and_a_resumed_run_continues_it(
    tmp_path, data_dir, llama_dir, monkeypatch
):
    import wandb

    offline_wandb(monkeypatch)
    r = recipe(data_dir, llama_dir, ["wandb"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(r, tmp_path / "cut", crash=5)
    first = json.loads((tmp_path / "cut" / "wandb.json").read_text())
    # resumed with TensorBoard added: a reporter may join a resumed run
    run({**r, "report": ["wandb", "tensorboard"]}, tmp_path / "cut", resume="latest")
    assert json.loads((tmp_path / "cut" / "wandb.json").read_text())["id"] == first["id"]
    log = (tmp_path / "cut" / "log.txt").read_text()
    assert "resuming with a changed recipe: report: ['wandb'] -> ['wandb', 'tensorboard']" in log
    wandb.teardown()  # offline, finish() may return before W&B's service wrote the log out
    ids, got, config, samples, exits = wandb_history(tmp_path / "cut")
    assert ids == {(first["id"], "cut")}  # one run, continued, named after the run directory
    assert exits == [1, 0]  # the crashed attempt closed its run too
    assert samples == [4, 8]  # a table each time (step 4 by the interrupted run)
    assert config["train"]["max_steps"] == 8 and config["optimizer"]["lr"] == 1e-2
    assert config["report"] == ["wandb", "tensorboard"]  # as the resumed run was asked
    want = metrics(tmp_path / "cut")
    joined, _ = tensorboard_scalars(tmp_path / "cut")  # from the checkpoint's step on
    assert joined == pytest.approx({k: v for k, v in want.items() if k[1] > 3}, rel=1e-6)
    assert set(got) == set(want) and len(want) > 40
    # steps 4 and 5 keep the interrupted run's rows: the same but for their timings
    for (tag, step), v in want.items():
        if tag.split("/", 1)[1] not in TIMING:
            assert got[(tag, step)] == pytest.approx(v, rel=1e-9), (tag, step)
    assert len(list((tmp_path / "cut" / "wandb").glob("offline-run-*"))) == 2


def test_a_reporter_that_is_not_installed_exits_2_with_its_install_command(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds when missing
    p = tmp_path / "r.yaml"
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["tensorboard", "wandb"])))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "report: wandb is not installed: pip install 'mlxtune[wandb]'" in err
    assert "tensorboard" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    assert main(["validate", str(p)]) == 2
    assert "pip install 'mlxtune[wandb]'" in capsys.readouterr().err
    monkeypatch.undo()
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["tensorbard"])))
    assert main(["validate", str(p)]) == 2
    assert "report[0]: 'tensorbard' is not one of" in capsys.readouterr().err
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["wandb", "wandb"])))
    assert main(["validate", str(p)]) == 2
    assert "report: names a reporter twice" in capsys.readouterr().err


def test_wandb_that_cannot_start_its_run_exits_2_before_the_first_step(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    import wandb

    offline_wandb(monkeypatch)

    def not_logged_in(**kwargs):  # what wandb.init raises online without an API key
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", not_logged_in)
    p = tmp_path / "r.yaml"
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["tensorboard", "wandb"])))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "report: W&B could not start its run (No API key configured" in err
    assert "WANDB_MODE=offline" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step, no evaluation
