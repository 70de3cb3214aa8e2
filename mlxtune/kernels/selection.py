"""Which kernel tier each kernel choice of a recipe runs as on this machine (``kernels.loss``,
``kernels.attention``), refusing one the machine cannot run before anything is loaded."""

from __future__ import annotations

import os

from .. import kernels
from ..errors import UserInputError


def kernel_tiers(recipe, log) -> dict[str, str]:
    """The tier each kernel choice runs as here, refusing one this machine cannot run, before
    anything is loaded or compiled."""
    k = recipe.kernels
    tiers = {}
    for name, choice in (("loss", k.loss), ("attention", k.attention)):
        if choice == "off":
            tiers[name] = "off"
            continue
        try:
            impls = kernels.ATTENTION_IMPLS if name == "attention" else kernels.IMPLS
            tiers[name] = kernels.resolve(choice, impls)
        except ValueError as e:
            raise UserInputError(str(e), f"kernels.{name}") from None
    # A GPU tier runs only once it has passed its check against the reference on this
    # machine: "auto" falls back to chunked, a recipe or MLXTUNE_KERNELS naming it is refused.
    # Checked only where the GPU tier could run. (The kernels module is looked up at each call,
    # so the tier functions can be replaced to test this on a machine without the GPU.)
    gpu, env = kernels.gpu_backend(), os.environ.get("MLXTUNE_KERNELS")
    if gpu is None or not kernels.on_gpu():
        return tiers
    if not (gpu in tiers.values() or ("auto" in (k.loss, k.attention) and not env)):
        return tiers
    why = kernels.self_check(gpu)
    for name, tier in tiers.items():
        if why is not None and tier == gpu:
            raise UserInputError(
                f"the {gpu} kernels failed their check here: {why}", f"kernels.{name}"
            )
    log(
        f"kernels: the {gpu} tier agrees with the reference here"
        if why is None
        else f"kernels: not using the {gpu} tier ({why}); running the chunked tier"
    )
    return tiers
