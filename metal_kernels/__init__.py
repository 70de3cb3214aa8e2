"""Kernel sources for mlxtune's fused operations, installed as ``mlxtune.metal_kernels``.

Metal sources (``mx.fast.metal_kernel``) with CUDA twins (``mx.fast.cuda_kernel``) built from one
kernel body and a small per-backend prelude; ``mlxtune.kernels`` picks the tier per device.
"""
