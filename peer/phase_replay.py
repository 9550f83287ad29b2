"""A validator's replay of another member's DiLoCo phase through `phalanx.Optimizer` (verified runs).

A member's pseudo-gradient Δ = θ_t − x must follow from θ_t and its public batches alone, so in a
verified diloco run every phase starts from a fresh inner optimizer state and the loop computes each
inner step's loss on `public_batch()` (the batch of (seed, peer, inner step)). A validator then
rebuilds the user's optimizer on a copy of the model at θ_t and takes the target's H steps. What an LR
scheduler does to the hyperparameters cannot be rebuilt from the outside, but the schedule follows the
inner step's number, which every member shares: each peer records the hyperparameters its own steps
used and the replay of a phase at the same positions uses them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.outer_step import write_flat


def _delta(anchor: torch.Tensor, moved: list[torch.Tensor]) -> torch.Tensor:
    """Δ = θ_t − x of a replay, flat float32."""
    return anchor - torch.cat([p.detach().reshape(-1).to(torch.float32) for p in moved])


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in group.items() if k != "params"}


class PhaseReplay:
    """Records the inner steps of this peer's phase and replays another member's on a model copy."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batch_fn: Callable[[int, str, int], Any],
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        seed: int,
    ) -> None:
        self.model, self.optimizer, self.batch_fn, self.loss_fn, self.seed = model, optimizer, batch_fn, loss_fn, seed
        self.index = {id(p): i for i, p in enumerate(model.parameters())}
        self.hypers: dict[int, list[dict[str, Any]]] = {}  # inner step → each group's hyperparameters
        self._replica: torch.nn.Module | None = None
        self._rebuild([{**_hyper(g), "params": list(g["params"])} for g in optimizer.param_groups])  # fails early
        # a replay taken step by step, in step with this peer's loop (a validator sitting a phase out)
        self._running: tuple[str, int, torch.Tensor, list[torch.Tensor], torch.optim.Optimizer] | None = None
        self.ready: tuple[str, int, torch.Tensor] | None = None  # (peer, first step, Δ) of the last finished one

    def phase_starts(self) -> None:
        """A fresh inner state (what a replay starts from) and a fresh record."""
        self.optimizer.state.clear()
        self.hypers.clear()

    def record(self, position: int) -> None:
        """The hyperparameters inner step `position` is about to use (after the scheduler set them)."""
        self.hypers[position] = [_hyper(g) for g in self.optimizer.param_groups]

    def delta(self, peer_id: str, first: int, steps: int, anchor: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """Δ of `peer_id`'s inner steps first … first + steps − 1 from θ_t = `anchor` (flat, in the order of
        `params`, the model's parameters the outer step moves)."""
        missing = [s for s in range(first, first + steps) if s not in self.hypers]
        if missing:
            raise PhalanxError(
                f"cannot replay inner steps {first}–{first + steps - 1}: this peer did not take steps {missing[0]}… itself"
            )
        moved, optimizer = self._start(anchor, params, self.hypers[first])
        for step in range(first, first + steps):
            self._step(optimizer, peer_id, step)
        return _delta(anchor, moved)

    def begin(self, peer_id: str, first: int, anchor: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Start replaying `peer_id`'s phase from θ_t = `anchor`, one `step` per inner step of our loop
        (whose record gives each step's hyperparameters), `finish` at its end."""
        self.ready = None
        # θ_t holds still until the round after this phase (strict diloco): no copy of it is kept
        self._running = (peer_id, first, anchor, *self._start(anchor, params, None))

    def step(self, position: int) -> torch.Tensor:
        """Replay inner step `position` of the phase begun (recorded just before); its loss."""
        assert self._running is not None, "step() before begin()"
        peer_id, _, _, _, optimizer = self._running
        if position not in self.hypers:
            raise PhalanxError(f"cannot replay inner step {position}: its hyperparameters were not recorded")
        return self._step(optimizer, peer_id, position)

    def finish(self) -> None:
        """The phase begun is replayed: its Δ is `ready` for the round."""
        assert self._running is not None, "finish() before begin()"
        peer_id, first, anchor, moved, _ = self._running
        self.ready = (peer_id, first, _delta(anchor, moved))
        self._running = None

    def abandon(self) -> None:
        self._running, self.ready = None, None

    def _start(self, anchor: torch.Tensor, params: list[torch.Tensor], hyper: list[dict[str, Any]] | None):
        """The replica at θ_t = `anchor` and the user's optimizer rebuilt on it, with a fresh state."""
        if self._replica is None:
            self._replica = copy.deepcopy(self.model)
        replica = self._replica
        replica.load_state_dict(self.model.state_dict())  # buffers as they are; the parameters follow
        copies = list(replica.parameters())

        def mapped(ps: list[torch.Tensor]) -> list[torch.Tensor]:
            return [copies[self.index[id(p)]] for p in ps]

        moved = mapped(params)
        write_flat(moved, anchor)
        hypers = hyper if hyper is not None else [_hyper(g) for g in self.optimizer.param_groups]
        groups = [{**h, "params": mapped(g["params"])} for g, h in zip(self.optimizer.param_groups, hypers, strict=True)]
        return moved, self._rebuild(groups)

    def _step(self, optimizer: torch.optim.Optimizer, peer_id: str, step: int) -> torch.Tensor:
        for group, hyper in zip(optimizer.param_groups, self.hypers[step], strict=True):
            group.update(hyper)
        optimizer.zero_grad(set_to_none=True)
        assert self._replica is not None
        with torch.enable_grad():
            loss = self.loss_fn(self._replica, self.batch_fn(self.seed, peer_id, step))
            loss.backward()
        optimizer.step()
        return loss.detach()

    def _rebuild(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The user's optimizer class on `groups`, with a fresh state."""
        cls = type(self.optimizer)
        try:
            return cls(groups, **self.optimizer.defaults)
        except TypeError:
            try:
                return cls(groups)
            except TypeError as e:
                raise ConfigError(
                    f"phalanx.Optimizer(verify=True, mode='diloco'): validators rebuild your optimizer as "
                    f"{cls.__name__}(param_groups) to replay a phase and that failed ({e}); use a torch.optim optimizer "
                    "or one whose constructor takes param groups and its defaults"
                ) from None
