"""Data-parallel training on MLX's distributed engine.

``mlx.launch -n 2 -- mlxtune run recipe.yaml`` (or ``--hostfile hosts.json`` for several
machines, ``mlxtune run --nproc 2`` for short) starts one process per rank; ``mx.distributed``
connects them (ring over TCP, JACCL over Thunderbolt RDMA, NCCL under CUDA, MPI). Nothing here
moves bytes itself: every collective is one of MLX's.

What each rank does:

- It builds the same model, data and batch order from the recipe (the same seed everywhere), so
  every rank knows every step's whole batch. The engine splits each batch by rows
  (``Objective.split``) and trains rank r on part r; the step's count (target tokens) is the
  whole batch's, known before the step, so the gradients summed over ranks are exactly the
  one-process step's: d(loss sum)/dw / (all ranks' tokens), however unevenly the rows fall.
- The gradients, loss sums and counts are summed over ranks once a step
  (``mlx.nn.average_gradients``, one all-reduce of the packed gradients) before the optimizer:
  every rank applies the same update to the same weights, so they never drift apart, and the
  non-finite verdict (computed from the summed values) is the same everywhere.
- Decisions the host makes (control requests, signals, an out-of-memory split) are agreed by
  ``World.agree``, one small all-reduce, where the loop already waits for its steps.
- Rank 0 writes the run directory; the others write nothing there (they build in a scratch
  folder of their own) and read the checkpoint when a run resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from .errors import TrainingError

# Environment variables MLX's launchers set for the processes they start.
_LAUNCHED = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE")


# What MLX's backends say when a collective fails because a peer is gone or unreachable.
_LOST = re.compile(r"\[(ring|nccl|jaccl|mpi)\]|\b(recv|send|socket|connection|peer)\b")


class PeerLost(TrainingError):
    """A collective failed: another rank died, or the link to it broke."""


@dataclass(frozen=True)
class World:
    """The processes training together: this one's rank, how many there are, and their group
    (None when it runs alone)."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    backend: str = ""

    @property
    def main(self) -> bool:
        """Whether this process is rank 0, the one that writes the run directory."""
        return self.rank == 0

    def all_sum(self, x: mx.array) -> mx.array:
        """``x`` summed over every rank (lazy, as MLX's ops are)."""
        if self.size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group)

    def agree(self, values: list[float]) -> list[float]:
        """``values`` summed over every rank, waited for: what the host decides from them is
        then the same on every rank. A rank that does not answer ends the run (PeerLost)."""
        if self.size == 1:
            return [float(v) for v in values]
        out = self.all_sum(mx.array([float(v) for v in values], dtype=mx.float32))
        with collectives(self):
            mx.eval(out)
        return out.tolist()

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.agree([0.0])

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} ({self.backend or 'single process'})"


@contextlib.contextmanager
def collectives(world: World):
    """Around waiting for work that holds collectives: when one fails because a rank is gone,
    PeerLost says so (with what to do next) instead of MLX's bare error."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if world.size == 1 or not _LOST.search(text.lower()):
            raise
        who = f"rank {1 - world.rank}" if world.size == 2 else "another rank"
        raise PeerLost(
            f"rank {world.rank} lost contact with {who} ({text.strip()}): it died or its link "
            "broke. The last checkpoint is intact; continue with the same command and --resume"
        ) from None


def launched() -> bool:
    """Whether an MLX launcher (mlx.launch, mpirun) started this process as one of several."""
    return any(os.environ.get(k) for k in _LAUNCHED)


@lru_cache(maxsize=1)
def current() -> World:
    """This process's World: the group ``mlx.launch`` set up, or a world of one."""
    if not launched() or not mx.distributed.is_available() or _alone():
        return World()
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise TrainingError(f"could not join the distributed group: {e}") from None
    if group.size() == 1:
        return World()
    return World(group.rank(), group.size(), group, _backend_name())


def _alone() -> bool:
    """``mlx.launch -n 1`` (one host): its hostfile is empty, and there is no group to join."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        return path is not None and not Path(path).read_text().strip()
    except OSError:
        return False


def _backend_name() -> str:
    """Which backend mlx.launch (or mpirun) set this process up for, from its environment."""
    if os.environ.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return "mpi"
    if os.environ.get("NCCL_HOST_IP"):
        return "nccl"
    return "ring"


def backends() -> dict[str, bool]:
    """MLX's distributed backends and whether each can run in this process."""
    out = {}
    for name in ("ring", "jaccl", "mpi", "nccl"):
        try:
            out[name] = bool(mx.distributed.is_available(name))
        except (TypeError, ValueError, RuntimeError):
            out[name] = False
    return out


