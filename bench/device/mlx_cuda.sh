#!/usr/bin/env bash
# MLX's CUDA backend on a machine that cannot reach a package registry, from wheels carried in.
#
# The mlx-cuda-13 wheel (about 90 MB) is larger than what one call to a device machine can carry
# (64 MiB), so it travels in two halves, in two calls made one right after the other:
#
#   here:   bash bench/device/mlx_cuda.sh prepare        # wheels into .device/a and .device/b
#   call 1: bash bench/device/mlx_cuda.sh stage          # carry .device/a: keeps its half in /var/tmp
#   call 2: source bench/device/mlx_cuda.sh install      # carry .device/b: joins, installs, exports
#
# `install` puts mlx, mlx-cuda-13 and mlx-lm under /tmp/mlxcuda and exports PYTHONPATH (that
# folder, then the repository, used in place: mlxtune/metal_kernels links to metal_kernels, as
# pyproject maps it) and MLXTUNE_BLAS=bundled. The CUDA libraries MLX links against
# (cuBLAS, cuDNN, NCCL, cuFFT, cuSOLVER, NVRTC) are the nvidia-* packages of the machine's own
# Python; libmlx finds them through its rpath, $ORIGIN/../../nvidia/..., so /tmp/mlxcuda/nvidia
# links to that Python's nvidia folder. Needs Python 3.12 there (the wheels are cp312).
MLX_VERSION=${MLX_VERSION:-0.32.4}
MLX_LM_VERSION=${MLX_LM_VERSION:-0.32.2}
STAGE=/var/tmp/mlxcuda-parts
TARGET=/tmp/mlxcuda
PY=${PYTHON:-python3}

case "${1:-}" in
prepare)
  set -e
  rm -rf .device && mkdir -p .device/a .device/b .device/whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 -d .device/whl \
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"
  big=$(ls .device/whl/mlx_cuda_13-*.whl)
  half=$(( ($(stat -c %s "$big") + 1) / 2 ))
  split -b "$half" -d -a 1 "$big" ".device/part."
  mv .device/part.0 .device/a/ && mv .device/part.1 .device/b/
  basename "$big" > .device/b/wheel-name
  (cd .device/b && sha256sum "../whl/$(cat wheel-name)" | cut -d' ' -f1 > wheel-sha256)
  cp .device/whl/mlx-"$MLX_VERSION"-*.whl .device/whl/mlx_lm-*.whl .device/b/
  rm -rf .device/whl
  du -sh .device/a .device/b
  ;;
stage)
  mkdir -p "$STAGE" && cp .device/a/part.0 "$STAGE/" && echo "staged $(du -sh $STAGE/part.0)"
  ;;
install)
  # sourced: no `set -e` here, which would outlive this script in the caller's shell
  _mc_install() {
    [ -f "$STAGE/part.0" ] || { echo "no staged half in $STAGE: run 'stage' in the call before" >&2; return 1; }
    local whl site
    whl=/tmp/$(cat .device/b/wheel-name)
    cat "$STAGE/part.0" .device/b/part.1 > "$whl" || return 1
    echo "$(cat .device/b/wheel-sha256)  $whl" | sha256sum -c --quiet || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$TARGET" "$whl" .device/b/mlx-*.whl .device/b/mlx_lm-*.whl || return 1
    site=$("$PY" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))') || return 1
    ln -sfn "$site/nvidia" "$TARGET/nvidia"
    # the repository is used in place, not installed: give it the package layout pyproject maps
    [ -e mlxtune/metal_kernels ] || ln -s ../metal_kernels mlxtune/metal_kernels
    export PYTHONPATH="$TARGET:$PWD${PYTHONPATH:+:$PYTHONPATH}" MLXTUNE_BLAS=bundled
    "$PY" -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
  }
  _mc_install
  ;;
*)
  echo "usage: mlx_cuda.sh prepare | stage | install" >&2
  ;;
esac
