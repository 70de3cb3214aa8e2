"""The mlxtune command line. Exit codes: 0 done, 1 training failed, 2 bad input, 130 interrupted."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import click

from . import __version__, _blas, _malloc, _schedule, distributed
from .config import inert_notes, load_recipe
from .config.reference import recipe_reference, sections
from .errors import Interrupted, TrainingError, UserInputError
from .shipped import init_recipe, shipped_recipes


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxtune")
def cli():
    """Fine-tune language models with MLX, from one YAML recipe."""


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--run-dir", type=click.Path(file_okay=False), help="Where the run writes everything."
)
@click.option(
    "--dry-run", is_flag=True, help="Build the model and data, compile and run one step, exit."
)
@click.option("--tui", is_flag=True, help="Train with the live dashboard in front.")
@click.option(
    "--resume",
    is_flag=False,
    flag_value="latest",
    default=None,
    metavar="[latest|CHECKPOINT]",
    help="Continue the run in --run-dir exactly where it stopped: from its newest intact "
    "checkpoint, or the one named.",
)
@click.option(
    "--nproc",
    type=click.IntRange(1),
    help="Train data-parallel in N processes on this machine (starts mlx.launch -n N).",
)
def run(recipe, overrides, run_dir, dry_run, tui, resume, nproc):
    """Train RECIPE.yaml; OVERRIDES are key.sub=value pairs (e.g. train.max_steps=50).

    Data-parallel: mlx.launch -n 2 -- mlxtune run RECIPE.yaml (or --nproc 2), or
    mlx.launch --hostfile hosts.json -- mlxtune run RECIPE.yaml over several machines."""
    from .loop import Trainer

    r = load_recipe(recipe, list(overrides))
    launched = distributed.launched()
    if nproc is not None and launched:
        raise UserInputError("already started by mlx.launch: leave out --nproc", "--nproc")
    if tui and (launched or (nproc or 1) > 1):
        raise UserInputError(
            "the dashboard cannot run in front of a data-parallel run; start it without --tui "
            "and watch it with: mlxtune watch RUN_DIR",
            "--tui",
        )
    if nproc is not None and nproc > 1:
        argv = [recipe, *overrides]
        argv += ["--run-dir", run_dir] if run_dir else []
        argv += ["--dry-run"] if dry_run else []
        argv += [f"--resume={resume}"] if resume else []
        code = distributed.launch_local(nproc, [sys.executable, "-m", "mlxtune.cli", "run", *argv])
        if code:
            raise click.exceptions.Exit(code)
        return
    if tui and not dry_run:
        from .tui.live import run_with_dashboard

        run_with_dashboard(r, run_dir, resume=resume)
        return
    # refused input leaves no run folder behind (the Trainer sees to it)
    Trainer(r, run_dir=run_dir, dry_run=dry_run, resume=resume).run()


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def validate(recipe, overrides):
    """Check RECIPE.yaml (with any key.sub=value overrides) without running it; keys that the
    other settings make meaningless are noted, one line each."""
    r = load_recipe(recipe, list(overrides))
    missing = []
    for key in ("train", "valid", "test"):
        p = r.resolve_path(getattr(r.data, key))
        if p is not None and not p.exists():
            missing.append(f"data.{key}: {p}")
    if r.model.path is not None:
        p = r.resolve_path(r.model.path)
        if not p.exists() and "/" not in r.model.path:
            missing.append(f"model.path: {p}")
    p = r.resolve_path(r.adapter.init_from)
    if p is not None and not p.exists():
        missing.append(f"adapter.init_from: {p}")
    if missing:
        raise UserInputError("file not found: " + "; ".join(missing), recipe)
    click.echo(
        f"{recipe}: ok ({r.name}: {r.adapter.type}, {r.train.max_steps or str(r.train.epochs) + ' epochs'}"
        f"{' steps' if r.train.max_steps else ''})"
    )
    world = distributed.current()
    b = r.train.batch_size
    if world.size > 1:
        share = "sized when it builds" if b == "auto" else f"about {-(-b // world.size)} examples"
        click.echo(f"data-parallel: {world.describe()}; global batch {b}, {share} a rank")
    auto = {
        "train.batch_size": b,
        "train.grad_checkpointing": r.train.grad_checkpointing,
        "data.max_length": r.data.max_length,
    }
    if any(v == "auto" for v in auto.values()) and world.size == 1:
        # what auto comes to here: the run built (not trained) in a scratch folder
        from .console import Console
        from .loop import Trainer

        built = Trainer(r, dry_run=True, console=Console(quiet=True))
        for key, why in built.auto_sizes.items():
            click.echo(f"{key}: auto -> {why}")
    for note in inert_notes(r):
        click.echo(note)


@cli.command()
@click.argument("recipe", required=False)
@click.argument("directory", required=False, type=click.Path(file_okay=False))
def init(recipe, directory):
    """Copy the shipped RECIPE, with the data and models it names, into DIRECTORY (default:
    ./RECIPE), ready for mlxtune run; without arguments, list the shipped recipes."""
    if recipe is None:
        recipes = shipped_recipes()
        width = max(len(r.name) for r in recipes)
        for r in recipes:
            click.echo(f"{r.name:<{width}}  {r.summary}")
        click.echo("\nmlxtune init RECIPE [DIR] copies one into DIR (default: ./RECIPE)")
        return
    try:
        path = init_recipe(recipe, directory)
    except OSError as e:
        raise UserInputError(
            f"could not write the recipe's folder: {e.strerror or e}", directory or recipe
        ) from None
    files = sum(1 for f in path.parent.rglob("*") if f.is_file())
    click.echo(f"wrote {path.parent} ({files} files)")
    click.echo(f"train it with: mlxtune run {path}")


@cli.command()
@click.argument("section", required=False)
@click.option(
    "--write",
    "write_to",
    type=click.Path(dir_okay=False),
    help="Write the reference to this file (docs/recipe.md) instead of printing it.",
)
def keys(section, write_to):
    """Every recipe key (or SECTION's) with its type, default and meaning, as Markdown: the
    schema's own docstrings, which docs/recipe.md is written from."""
    try:
        text = recipe_reference(section)
    except KeyError:
        raise UserInputError(
            f"no section {section!r}; the sections: {', '.join(sections())}", "SECTION"
        ) from None
    if write_to:
        with open(write_to, "w") as f:
            f.write(text)
        click.echo(f"wrote {write_to}")
    else:
        click.echo(text, nl=False)


@cli.command("export")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mlx-lm", "peft", "fused", "gguf", "gguf-adapter", "mlx-vlm"]),
    required=True,
    help="What to write.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Folder to write (default: RUN_DIR/export/FORMAT).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16", "f32", "f16", "bf16", "q8_0"]),
    help="fused: float32|bfloat16|float16; gguf: f32|f16|bf16|q8_0 (default f16).",
)
@click.option(
    "--quantize",
    type=click.Choice(["4", "8"]),
    help="fused: quantize the merged model to 4 or 8 bits.",
)
@click.option(
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    help="With --quantize: weights a scale covers (default 64).",
)
def export_cmd(path, fmt, out, dtype, quantize, q_group_size):
    """Write a run's (or checkpoint's) model as an mlx-lm adapter, a PEFT adapter or a fused model."""

    from .export import export
    from .runs.checkpoint import find_checkpoint, load_checkpoint
    from .runs.rundir import staged_folder

    if q_group_size and not quantize:
        raise UserInputError("--q-group-size applies with --quantize", "export")
    if dtype and fmt not in ("fused", "gguf"):
        raise UserInputError(f"--dtype applies to fused and gguf exports, not {fmt}", "export")
    ckpt = find_checkpoint(path, warn=_warn)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else Path(path)
    out = Path(out) if out else run_dir / "export" / fmt
    if out.exists() and any(out.iterdir()):
        raise UserInputError("already exists and is not empty; choose another --out", str(out))
    folder = (run_dir / "checkpoints").resolve()
    if out.resolve() == folder or folder in out.resolve().parents:
        raise UserInputError("is inside the run's checkpoints; choose another --out", str(out))
    # the base is read as the export computes each weight, and each goes once written
    trained = load_checkpoint(ckpt, lazy=True)
    with staged_folder(out) as tmp:  # written beside it, flushed, renamed into place
        note = export(
            trained, fmt, tmp, dtype, int(quantize) if quantize else None,
            int(q_group_size or 64), consume=True,
        )  # fmt: skip
    click.echo(f"wrote {fmt} from {ckpt} to {out}")
    if note:
        click.echo(note)