# Set by ``launch_local`` for the ranks it starts through mlx.launch: each writes its exit code
# there (mlx.launch itself exits 0 whatever its processes did).
EXIT_CODES = "MLXTUNE_EXIT_CODES"


def record_exit(code: int) -> None:
    """In a rank ``launch_local`` started: leave this process's exit code for it to read."""
    folder = os.environ.get(EXIT_CODES)
    if folder and os.path.isdir(folder):
        rank = os.environ.get("MLX_RANK", "0")
        with open(os.path.join(folder, f"rank-{rank}"), "w") as f:
            f.write(str(code))


def launch_local(n: int, command: list[str]) -> int:
    """``command`` (``[sys.executable, "-m", "mlxtune.cli", "run", ...]``) in ``n`` processes on
    this machine, each with its share of the cores' BLAS threads; returns the exit code that says
    most: 2 (bad input) if a rank had it, else 130 (interrupted), else any other failure's,
    else 0.

    On the ring backend the ranks are started here, with the environment mlx.launch gives them
    (``MLX_RANK``, and ``MLX_HOSTFILE`` naming one local port a rank): mlx.launch's output loop
    keeps a core busy for as long as the run lasts (measured here: 100% of a core, which halved
    each rank's speed on 2 cores). As mlx.launch does, a rank that fails makes the others stop
    (SIGTERM). Under MLX's CUDA backend mlx.launch starts them, for its NCCL set-up."""
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return _through_mlx_launch(n, command)
    first = free_ports(n)
    with tempfile.TemporaryDirectory(prefix="mlxtune-ranks-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(n)]))
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
        env.update(blas_threads(n))
        procs: list[subprocess.Popen] = []
        with _forwarding_sigterm(procs):
            try:
                for r in range(n):
                    procs.append(subprocess.Popen(command, env={**env, "MLX_RANK": str(r)}))
                codes = _wait_for(procs)
            finally:
                _end(procs)
    return worst([c if c >= 0 else 1 for c in codes])  # killed by a signal: failed


def _wait_for(procs: list[subprocess.Popen]) -> list[int]:
    """Every rank's exit code; when one fails the others are asked to stop (SIGTERM), as
    mlx.launch does, and killed if they have not after a minute (stuck in a collective)."""
    stopping = None
    while True:
        try:
            time.sleep(0.1)
            codes = [p.poll() for p in procs]
        except KeyboardInterrupt:  # Ctrl-C reached the ranks too: they save and stop
            continue
        if all(c is not None for c in codes):
            return codes
        if stopping is None and any(c not in (None, 0) for c in codes):
            stopping = time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        elif stopping is not None and time.monotonic() - stopping > 60:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def _end(procs: list[subprocess.Popen]) -> None:
    """No rank outlives its launcher: the live ones are stopped, then killed."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def _forwarding_sigterm(procs: list[subprocess.Popen]):
    """SIGTERM to the launcher goes on to its ranks (which save and stop, as on Ctrl-C)."""

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def worst(codes: list[int]) -> int:
    """The exit code that says most about several ranks' codes."""
    for code in (2, 130):
        if code in codes:
            return code
    return next((c for c in codes if c), 0)


def _through_mlx_launch(n: int, command: list[str]) -> int:
    exe = Path(sys.executable).with_name("mlx.launch")
    launcher = str(exe) if exe.exists() else shutil.which("mlx.launch")
    if not launcher:
        raise TrainingError("mlx.launch is not installed with this mlx (pip install -U mlx)")
    with tempfile.TemporaryDirectory(prefix="mlxtune-ranks-") as codes:
        cmd = [launcher, "-n", str(n), "--env", f"{EXIT_CODES}={codes}"]
        cmd += [a for k, v in blas_threads(n).items() for a in ("--env", f"{k}={v}")]
        proc = subprocess.Popen([*cmd, "--", *command])
        while proc.poll() is None:  # Ctrl-C reaches the ranks: wait while they save
            try:
                proc.wait()
            except KeyboardInterrupt:
                continue
        got = []
        for rank in range(n):
            path = Path(codes) / f"rank-{rank}"
            got.append(int(path.read_text()) if path.exists() else 1)  # killed: no code
    return worst(got)


def blas_threads(n: int) -> dict[str, str]:
    """The environment giving each of ``n`` processes on this machine its share of the cores for
    OpenBLAS (MLX's CPU matmuls on Linux), unless the user set it: n processes with a thread per
    core each would fight over the cores."""
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return {}
    return {"OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on this machine now (for the ring)."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(first, first + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise TrainingError(f"found no {n} consecutive free TCP ports for the ring backend")
