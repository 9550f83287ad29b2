"""DiLoCo's outer step, as both front doors run it: `phalanx.Optimizer(mode="diloco")`, under a user's
loop or `phalanx join --mode diloco`'s (peer/trainer.py).

From the shared parameters θ_t each peer takes H inner steps with its own optimizer (its state stays
local), then contributes the pseudo-gradient Δ_i = θ_t − θ_i. The round averages Δ (or aggregates it
robustly), and every peer applies the outer Nesterov step on the result Δ̄:

    v ← μ·v + Δ̄;   θ_{t+1} = θ_t − η·(Δ̄ + μ·v)

θ and the outer momentum v are the shared state: identical on every peer after each outer step
(every peer computes them from the same Δ̄), and what a newcomer downloads. The inner optimizer's
state is not shared, and the inner steps start again from θ_{t+1}.

Overlap (`--overlap on`; off by default, see docs/algorithms.md §8): the round of outer step t runs while the peer takes the inner
steps of t+1. They start from the peer's own estimate of θ_{t+1}: the outer step applied to its own
Δ_i instead of the swarm's Δ̄ (x̂ = θ_t − η·(Δ_i + μ·(μ·v + Δ_i)); exact for a swarm of one). When
θ_{t+1} lands, the steps taken meanwhile are moved onto it: x ← x − x̂ + θ_{t+1}. The next
pseudo-gradient θ_{t+1} − x is then the H inner steps since the boundary, as in the strict version;
only their gradients were taken near θ_{t+1} instead of at it (one outer step of delay at most: a
boundary waits for the round before it). θ and v stay bit-identical across peers; the local x does
not. `--overlap off` (the default) waits for every round before the next inner step (then x ← θ_{t+1}
exactly).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional, Union

import torch

from phalanx.aggregation.compression import ErrorFeedback
from phalanx.errors import PhalanxError
from phalanx.peer.global_step import InThread
from phalanx.peer.node import Node
from phalanx.protocol.btard import Recompute
from phalanx.protocol.engine import Averaged, Resync, RoundRequest, Verification

logger = logging.getLogger(__name__)


def nesterov_outer_step(
    anchor: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float
) -> None:
    """In place: v ← μ·v + Δ̄, θ ← θ − η·(Δ̄ + μ·v) (torch's SGD with nesterov=True, dampening 0)."""
    momentum.mul_(mu).add_(delta)
    anchor.sub_(delta.add(momentum, alpha=mu), alpha=lr)


BACKOFF_MAX_S = 5.0


def write_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the flat vector `flat` into `params`, in order."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def phase_lr_scale(inner: int, warmup: int) -> float:
    """Verified runs: a phase's fresh inner state takes its first steps at a learning rate ramping up
    linearly over `warmup` steps, (i + 1)/W at the phase's step i (public, so replays apply it alike)."""
    return min(1.0, (inner + 1) / warmup) if warmup else 1.0


def backoff_s(failures: int) -> float:
    """The wait before retrying after `failures` failed rounds in a row: 0.2 s, doubling, at most 5 s."""
    return min(BACKOFF_MAX_S, 0.1 * 2 ** min(failures, 6))


class OuterStep:
    """θ_t, v and the bookkeeping of one peer's outer steps. `begin` and `rebase` touch the model's
    parameters: call them on the thread that trains; `round` and `finish` run on the node's loop."""

    def __init__(
        self, node: Node, params: list[torch.Tensor], *, inner_steps: int, outer_lr: float, outer_momentum: float,
        in_thread: InThread, overlap: bool = False, contribute: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
        recompute: Optional[Recompute] = None, topk_fraction: Optional[float] = None,
    ) -> None:  # fmt: skip
        self.node, self.engine, self.params = node, node.engine, [p for p in params if p.requires_grad]
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.in_thread, self.overlap = in_thread, overlap
        self.contribute = contribute  # (outer step, honest Δ) → what this peer sends (attacks)
        self.recompute = recompute  # verified rounds: a validator's replay of another member's Δ
        self.anchor = self._flat()  # θ_t, on the parameters' device
        self.momentum = torch.zeros_like(self.anchor)  # v
        # top-k: the k largest entries of (residual + Δ) are sent, the rest stays in the residual
        self.feedback = None if topk_fraction is None else ErrorFeedback(self.anchor.numel(), topk_fraction, self.anchor.device)
        self.inner = 0  # inner steps since the last boundary
        self.counted = self.engine.step  # outer steps begun and not failed: the position's whole part
        self.in_flight = False  # a round began and is not rebased onto yet
        self.failures = 0  # failed rounds in a row
        self._start: Optional[torch.Tensor] = None  # x at the boundary of the round in flight
        self._inner_at_boundary = 0
        self._boundary_x: Optional[torch.Tensor] = None
        self._landed: Union[Averaged, Resync, None] = None  # finished, waiting for `rebase`
        self._retry_at = 0.0
        self._last_step_at: Optional[float] = None  # when the last inner step ended (None: none this phase)
        self._gaps_s, self._gaps = 0.0, 0  # this phase's time between inner steps (not the wait before the first)
        self.replay_s = 0.0  # H of this peer's inner steps: about what a validator's replay of a phase takes
        self.sitting: Optional[str] = None  # verified: this phase replays that member's instead of training
        # --debug: how long a phase's inner steps took, and the round after them (the member that ends
        # its phase last waits for nobody: its round time is what the round itself costs)
        self._phase_began, self._phase_s, self._round_began = time.monotonic(), 0.0, 0.0

    @property
    def step(self) -> int:
        """Outer steps of the shared state this peer holds."""
        return self.engine.step

    @property
    def position(self) -> int:
        """Inner steps of this peer's training so far: H per outer step begun, plus those since."""
        return self.counted * self.inner_steps + self.inner

    @property
    def ready(self) -> bool:
        """The next boundary is here (after a failure: and its back-off is over)."""
        return self.inner >= self.inner_steps and not self.in_flight and time.monotonic() >= self._retry_at

    @property
    def retry_in_s(self) -> float:
        """What is left of the back-off after a failed round."""
        return max(0.0, self._retry_at - time.monotonic())

    def inner_step_done(self) -> None:
        self.inner += 1
        now = time.monotonic()
        if self._last_step_at is not None:
            self._gaps_s, self._gaps = self._gaps_s + now - self._last_step_at, self._gaps + 1
        self._last_step_at = now

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The shared state: θ_t and v (the inner optimizer's state, and x, are each peer's own)."""
        tensors, offset = {}, 0
        for i, p in enumerate(self.params):
            tensors[f"param.{i}"] = self.anchor[offset : offset + p.numel()].view_as(p).to("cpu", p.dtype, copy=True)
            offset += p.numel()
        tensors["outer_momentum"] = self.momentum.to("cpu", copy=True)
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """θ and v from a snapshot (a donor's, a checkpoint's), and x ← θ; the caller sets the engine's state."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(tensors[f"param.{i}"])
        self.momentum.copy_(tensors["outer_momentum"])
        self.anchor = self._flat()
        self.inner, self.in_flight, self._landed, self._start = 0, False, None, None
        self.counted = self.engine.step

    def restore(self, momentum: torch.Tensor, anchor: Optional[torch.Tensor], step: int) -> None:
        """A checkpoint's v and θ_t (None: the parameters as they are) at outer step `step`; the
        parameters stay as they are."""
        self.momentum.copy_(momentum)
        self.anchor = self._flat() if anchor is None else anchor.to(self.anchor.device, torch.float32).clone()
        self.inner, self.in_flight, self._landed, self._start, self.counted = 0, False, None, None, step

    # ---- a boundary: begin (training thread), round and finish (loop), rebase (training thread) --

    def begin(self) -> torch.Tensor:
        """This boundary's contribution: Δ = θ_t − x (or an attacker's version of it)."""
        now = time.monotonic()
        self._phase_s, self._round_began = now - self._phase_began, now
        if self._gaps:
            self.replay_s = self.inner_steps * self._gaps_s / self._gaps
        self._last_step_at, self._gaps_s, self._gaps = None, 0.0, 0
        x = self._flat()
        delta = self.anchor - x
        if self.contribute is not None:
            delta = self.contribute(self.engine.step, delta)
        if self.feedback is not None:
            delta = self.feedback.send(delta)
        self._boundary_x = x  # where a failed round puts the inner steps back
        if self.overlap:  # train on from our own estimate of θ_{t+1}: the outer step on our Δ alone
            x = self.anchor.clone()
            nesterov_outer_step(x, self.momentum.clone(), self.anchor - self._flat(), self.outer_lr, self.outer_momentum)
            self._write(x)
        self._start = x
        self._inner_at_boundary, self.inner = self.inner, 0
        self.counted += 1
        self.in_flight = True
        return delta.to("cpu", torch.float32)

    async def round(self, delta: torch.Tensor) -> Union[Averaged, Resync]:
        """All-reduce `delta`; may be cancelled. Failures raise (ROUND_FAILURES): call `failed`. A peer
        that sat the phase out sends nothing that counts and checks the member it replayed."""
        verification = Verification(
            recompute=self.recompute, recompute_s=self.replay_s, sit_out=self.sitting is not None, target=self.sitting
        )
        return await self.engine.run_round(RoundRequest(delta, verification=verification))

    async def finish(self, outcome: Union[Averaged, Resync]) -> Union[Averaged, Resync, None]:
        """Averaged: the outer step is applied to θ and v and published. Resync: the swarm's θ and v
        are loaded. Either way `rebase` then moves x. None: the state download failed (`failed`)."""
        if isinstance(outcome, Resync):
            try:
                snapshot = await self.engine.fetch_state(outcome, self.state_tensors())
            except (PhalanxError, ValueError) as e:
                logger.warning(f"state download from {outcome.donor[-8:]} failed: {e}")
                return None
            await self.in_thread(self._load_anchor, snapshot.tensors)
            self.engine.set_state(snapshot.version, snapshot.step, together=outcome.together)
            logger.info(f"loaded the outer state of step {snapshot.step} from {outcome.donor[-8:]}")
        else:
            await self.in_thread(self._outer_step, outcome.result.vector)
            await self.engine.completed(outcome, self.state_tensors)
        self._landed = outcome
        return outcome

    def failed(self) -> float:
        """The round in flight failed (training thread): its inner steps count again (the next Δ covers
        them too; with overlap, the steps since are moved back off our estimate of θ_{t+1}) and the
        next boundary waits out a back-off, which is returned."""
        if self.overlap and self._start is not None and self._boundary_x is not None:
            self._write(self._flat().sub_(self._start).add_(self._boundary_x))
        self.inner += self._inner_at_boundary
        self.counted -= 1
        if self.feedback is not None:  # nothing was delivered
            self.feedback.give_back()
        self.in_flight, self._start, self._landed, self._boundary_x = False, None, None, None
        self.failures += 1
        wait = backoff_s(self.failures)
        self._retry_at = time.monotonic() + wait
        return wait

    def rebase(self) -> None:
        """Move x onto θ_{t+1}: keep the inner steps taken since the boundary (none without overlap); after
        a resync, x ← θ and those steps are dropped (they started from a state the swarm left)."""
        outcome, start = self._landed, self._start
        assert outcome is not None and start is not None, "rebase() before the round finished"
        if isinstance(outcome, Resync):
            self._write(self.anchor)
            self.inner, self.counted = 0, self.engine.step
            if self.feedback is not None:  # what it held was progress from a state the swarm left
                self.feedback.residual.zero_()
        elif self.inner == 0:  # nothing taken meanwhile (always so without overlap): x = θ_{t+1} exactly
            self._write(self.anchor)
        else:
            self._write(self._flat().sub_(start).add_(self.anchor))
        self.in_flight, self._start, self._landed, self._boundary_x, self.failures = False, None, None, None, 0
        now = time.monotonic()
        logger.debug(
            f"outer step {self.engine.step}: {self._inner_at_boundary} inner steps in {self._phase_s:.3f} s, "
            f"then the round and the outer step in {now - self._round_began:.3f} s"
        )
        self._phase_began = now

    def _outer_step(self, delta: torch.Tensor) -> None:
        nesterov_outer_step(
            self.anchor, self.momentum, delta.to(self.anchor.device), self.outer_lr, self.outer_momentum
        )

    def _load_anchor(self, tensors: dict[str, torch.Tensor]) -> None:
        self.anchor = torch.cat([tensors[f"param.{i}"].reshape(-1) for i in range(len(self.params))]).to(
            self.anchor.device, torch.float32
        )
        self.momentum.copy_(tensors["outer_momentum"])

    def _write(self, flat: torch.Tensor) -> None:
        write_flat(self.params, flat)

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])
