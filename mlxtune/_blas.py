"""Use an installed OpenBLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel bundles the reference BLAS (about 2 GFLOP/s for an fp32 matmul on a small
x86 machine). Loading OpenBLAS with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported makes
MLX's BLAS calls resolve to it, often 30-50x faster. This runs once, at ``import mlxtune``.

Opt out with ``MLXTUNE_BLAS=bundled``; point at a specific library with ``MLXTUNE_BLAS=/path.so``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import sys
import time
from dataclasses import dataclass

_CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
]


@dataclass
class BlasStatus:
    """What BLAS MLX's CPU backend uses in this process, and why."""

    name: str
    """"OpenBLAS", "bundled reference BLAS" or "Accelerate"."""
    path: str | None
    """The library loaded, when it is not the bundled one."""
    note: str
    """One line for a person: what happened and, where it matters, what to do."""

    @property
    def fast(self) -> bool:
        return self.name != "bundled reference BLAS"


STATUS: BlasStatus | None = None


def _loaded_libraries() -> str:
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


def _find_openblas() -> str | None:
    arch = platform.machine()
    arch = {"arm64": "aarch64"}.get(arch, arch)
    for pattern in _CANDIDATES:
        for path in glob.glob(pattern.format(arch=arch)):
            if os.path.exists(path):
                return path
    found = ctypes.util.find_library("openblas")
    return found


def setup_blas() -> BlasStatus:
    """Load OpenBLAS for MLX if this is Linux, one is installed, and it is not too late."""
    global STATUS
    if STATUS is not None:
        return STATUS
    if sys.platform == "darwin":
        STATUS = BlasStatus("Accelerate", None, "macOS: MLX uses Accelerate and Metal")
        return STATUS
    choice = os.environ.get("MLXTUNE_BLAS", "auto")
    install_hint = "install OpenBLAS for a 30-50x faster CPU backend: mlxtune doctor --install-blas"
    if choice == "bundled":
        STATUS = BlasStatus(
            "bundled reference BLAS", None, "MLXTUNE_BLAS=bundled: OpenBLAS not used"
        )
        return STATUS
    maps = _loaded_libraries()
    if "libopenblas" in maps:
        path = next((line.split()[-1] for line in maps.splitlines() if "libopenblas" in line), None)
        STATUS = BlasStatus("OpenBLAS", path, f"OpenBLAS already loaded ({path})")
        return STATUS
    path = choice if choice not in ("auto", "") else _find_openblas()
    if path is None:
        STATUS = BlasStatus("bundled reference BLAS", None, f"no OpenBLAS found; {install_hint}")
        return STATUS
    if "mlx.core" in sys.modules:
        STATUS = BlasStatus(
            "bundled reference BLAS",
            None,
            "mlx was imported before mlxtune, too late to load OpenBLAS; import mlxtune first",
        )
        return STATUS
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        STATUS = BlasStatus("bundled reference BLAS", None, f"could not load {path}: {e}")
        return STATUS
    STATUS = BlasStatus("OpenBLAS", path, f"using OpenBLAS for MLX's CPU backend ({path})")
    return STATUS


def matmul_gflops() -> float:
    """fp32 matmul GFLOP/s of MLX here (512 x 512, the mean of five after a warm-up)."""
    import mlx.core as mx

    n = 512
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t = time.perf_counter()
    reps = 5
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9
