"""The naive forms: build the logits, take a log-softmax. Every other tier is tested against these."""

from __future__ import annotations

import mlx.core as mx


def linear_cross_entropy_reference(
    hidden, weight, targets, ignore_index, label_smoothing, softcap, weight_grad=True
):
    """Per-token losses [N] (0 where ignored) and the valid mask [N]. (Autograd differentiates
    this form, so ``weight_grad`` has nothing to skip.)"""
    logits = (hidden @ weight.T).astype(mx.float32)
    if softcap is not None:
        logits = softcap * mx.tanh(logits / softcap)
    valid = targets != ignore_index
    safe = mx.where(valid, targets, 0)
    lse = mx.logsumexp(logits, axis=-1)
    target_logit = mx.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    nll = lse - target_logit
    if label_smoothing > 0:
        smooth = lse - logits.mean(axis=-1)
        nll = (1 - label_smoothing) * nll + label_smoothing * smooth
    return mx.where(valid, nll, 0.0), valid
