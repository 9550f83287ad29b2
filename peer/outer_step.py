"""DiLoCo's outer step, as both front doors run it: `phalanx join --mode diloco` (peer/modes/diloco.py)
and `phalanx.Optimizer(mode="diloco")`.

From the shared parameters θ_t each peer takes H inner steps with its own optimizer (its state stays
local), then contributes the pseudo-gradient Δ_i = θ_t − θ_i. The round averages Δ (or aggregates it
robustly), and every peer applies the outer Nesterov step on the result Δ̄:

    v ← μ·v + Δ̄;   θ_{t+1} = θ_t − η·(Δ̄ + μ·v)

θ and the outer momentum v are the shared state: identical on every peer after each outer step
(every peer computes them from the same Δ̄), and what a newcomer downloads. The inner optimizer's
state is not shared, and the inner steps start again from θ_{t+1}.
"""

from __future__ import annotations

import logging
from typing import Union

import torch

from phalanx.aggregation.errors import PhalanxError
from phalanx.peer.global_step import InThread
from phalanx.peer.node import Node
from phalanx.protocol.engine import Averaged, Resync

logger = logging.getLogger(__name__)


def nesterov_outer_step(
    anchor: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float
) -> None:
    """In place: v ← μ·v + Δ̄, θ ← θ − η·(Δ̄ + μ·v) (torch's SGD with nesterov=True, dampening 0)."""
    momentum.mul_(mu).add_(delta)
    anchor.sub_(delta.add(momentum, alpha=mu), alpha=lr)


class OuterStep:
    def __init__(
        self, node: Node, params: list[torch.Tensor], *, inner_steps: int, outer_lr: float, outer_momentum: float,
        in_thread: InThread,
    ) -> None:  # fmt: skip
        self.node, self.engine, self.params = node, node.engine, [p for p in params if p.requires_grad]
        self.inner_steps, self.outer_lr, self.outer_momentum, self.in_thread = (
            inner_steps,
            outer_lr,
            outer_momentum,
            in_thread,
        )
        self.anchor = self._flat()  # θ_t, on the parameters' device
        self.momentum = torch.zeros_like(self.anchor)  # v
        self.inner = 0  # inner steps taken since θ_t

    @property
    def step(self) -> int:
        """Outer steps of the shared state this peer holds."""
        return self.engine.step

    @property
    def ready(self) -> bool:
        return self.inner >= self.inner_steps

    def inner_step_done(self) -> None:
        self.inner += 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The shared state: θ_t and v (the inner optimizer's state is each peer's own)."""
        tensors = {f"param.{i}": p.detach().to("cpu", copy=True) for i, p in enumerate(self.params)}
        tensors["outer_momentum"] = self.momentum.to("cpu", copy=True)
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(tensors[f"param.{i}"])
        self.momentum.copy_(tensors["outer_momentum"])
        self.anchor = self._flat()
        self.inner = 0

    async def attempt(self) -> Union[Averaged, Resync, None]:
        """`round` then `finish`, for callers that never cancel halfway."""
        return await self.finish(await self.round())

    async def round(self) -> Union[Averaged, Resync]:
        """All-reduce this peer's pseudo-gradient θ_t − θ_i; may be cancelled. Failures raise
        (ROUND_FAILURES) and keep the inner steps for another try."""
        pseudo_gradient = self.anchor - self._flat()
        return await self.engine.run_round(pseudo_gradient.to("cpu", torch.float32), weight=1.0)

    async def finish(self, outcome: Union[Averaged, Resync]) -> Union[Averaged, Resync, None]:
        """Averaged: the outer step is applied and published. Resync: the swarm's θ and v are loaded
        (this peer's inner steps are dropped). None: the state download failed; try another round."""
        if isinstance(outcome, Resync):
            try:
                snapshot = await self.engine.fetch_state(outcome, self.state_tensors())
            except (PhalanxError, ValueError) as e:
                logger.warning(f"state download from {outcome.donor[-8:]} failed: {e}")
                return None
            await self.in_thread(self.load_state_tensors, snapshot.tensors)
            self.engine.set_state(snapshot.version, snapshot.step)
            logger.info(f"loaded the outer state of step {snapshot.step} from {outcome.donor[-8:]}")
            return outcome
        await self.in_thread(self._apply, outcome.result.vector)
        await self.engine.completed(outcome, self.state_tensors)
        return outcome

    def _apply(self, delta: torch.Tensor) -> None:
        nesterov_outer_step(
            self.anchor, self.momentum, delta.to(self.anchor.device), self.outer_lr, self.outer_momentum
        )
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.anchor[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.inner = 0

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])
