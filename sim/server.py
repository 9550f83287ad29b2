"""The parameter-server event loop: N workers, a virtual clock and a schedule for K.

Events are minibatch completions, processed in time order (ties: lower worker index
first). The engines (k_sync, k_async, k_batch_async) are described in methods.py. An
update takes the group's rows, lets the Byzantine workers replace theirs, and hands them
to the server rule; its version counter gives each row's staleness.
"""

from __future__ import annotations

import heapq

from phalanx.sim.byzantine import Adversary
from phalanx.sim.config import Budget
from phalanx.sim.record import Progress, Recorder
from phalanx.sim.rules import Row, ServerRule, finite
from phalanx.sim.workers import Job, Workers
from phalanx.protocol.sync_policy import SyncPolicy

ENGINES = ("k_sync", "k_async", "k_batch_async")


class ParameterServerSim:
    def __init__(
        self,
        *,
        engine: str,
        rule: ServerRule,
        workers: Workers,
        policy: SyncPolicy,
        adversary: Adversary,
        budget: Budget,
        recorder: Recorder,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.engine = engine
        self.rule = rule
        self.workers = workers
        self.policy = policy
        self.adversary = adversary
        self.budget = budget
        self.recorder = recorder
        self.progress = Progress()

    def run(self) -> Progress:
        self.recorder.record(self.progress, self.rule.model())
        if self.engine == "k_sync":
            self._run_rounds()
        else:
            self._run_events()
        if self.budget.kind == "time" and not self.progress.diverged:
            self.progress.time_s = self.budget.amount  # the model holds until the end of the budget
        self.recorder.record(self.progress, self.rule.model())
        return self.progress

    # ---- engines ---------------------------------------------------------------------

    def _run_rounds(self) -> None:
        """K-sync: every round all N read θ; the first K finishers make the update."""
        p, n = self.progress, self.workers.n
        while not self.recorder.done(p):
            k = self.policy.k(n, p.time_s, p.train_loss)
            jobs = [self._start(w) for w in range(n)]
            jobs.sort(key=lambda j: (j.finish_s, j.worker))
            if self.budget.kind == "time" and jobs[k - 1].finish_s > self.budget.amount:
                break
            for job in jobs[k:]:
                self.workers.cancel(job)
            p.time_s = jobs[k - 1].finish_s
            self._update(jobs[:k], k)

    def _run_events(self) -> None:
        """K-async and K-batch-async: an update whenever K gradients have arrived."""
        p, n = self.progress, self.workers.n
        heap: list[tuple[float, int, Job]] = []
        for w in range(n):
            job = self._start(w)
            heap.append((job.finish_s, w, job))
        heapq.heapify(heap)
        waiting: list[Job] = []
        while heap and not self.recorder.done(p):
            if self.budget.kind == "time" and heap[0][0] > self.budget.amount:
                break
            p.time_s, w, job = heapq.heappop(heap)
            waiting.append(job)
            k = self.policy.k(n, p.time_s, p.train_loss)
            restart: list[int] = []
            if len(waiting) >= k:
                group, waiting = waiting, []
                self._update(group, k)
                restart = [j.worker for j in group] if self.engine == "k_async" else [w]
            elif self.engine == "k_batch_async":
                restart = [w]  # reads the current θ before the update it contributes to
            for r in restart:
                nxt = self._start(r)
                heapq.heappush(heap, (nxt.finish_s, r, nxt))

    # ---- one update --------------------------------------------------------------------

    def _start(self, worker: int) -> Job:
        p = self.progress
        flip = self.adversary.flips_labels(worker, p.updates)
        return self.workers.start(worker, self.rule.read(worker), p.updates, p.time_s, flip=flip)

    def _update(self, group: list[Job], k: int) -> None:
        p = self.progress
        sent = [self.rule.send(j.worker, self.workers.gradient(j)) for j in group]
        for j in group:
            if not self.adversary.is_byzantine(j.worker):
                p.observe_loss(j.loss)
        sent = self.adversary.forge([j.worker for j in group], sent, p.updates)
        rows = [Row(j.worker, v, j.params, p.updates - j.version) for j, v in zip(group, sent, strict=True)]
        self.rule.apply(rows)
        p.updates += 1
        p.gradients += len(rows)
        p.staleness.extend(r.staleness for r in rows)
        p.k = k
        if not finite(self.rule.model()):
            p.diverged = True
        self.recorder.maybe(p, self.rule.model)
