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
import hashlib
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


TIMEOUT_FLOOR_S = 300.0
"""``distributed.timeout_s: auto`` never waits less than this on the other ranks."""
TIMEOUT_STEPS = 20
"""... and waits this many times the longest wait seen so far (a step, an evaluation)."""
BEAT_S = 1.0
"""How often a rank's watchdog marks it alive (``heartbeats``)."""
STALE_S = 15.0
"""A rank not marked alive for this long is frozen, asleep or gone."""
HEARTBEATS = "MLXTUNE_HEARTBEATS"
"""A folder every rank of a run on one machine can write: each marks it alive there."""


def heartbeats_folder() -> Path | None:
    """Where this run's ranks mark themselves alive: ``$MLXTUNE_HEARTBEATS`` (set by
    ``mlxtune run --nproc``), or, when every address in the ring's hostfile is this machine's
    loopback, a folder of the temporary directory named after the hostfile's text and the
    launcher's process (the same for every rank of one launch); None for ranks on several
    machines."""
    if os.environ.get(HEARTBEATS):
        return Path(os.environ[HEARTBEATS])
    path = os.environ.get("MLX_HOSTFILE")
    try:
        text = Path(path).read_text() if path else ""
        hosts = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    if not isinstance(hosts, list) or not hosts:
        return None
    addresses = [a for h in hosts for a in (h if isinstance(h, list) else [h])]
    if not all(isinstance(a, str) and a.rsplit(":", 1)[0] in LOOPBACK for a in addresses):
        return None
    key = hashlib.sha1(f"{text}:{os.getppid()}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"mlxtune-beats-{key}"


LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


def silence(
    waited: float, limit: float, beats: dict[int, float] | None, now: float, me: int, size: int
) -> tuple[bool, list[int]]:
    """Whether a rank that has waited ``waited`` s on the others should give up, and which
    ranks went silent: with ``beats`` (each rank's last mark of life, as ``now`` counts), a
    rank unmarked for ``STALE_S`` is silent and is given up on once the wait is that long too;
    ranks all alive are waited for up to 4 x ``limit`` (a slow rank, or rank 0 writing a large
    checkpoint). Without beats (ranks on several machines), the wait ends at ``limit``, and
    every other rank is a suspect, as is every rank when none is stale."""
    others = [r for r in range(size) if r != me]
    if beats is not None:
        # a rank with no mark yet (still setting up) is no suspect by its beats
        stale = [r for r in others if r in beats and now - beats[r] > STALE_S]
        if stale and waited > STALE_S:
            return True, stale
        return waited > 4 * limit, others
    return waited > limit, others


class Watchdog:
    """Ends this rank when it waits on the others for longer than it should.

    A peer that froze (SIGSTOP, a laptop asleep) or dropped off the network without closing its
    sockets never fails a collective: it is only never answered, and the main thread, inside
    MLX's evaluation, cannot be interrupted. So the main thread marks each wait on collectives
    (``waiting``), and this thread (MLX evaluates without the GIL) checks it once a second: when
    ``silence`` says so, it writes one line (which rank went silent, at which step, the resume
    command: ``context()``) to stderr, calls ``on_fire(line)`` (rank 0 logs it), and ends the
    process with exit code 1. Only waits are timed, so a rank busy with its own work (rank 0
    writing a checkpoint) never fires; its peers waiting meanwhile see it alive. On one machine
    each rank also marks itself alive in ``folder`` once a second (``heartbeats_folder``)."""

    def __init__(self, world: World, timeout: float | str, context, on_fire=None, folder=None):
        self.world, self.timeout = world, timeout
        self.context, self.on_fire = context, on_fire
        self.folder = folder
        self.longest = 0.0
        """The longest wait that ended (``auto`` scales from it)."""
        self._since: float | None = None
        self._what = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def limit(self) -> float:
        """How long a wait may last before the others are given up on."""
        if self.timeout == "auto":
            return max(TIMEOUT_FLOOR_S, TIMEOUT_STEPS * self.longest)
        return float(self.timeout)

    @contextlib.contextmanager
    def waiting(self, what: str):
        """Around the main thread's wait on work that holds collectives."""
        if self._since is not None:  # nested: the outer wait counts
            yield
            return
        self._since, self._what = time.monotonic(), what
        try:
            yield
        finally:
            self.longest = max(self.longest, time.monotonic() - self._since)
            self._since = None

    def _beat_path(self, rank: int) -> Path:
        return self.folder / f"rank-{rank}"

    def _beats(self) -> dict[int, float] | None:
        if self.folder is None:
            return None
        out, now_wall, now = {}, time.time(), time.monotonic()
        for r in range(self.world.size):
            try:
                out[r] = now - (now_wall - self._beat_path(r).stat().st_mtime)
            except OSError:
                continue
        return out

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            if self.folder is not None:
                try:
                    self._beat_path(self.world.rank).touch()
                except OSError:
                    self.folder = None  # no shared folder after all: time the waits alone
            since = self._since
            if since is None:
                continue
            now = time.monotonic()
            fire, who = silence(
                now - since, self.limit, self._beats(), now, self.world.rank, self.world.size
            )
            if fire and self._since == since:
                self._fire(now - since, who)

    def _fire(self, waited: float, who: list[int]) -> None:
        step, checkpoint, resume = self.context()
        names = ", ".join(f"rank {r}" for r in who)
        line = (
            f"rank {self.world.rank}: no answer from {names} for {waited:.0f} s at step {step} "
            f"(waiting on {self._what}): it froze, slept or lost its link. The last checkpoint "
            f"({checkpoint}) is intact; continue with: {resume}"
        )
        try:
            if self.on_fire is not None:
                self.on_fire(line)
            os.write(2, f"mlxtune: {line}\n".encode())
        finally:
            os._exit(1)

    def __enter__(self) -> Watchdog:
        global _WATCHDOG
        if self.folder is not None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._beat_path(self.world.rank).touch()
            except OSError:
                self.folder = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mlxtune-watchdog", daemon=True)
        self._thread.start()
        _WATCHDOG = self
        return self

    def __exit__(self, *exc):
        global _WATCHDOG
        _WATCHDOG = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


_WATCHDOG: Watchdog | None = None


@contextlib.contextmanager
def collectives(world: World, what: str = "the other ranks"):
    """Around waiting for work that holds collectives: when one fails because a rank is gone,
    PeerLost says so (with what to do next) instead of MLX's bare error; a running
    ``Watchdog`` times the wait (``what`` names it)."""
    watch = _WATCHDOG if world.size > 1 else None
    try:
        with watch.waiting(what) if watch is not None else contextlib.nullcontext():
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
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), HEARTBEATS: str(Path(tmp) / "beats")}
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
                    _stop(p)
        elif stopping is not None and time.monotonic() - stopping > 60:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def _stop(p: subprocess.Popen) -> None:
    """Ask a rank to stop (SIGTERM), continuing it first in case it was stopped (SIGSTOP: a
    stopped process would keep the signal pending)."""
    try:
        p.send_signal(signal.SIGCONT)
        p.terminate()
    except ProcessLookupError:
        pass


def _end(procs: list[subprocess.Popen]) -> None:
    """No rank outlives its launcher: the live ones are stopped, then killed."""
    for p in procs:
        if p.poll() is None:
            _stop(p)
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
