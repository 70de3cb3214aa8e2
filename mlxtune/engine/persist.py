"""What a checkpoint keeps of the engine, and how it is put back: the optimizer's state, the
fp32 masters, the trainable weights and the host's part (loss scale, skipped steps, random
state). Weights divided among ranks (``Engine.layout``: fsdp or tensor) are written whole,
under the ordinary names, so a checkpoint resumes at any world size with any strategy."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..errors import UserInputError
from ..export import load_trainable_weights, read_trainable
from ..models.building import write_safetensors
from .precision import select_into
from .state import EngineState


class Persisted:
    """The engine's saving and restoring (``Engine`` mixes it in)."""

    def host_state(self) -> EngineState:
        """The engine's state a checkpoint keeps besides the arrays ``save`` writes."""
        hi, lo = (int(v) for v in mx.random.state[0].tolist())
        return EngineState(
            scale=self.scaler["scale"].item(),
            good=self.scaler["good"].item(),
            skipped=self.skipped,
            in_a_row=self.in_a_row,
            micro_split=self.split,
            rng=(hi, lo),
        )

    def checkpoint_arrays(self) -> dict[str, dict]:
        """What ``save`` writes, by file name: the optimizer's whole state and the fp32
        masters when there are any. A fully sharded run's are whole, under the unsharded
        names (``fsdp.whole_tree``): lazy gathers that every rank computes, in this order."""
        out = {"optimizer.safetensors": dict(tree_flatten(self.optimizer.state))}
        if self.masters is not None:
            out["masters.safetensors"] = dict(tree_flatten(self.masters))
        if self.sharded:
            out = {f: self.layout.whole_tree(self.model, d) for f, d in out.items()}
        return out

    def save(self, folder, arrays: dict[str, dict] | None = None) -> None:
        """The optimizer's whole state, the fp32 masters when there are any
        (``checkpoint_arrays``, or ``arrays`` made by it), and what the objective carries
        between steps. A fully sharded run's are written a tensor at a time, each gathered,
        written and dropped."""
        for name, tensors in (arrays or self.checkpoint_arrays()).items():
            if self.sharded:
                write_safetensors(folder / name, tensors)
            else:
                mx.save_safetensors(str(folder / name), tensors)
        self.objective.save(folder)

    def _put_trainable(self, weights: dict, where: str) -> None:
        """Trainable weights by name and shape (``load_trainable_weights``); a fully sharded
        run reads whole values under the unsharded names, and keeps its pieces."""
        if not self.sharded:
            load_trainable_weights(self.model, weights, where)
            return
        shapes = self.layout.whole_shapes(self.model)
        for k, v in weights.items():
            if k not in shapes:
                raise UserInputError(
                    f"{k!r} is not a trainable parameter of this model and adapter", where
                )
            if tuple(v.shape) != shapes[k]:
                raise UserInputError(
                    f"{k}: shape {tuple(v.shape)} does not match the model's {shapes[k]}", where
                )
        if missing := sorted(set(shapes) - set(weights)):
            raise UserInputError(f"no weight for {missing[0]}", where)
        self.layout.put_whole_trainable(self.model, weights)

    def load_weights(self, folder) -> None:
        """Put a checkpoint's trainable weights in place, each checked by name and shape, and
        its fp32 masters when this run keeps them."""
        self._put_trainable(read_trainable(folder), str(folder / "adapters.safetensors"))
        masters = folder / "masters.safetensors"
        if self.masters is not None:
            if not masters.exists():
                raise UserInputError(
                    "this checkpoint holds no fp32 master weights (precision.master_weights "
                    "was off, or model.dtype was float32)",
                    str(folder),
                )
            # checks names and shapes; the trainable weights are then fp32: the masters
            self._put_trainable(mx.load(str(masters)), str(masters))
            select_into(self.masters, self.model.trainable_parameters())
            self.model.update(tree_map(lambda w, dt: w.astype(dt), self.masters, self.dtypes))

    def restore(self, folder, host: EngineState) -> None:
        """Put back a checkpoint's weights (``load_weights``) and what ``save`` and
        ``host_state`` saved."""
        self.load_weights(folder)
        saved = mx.load(str(folder / "optimizer.safetensors"))
        if self.sharded:  # whole, written at any world size: this rank's pieces of it
            held = [k for k, _ in tree_flatten(self.optimizer.state)]
            saved = self.layout.pieces_of_whole(self.model, held, saved)
        self.optimizer.state = tree_unflatten(list(saved.items()))
        # fills in the structure around what was saved (frozen layers hold empty states)
        self.optimizer.init(self.params())
        self._build()  # the compiled steps hold the state they were built with
        if host.scale is not None:
            self.scaler["scale"] = mx.array(float(host.scale))
            self.scaler["good"] = mx.array(int(host.good), dtype=mx.int32)
        self.skipped, self.in_a_row, self.split = host.skipped, host.in_a_row, host.micro_split
        hi, lo = host.rng
        mx.random.seed((hi << 32) | lo)
        self.objective.restore(folder)
        mx.eval(self.model.parameters(), self.optimizer.state)