def _warn(message: str) -> None:
    click.echo(message, err=True)


def _sampling_options(f):
    f = click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True)(f)
    f = click.option(
        "--temp", type=click.FloatRange(0), default=0.0, show_default=True, help="0 is greedy."
    )(f)
    f = click.option(
        "--top-k", type=click.IntRange(0), default=0, help="Sample among the k likeliest (0: off)."
    )(f)
    f = click.option(
        "--top-p", type=click.FloatRange(0, 1), default=0.0, help="Nucleus sampling (0: off)."
    )(f)
    f = click.option("--seed", type=int, default=0, show_default=True)(f)
    f = click.option("--scale", type=float, help="Multiply the adapter's scale (0 turns it off).")(
        f
    )
    f = click.option(
        "--adapter",
        type=click.Path(exists=True, file_okay=False),
        help="An mlx-lm or PEFT adapter.",
    )(f)
    f = click.option(
        "--model",
        required=True,
        help="A model directory (or fused export), GGUF file, Hub id, or mlxtune run.",
    )(f)
    return f


def _stream(model, tokenizer, prompt, max_tokens, temp, top_k, top_p, seed) -> str:
    """Complete ``prompt`` (text, or token ids) with the generation engine, printing the text
    as it comes; returns it."""
    from .generate import Sampling, eos_ids, generate_ids, row_keys

    ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    drawn: list[int] = []
    shown = [""]

    def hear(_row, token):
        drawn.append(token)
        text = tokenizer.decode(drawn, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character still incomplete: wait for its next bytes
            return
        click.echo(text[len(shown[0]) :], nl=False)
        shown[0] = text

    sampling = Sampling(temperature=temp, top_k=top_k or 0, top_p=top_p)
    generate_ids(
        model,
        [ids],
        max_tokens,
        eos_ids(tokenizer),
        sampling=sampling,
        keys=row_keys(seed, 1),
        on_token=hear,
    )
    text = tokenizer.decode(drawn, skip_special_tokens=True)
    click.echo(text[len(shown[0]) :])
    return text


@cli.command()
@_sampling_options
@click.option(
    "--raw",
    is_flag=True,
    help="Complete PROMPT as written, without the tokenizer's chat template.",
)
@click.argument("prompt")
def generate(model, adapter, scale, seed, top_p, top_k, temp, max_tokens, raw, prompt):
    """Answer PROMPT as a user's message through the tokenizer's chat template (when it has
    one; --raw completes PROMPT as written), streaming tokens as they come."""

    from .runs.generation import load_for_generation

    m, tok = load_for_generation(model, adapter, scale, warn=_warn)
    text: str | list[int] = prompt
    if not raw and getattr(tok._tokenizer, "chat_template", None):
        text = list(
            tok._tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    if not _stream(m, tok, text, max_tokens, temp, top_k, top_p, seed).strip():
        how = "" if raw else " (through its chat template; --raw completes the prompt as written)"
        click.echo(f"(the model ended at once: an empty completion{how})", err=True)


@cli.command()
@_sampling_options
@click.option("--system", help="A system message to start the conversation with.")
def chat(model, adapter, scale, seed, top_p, top_k, temp, max_tokens, system):
    """Talk to a model through its chat template; an empty line or end of input ends it."""

    from .runs.generation import load_for_generation

    m, tok = load_for_generation(model, adapter, scale, warn=_warn)
    if not getattr(tok._tokenizer, "chat_template", None):
        raise UserInputError(
            "this tokenizer has no chat template; use mlxtune generate", str(model)
        )
    messages = [{"role": "system", "content": system}] if system else []
    stdin = click.get_text_stream("stdin")
    while True:
        click.echo("> ", nl=False)
        line = stdin.readline()
        if not line or not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        ids = tok._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        reply = _stream(m, tok, list(ids), max_tokens, temp, top_k, top_p, seed + len(messages))
        messages.append({"role": "assistant", "content": reply})


@cli.command(name="eval")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--base", is_flag=True, help="Also evaluate the model the run started from.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
def eval_(run_dir, base, as_json):
    """Evaluate a run's trained model on its validation and test data (loss, perplexity, exact
    match, a few answers), beside its base model with --base. Writes nothing."""
    import json

    from .evaluate import evaluate_run, format_comparison

    result = evaluate_run(run_dir, base=base, warn=_warn)
    click.echo(json.dumps(result) if as_json else format_comparison(result))


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--read-only", is_flag=True, help="Watch without the keys that steer the run.")
def watch(run_dir, read_only):
    """Open the dashboard on a running or finished run."""

    from .tui.app import WatchApp

    if not (Path(run_dir) / "config_resolved.json").exists():
        raise UserInputError("not a run directory (no config_resolved.json)", run_dir)
    WatchApp(run_dir, read_only=read_only).run()


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--by",
    type=click.Choice(["step", "tokens"]),
    default="step",
    help="Align the curves by step or by tokens seen (t switches in the dashboard).",
)
@click.option("--table", is_flag=True, help="Print the table only (also when not on a terminal).")
def compare(run_dirs, by, table):
    """Overlay several runs' loss curves and tabulate their figures (* marks the best eval loss)."""
    import sys

    from .tui.compare import CompareApp, compare_rows, format_table

    for rd in run_dirs:
        if not (Path(rd) / "config_resolved.json").exists():
            raise UserInputError("not a run directory (no config_resolved.json)", rd)
    if table or not sys.stdout.isatty():
        click.echo(format_table(compare_rows(list(run_dirs))))
        return
    CompareApp(list(run_dirs), by=by).run()


def _memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def _install_blas() -> tuple[bool, str]:
    """Install OpenBLAS where it is missing: (whether this call installed it, what happened)."""
    if sys.platform != "linux":
        return False, "not needed: this is not Linux"
    if _blas._find_openblas():
        return False, "OpenBLAS is already installed"
    apt = shutil.which("apt-get")
    if apt is None:
        return (
            False,
            "no apt-get here: install OpenBLAS with your package manager (dnf install openblas, pacman -S openblas)",
        )
    prefix = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if prefix is None:
        return False, "not root and no sudo: ask for `apt-get install libopenblas0-pthread`"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = prefix + [apt, "install", "-y", "-q", "libopenblas0-pthread"]
    ok = subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    if not ok:  # a fresh machine may have no package lists yet
        subprocess.run(prefix + [apt, "update", "-q"], env=env, capture_output=True)
        ok = subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    if ok and _blas._find_openblas():
        return True, "installed libopenblas0-pthread"
    return False, (
        "could not install libopenblas0-pthread (run `sudo apt-get install libopenblas0-pthread`)"
    )


@cli.command()
@click.option(
    "--install-blas", is_flag=True, help="On Linux, install OpenBLAS with apt-get if it is missing."
)
@click.option(
    "--kernels",
    "kernels_for",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[MODEL or RECIPE]",
    help="Time every kernel tier here, forward and backward, and print which is fastest: at a "
    "recipe's own shapes and memory budget (set up as a dry run, nothing trained), at a model "
    "folder's or GGUF file's shapes, or at SmolLM2-135M's.",
)
def doctor(install_blas, kernels_for):
    """Print the backend, BLAS, memory and versions, and what to fix."""
    if kernels_for is not None:
        return _kernel_times(kernels_for or None)
    just_installed = False
    if install_blas:
        just_installed, what = _install_blas()
        click.echo(f"OpenBLAS: {what}")
    import importlib.metadata as md

    import mlx.core as mx

    status = _blas.setup_blas()
    if just_installed and not status.fast:  # this process loaded mlx before the install
        status = _blas.BlasStatus(
            "bundled reference BLAS in this process",
            None,
            "OpenBLAS was just installed; every mlxtune command from the next one on uses it",
        )
    backend = "Metal" if mx.metal.is_available() else ("CUDA" if mx.cuda.is_available() else "CPU")
    mem = _memory_gb()
    click.echo(f"mlxtune   {__version__}")
    click.echo(f"python    {platform.python_version()} on {platform.system()} {platform.machine()}")
    click.echo(f"backend   {backend} (default device {mx.default_device()})")
    click.echo(f"BLAS      {status.name}: {status.note}")
    click.echo(f"malloc    {_malloc.setup_malloc()}")
    click.echo(f"schedule  {_schedule.setup_schedule()}")
    click.echo(f"matmul    {_blas.matmul_gflops():.1f} GFLOP/s (fp32, 512x512)")
    click.echo(f"memory    {mem:.1f} GB" if mem else "memory    unknown")
    have = [name for name, ok in distributed.backends().items() if ok]
    click.echo(
        "parallel  mx.distributed backends: "
        + (", ".join(have) if have else "none")
        + " (mlxtune run RECIPE.yaml --nproc 2)"
    )
    for pkg in (
        "mlx",
        "mlx-lm",
        "mlx-vlm",
        "numpy",
        "transformers",
        "sentencepiece",
        "safetensors",
        "textual",
    ):
        try:
            click.echo(f"{pkg:<9} {md.version(pkg)}")
        except md.PackageNotFoundError:
            click.echo(f"{pkg:<9} not installed")
    fixes = []
    if backend == "CPU" and not status.fast and not just_installed:
        fixes.append(status.note)
    if backend == "CPU" and sys.platform == "darwin":
        fixes.append("MLX found no Metal GPU: use an Apple silicon Mac with macOS 14 or later")
    click.echo("to fix    " + ("; ".join(fixes) if fixes else "nothing"))


def _kernel_times(target: str | None) -> None:
    """doctor --kernels: the kernel table of a recipe's run, a model's shapes, or SmolLM2's."""
    import mlx.core as mx

    from .console import Console
    from .loop import Trainer, tiers

    _blas.setup_blas()
    if target is not None and Path(target).suffix in (".yaml", ".yml"):
        trainer = Trainer(load_recipe(target), dry_run=True, console=Console(quiet=True))
        table = trainer.parts.kernel_table
        if not table:
            click.echo("kernels: nothing measured (kernels.autotune: false, or MLXTUNE_KERNELS)")
        for op in ("attention", "loss"):
            for line in tiers.table_lines(op, table.get(op, [])) if op in table else []:
                click.echo(line)
            click.echo(f"kernels.{op}: {trainer.tiers[op]}")
        return
    cfg, what = tiers.model_shapes(target)
    dtype = "bfloat16" if mx.default_device().type == mx.DeviceType.gpu else "float32"
    click.echo(f"kernels at {what} ({dtype}, batch 1; without a recipe, no memory budget):")
    tiers.measure_model(cfg, dtype, click.echo)


def main(argv=None) -> int:
    code = _main(argv)
    distributed.record_exit(code)
    return code


def _main(argv=None) -> int:
    try:
        code = cli.main(args=argv, prog_name="mlxtune", standalone_mode=False)
        if isinstance(code, int):  # an Exit a command raised (click returns its code)
            return code
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return 130
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return 2
    except UserInputError as e:
        click.echo(f"mlxtune: error: {e}", err=True)
        return 2
    except TrainingError as e:
        click.echo(f"mlxtune: training failed: {e}", err=True)
        return 1
    except Interrupted as e:
        click.echo(f"mlxtune: {e}", err=True)
        return 130
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    except (RuntimeError, MemoryError) as e:
        from .engine.memory import is_out_of_memory

        if not is_out_of_memory(e):
            raise
        click.echo(
            f"mlxtune: training failed: out of memory ({e}); see memory.* in the recipe, or "
            "continue from the last checkpoint with --resume",
            err=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
