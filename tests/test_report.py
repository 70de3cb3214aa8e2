"""Run tracking: TensorBoard's event files read back with TensorBoard's own reader, and a W&B
offline run's records read back as W&B's protobufs, each against metrics.jsonl as the run wrote
it; a resumed run continues the same record without a step twice; a reporter that is not
installed is refused with its install command."""

import json
import struct

import pytest

from conftest import make_crash, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.report import scalars

TIMING = {"tokens_per_sec", "step_time_s", "peak_memory_gb", "first_step_compile_time_s"}


def recipe(data_dir, llama_dir, report):
    return tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False},
        eval={"every": 3, "max_batches": 1, "at_start": True},
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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)  # no step read twice
        for e in acc.Scalars(tag):
            got[(tag, e.step)] = e.value
    return got, acc


def test_tensorboard_holds_every_row_the_recipe_and_samples_and_resumes_in_place(
    tmp_path, data_dir, llama_dir
):
    r = recipe(data_dir, llama_dir, ["tensorboard"])
    run(r, tmp_path / "whole")
    want = metrics(tmp_path / "whole")
    got, acc = tensorboard_scalars(tmp_path / "whole")
    assert set(got) == set(want) and len(want) > 40
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k  # stored as float32
    assert {"train/loss", "train/lr", "eval/loss", "eval/ppl"} <= set(acc.Tags()["scalars"])
    texts = acc.Tags()["tensors"]
    assert "config" in texts and "samples" in texts
    config = acc.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert "max_steps: 8" in config and "tensorboard" in config
    sample_steps = sorted(e.step for e in acc.Tensors("samples"))
    assert sample_steps == [4, 8]
    # cut after step 5 (checkpoint at 3, rows of steps 4 and 5 written), resumed from step 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(r, tmp_path / "cut", crash=5)
    cut_file = next((tmp_path / "cut" / "tensorboard").iterdir())
    run(r, tmp_path / "cut", resume="latest")
    assert len(list((tmp_path / "cut" / "tensorboard").iterdir())) == 2 and cut_file.exists()
    resumed = metrics(tmp_path / "cut")
    got, _ = tensorboard_scalars(tmp_path / "cut")  # each step once, as the resumed run wrote it
    assert set(got) == set(resumed)
    for k, v in resumed.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k


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
    """(run ids, {(tag, step): value}, config keys, the steps samples were logged at)."""
    ids, got, config, samples = set(), {}, set(), []
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                config |= {item.key for item in rec.run.config.update}
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
    return ids, got, config, samples


def test_wandb_offline_holds_every_row_and_a_resumed_run_continues_it(
    tmp_path, data_dir, llama_dir, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    r = recipe(data_dir, llama_dir, ["wandb"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(r, tmp_path / "cut", crash=5)
    first = json.loads((tmp_path / "cut" / "wandb.json").read_text())
    run(r, tmp_path / "cut", resume="latest")
    assert json.loads((tmp_path / "cut" / "wandb.json").read_text())["id"] == first["id"]
    ids, got, config, samples = wandb_history(tmp_path / "cut")
    assert ids == {first["id"]}  # one run, continued
    assert samples == [4, 8]  # a table each time (step 4 by the interrupted run)
    assert {"optimizer", "train", "report"} <= config
    want = metrics(tmp_path / "cut")
    assert set(got) == set(want) and len(want) > 40
    # steps 4 and 5 keep the interrupted run's rows: the same but for their timings
    for (tag, step), v in want.items():
        if tag.split("/", 1)[1] not in TIMING:
            assert got[(tag, step)] == pytest.approx(v, rel=1e-9), (tag, step)
    assert len(list((tmp_path / "cut" / "wandb").glob("offline-run-*"))) == 2


def test_a_reporter_that_is_not_installed_exits_2_with_its_install_command(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    import mlxtune.report

    monkeypatch.setattr(mlxtune.report, "not_installed", lambda name: name == "wandb")
    p = tmp_path / "r.yaml"
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["tensorboard", "wandb"])))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "report" in err and "pip install 'mlxtune[wandb]'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["tensorbard"])))
    assert main(["validate", str(p)]) == 2
    assert "report" in capsys.readouterr().err
    p.write_text(json.dumps(recipe(data_dir, llama_dir, ["wandb", "wandb"])))
    monkeypatch.setattr(mlxtune.report, "not_installed", lambda name: False)
    assert main(["validate", str(p)]) == 2
    assert "twice" in capsys.readouterr().err
