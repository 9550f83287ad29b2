"""The fault scenarios as a data table, the code that runs one and measures it, and the acceptance
checks of issue 16 applied to the numbers.

A swarm scenario: bootstrap + 4 trainers (digits-mlp, `--mode sync` unless said), each on its own
network host; a clean reference window, then each fault of the row in turn (on, held, off, a
settle window). From the 1 s status polls: the healthy trainers' longest stall, their rounds done
and failed, their throughput against the reference window, the faulty peer's readiness while
faulty and after, when the swarm is one group again, and checkpoint hashes for "same model".

Measure without asserting:  python scripts/faults.py --scenario a   (root; see docs/reliability.md).
Scenario (g) lives in fault_checkpoints.py.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from phalanx.peer.health.record import TTL_S
from phalanx.tools.lab.swarm import LabSwarm, Sample, longest_stall

REF_S = 10.0  # clean reference window before the first fault
# A peer notices a cut once the others' records in its own DHT storage expire (TTL_S after their
# last store), plus one poll and one status read: /readyz must say 503 from then on.
GRACE_S = TTL_S + 2.0
MAX_STALL_S = 10.0
REJOIN_S = 30.0
MIN_THROUGHPUT = 0.75  # k:<n-1>: a lossy or slow peer may cost the others at most 25 %


@dataclass(frozen=True)
class Fault:
    kind: str  # cut | cut_boot | split | loss | cap | stop | kill_main | kill_tree
    amount: float = 0.0  # loss: percent; cap: Mbit/s
    hold_s: float = 20.0  # how long the fault lasts (kills: how long the others are watched)
    settle_s: float = 30.0  # watched after the fault ends
    checks: tuple[str, ...] = ()  # this fault's row's checks, when they are not the scenario's
    victim: int = -1  # which trainer a one-trainer fault hits (its index among the live ones)

    @property
    def label(self) -> str:
        unit = {"loss": " %", "cap": " Mbit/s"}.get(self.kind, "")
        amount = f" {self.amount:g}{unit}" if unit else ""
        return f"{self.kind}{amount} {self.hold_s:g} s"


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    faults: tuple[Fault, ...] = ()
    mode: str = "sync"
    sync_policy: str = "full"
    checks: tuple[str, ...] = ()  # names in CHECKS
    # Acceptance checks of the issue this code does not meet yet: measured and printed every run,
    # asserted once they hold. Each stays listed in docs/reliability.md with its measured number.
    open_goals: tuple[str, ...] = ()
    victim_leads: bool = False  # the faulty trainer is the one with the lowest peer ID (the matchmaking leader)
    delay_s: float = 0.0  # one-way delay added on every host for the whole row (each pair: twice it each way)

    @property
    def held(self) -> tuple[str, ...]:
        return tuple(c for c in self.checks if c not in self.open_goals)

    def checks_of(self, row: "Row") -> tuple[str, ...]:
        """The checks that apply to `row`: its fault's own, if it has them, else the scenario's."""
        fault = next((f for f in self.faults if f.label == row.fault), None)
        return fault.checks if fault is not None and fault.checks else self.checks

    def join_args(self) -> tuple[str, ...]:
        return ("--mode", self.mode, "--sync-policy", self.sync_policy)


@dataclass
class Row:
    """The numbers measured for one fault of a scenario (None: not applicable)."""

    scenario: str
    fault: str
    stall_s: Optional[float] = None  # healthy trainers' longest interval without a step
    faulty_stall_s: Optional[float] = None
    rounds_during: Optional[int] = None  # fewest rounds a healthy trainer completed while the fault held
    rounds_failed: Optional[int] = None  # healthy trainers' failed rounds, fault and settle window
    throughput: Optional[float] = None  # healthy trainers' steps/s (lasgd: rounds/s) vs the reference window
    ready_while_faulty: Optional[str] = None  # "ready polls / answered polls" of the faulty peer(s) after GRACE_S
    ready_after_s: Optional[float] = None  # fault end → faulty peer's first ready poll
    one_swarm_s: Optional[float] = None  # fault end → every trainer in one full group and seen by the bootstrap
    same_model: Optional[str] = None  # "equal / common" checkpoint steps after one swarm (or the settle window)
    same_at_ends: Optional[bool] = None  # equal at the first and the last of those steps
    accuracy: Optional[float] = None  # mean test accuracy of the trainers at the end of the row
    orphans: Optional[int] = None  # processes of a SIGKILLed trainer alive 5 s later
    restart_ready_s: Optional[float] = None  # restart → ready and in the full group
    newcomer_s: Optional[float] = None  # (b) newcomer through a trainer during the cut → in a group of ≥ 2
    newcomer_after_s: Optional[float] = None  # (b) newcomer through the healed bootstrap → in the full group
    kills: Optional[int] = None  # (g)
    kills_mid_write: Optional[int] = None
    corrupt: Optional[int] = None
    missing: Optional[int] = None
    notes: list[str] = field(default_factory=list)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("a", "one trainer partitioned 30 s, then healed", (Fault("cut", hold_s=30),),
             checks=("stall", "rounds", "not_ready", "ready_after", "one_swarm")),
    Scenario("b", "the bootstrap partitioned 60 s; a newcomer knowing a trainer joins during the cut",
             (Fault("cut_boot", hold_s=60),), checks=("stall", "rounds", "not_ready", "one_swarm", "newcomer")),
    Scenario("c", "5 % then 20 % packet loss on one trainer", (Fault("loss", 5, 15, 10), Fault("loss", 20, 15, 10)),
             checks=("stall", "rounds_5")),
    Scenario("d", "one trainer capped at 10 then 1 Mbit/s (sync)", (Fault("cap", 10, 15, 10), Fault("cap", 1, 15, 10)),
             checks=("stall",)),
    Scenario("d-lasgd", "one trainer capped at 10 then 1 Mbit/s (lasgd)", (Fault("cap", 10, 15, 10), Fault("cap", 1, 15, 10)),
             mode="lasgd", checks=()),
    Scenario("cd-k3", "20 % loss, then 1 Mbit/s, on the leading trainer with --sync-policy k:3",
             (Fault("loss", 20, 15, 10), Fault("cap", 1, 15, 10)), sync_policy="k:3", checks=("stall", "throughput"),
             # the worst case: every join and group reply crosses the bad link. Throughput is open again: the
             # first round with the lossy leader costs everyone its 5 s idle limit, often twice (docs/reliability.md)
             open_goals=("throughput",), victim_leads=True),
    Scenario("e", "SIGSTOP of a trainer's processes 20 s, then SIGCONT", (Fault("stop", hold_s=20),),
             checks=("stall", "rounds", "ready_after", "one_swarm")),
    Scenario("f", "SIGKILL of a trainer's whole tree, then of another's main process only; both restarted",
             (Fault("kill_tree", hold_s=15, settle_s=60), Fault("kill_main", hold_s=15, settle_s=60)),
             checks=("stall", "rounds", "orphans", "restart")),
    Scenario("g", "kill -9 at 20 random moments of --checkpoint-every 1, then --resume (one trainer)",
             checks=("checkpoints",)),
    Scenario("h", "split: two trainers cut off from the other two and the bootstrap 30 s, then healed",
             (Fault("split", hold_s=30),), checks=("stall", "not_ready", "one_swarm")),
)  # fmt: skip

# What CI runs of the table (tests/faults/test_fault_scenarios.py; the whole table with `pytest --long`
# or scripts/faults.py): "short", which holds the faults of a, b, c, d, e, h and f's first on one swarm
# with shorter windows, each fault with its row's checks, and (g), whose checkpoints no swarm row checks.
SHORT = Scenario(
    "short",
    "a–f and h on one swarm: cut 20 s, 5 % loss, 1 Mbit/s, SIGSTOP 15 s, split 20 s, bootstrap cut 45 s, SIGKILL of a tree",
    (
        Fault("cut", hold_s=20, settle_s=20, checks=("stall", "rounds", "not_ready", "ready_after", "one_swarm")),
        Fault("loss", 5, 10, 10, checks=("stall", "rounds_5"), victim=-2),
        Fault("cap", 1, 10, 15, checks=("stall",), victim=-3),
        Fault("stop", hold_s=15, settle_s=20, checks=("stall", "rounds", "ready_after", "one_swarm")),
        Fault("split", hold_s=20, settle_s=20, checks=("stall", "not_ready", "one_swarm")),
        Fault("cut_boot", hold_s=45, checks=("stall", "rounds", "not_ready", "one_swarm", "newcomer")),
        Fault("kill_tree", hold_s=10, settle_s=30, checks=("stall", "rounds", "orphans", "restart")),
    ),
    checks=("stall", "rounds", "rounds_5", "not_ready", "ready_after", "one_swarm", "newcomer", "orphans", "restart"),
)  # fmt: skip
SHORT_HOLDS = ("a", "b", "c", "d", "e", "h")  # rows whose faults and checks the short row holds
# rows a, e and f again with 50 ms one-way on every host (200 ms RTT between any two): deadlines a LAN's
# rounds never get near (issue: rounds at 100-300 ms RTT)
# open in (a-50ms): at 200 ms RTT the others stalled 15 s on the cut and the healed trainer was not back in one
# swarm within 30 s, in 3 of 3 runs (docs/reliability.md)
DELAYED_OPEN = {"a": ("stall", "one_swarm")}
DELAYED = tuple(
    replace(base, key=f"{base.key}-50ms", title=f"{base.title}; 50 ms one-way on every host", delay_s=0.05,
            open_goals=DELAYED_OPEN.get(base.key, ()))
    for base in SCENARIOS if base.key in ("a", "e", "f")
)  # fmt: skip
SCENARIOS = (*SCENARIOS, *DELAYED)
IN_CI = ("short", "g")
# what CI runs in place of the other rows that assert checks
IN_CI_INSTEAD = {
    "cd-k3": "tests/protocol/test_join_next.py (a resyncing peer under early joins) and the short row's loss and cap",
    "f": "the short row's SIGKILL of a whole tree and tests/peer/test_lifeline.py's of a main process",
}
BY_KEY = {s.key: s for s in (*SCENARIOS, SHORT)}


# ---- measures from the polls ---------------------------------------------------------------


def value_at(samples: list[Sample], t: float, attr: str) -> Optional[float]:
    """`attr` of the last answered poll at or before `t` (the first after it if none)."""
    before = [s for s in samples if s.ok and s.t <= t]
    after = [s for s in samples if s.ok and s.t > t]
    pick = before[-1] if before else (after[0] if after else None)
    return None if pick is None else getattr(pick, attr)


def delta(samples: list[Sample], t0: float, t1: float, attr: str) -> int:
    a, b = value_at(samples, t0, attr), value_at(samples, t1, attr)
    return 0 if a is None or b is None else int(b - a)


def rate(samples: list[Sample], t0: float, t1: float, attr: str) -> float:
    return delta(samples, t0, t1, attr) / max(t1 - t0, 1e-9)


# ---- running a swarm scenario --------------------------------------------------------------


class Runner:
    """Runs one swarm scenario and collects its rows."""

    def __init__(self, scenario: Scenario, workdir: Path, log: Callable[[str], None] = print) -> None:
        self.scenario, self.workdir, self.log = scenario, workdir, log
        spare = 2 if any(f.kind == "cut_boot" for f in scenario.faults) else 0
        self.swarm = LabSwarm(workdir, trainers=4, spare=spare, join_args=scenario.join_args(), tag=scenario.key)
        self.throughput_attr = "step" if scenario.mode == "sync" else "rounds_done"
        # a full group: every trainer, or K of them under --sync-policy k:<K>
        self.full_group = int(scenario.sync_policy[2:]) if scenario.sync_policy.startswith("k:") else 0
        self.rows: list[Row] = []
        self.rows_notes: list[str] = []  # notes of the fault being run

    @property
    def trainers(self) -> list[str]:
        return [n for n, p in self.swarm.peers.items() if p.role == "trainer" and p.proc.poll() is None]

    @property
    def core(self) -> list[str]:
        """The live trainers of the row's swarm, without (b)'s newcomers."""
        return [n for n in self.trainers if n in self.swarm.trainer_names]

    def delay_every_host(self) -> None:
        for name in self.swarm.lab.hosts if self.scenario.delay_s else ():
            self.swarm.lab.delay(name, self.scenario.delay_s)

    def run(self) -> list[Row]:
        sw = self.swarm
        try:
            self.delay_every_host()
            sw.start()
            took = sw.wait(
                lambda: sw.training_together(min_step=5, group=self.full_group), 300, "the 4 trainers never trained in one group"
            )
            self.log(f"[{self.scenario.key}] 4 trainers training together after {took:.0f} s")
            ref0 = time.monotonic()
            time.sleep(REF_S)
            ref = (ref0, time.monotonic())
            for fault in self.scenario.faults:
                self.rows.append(self.run_fault(fault, ref))
            accuracy = [sw.peers[n].last().accuracy for n in self.trainers if sw.peers[n].last() is not None]
            accuracy = [a for a in accuracy if a is not None]
            for row in self.rows:
                row.accuracy = round(sum(accuracy) / len(accuracy), 4) if accuracy else None
        finally:
            sw.close()
        return self.rows

    def run_fault(self, fault: Fault, ref: tuple[float, float]) -> Row:
        sw, row = self.swarm, Row(self.scenario.key, fault.label)
        faulty, healthy = self.roles(fault)
        settled = [n for n in healthy if self.settled(n)]  # a trainer restarted by the last fault may still be starting
        if settled != healthy:
            self.rows_notes.append(f"not counted as healthy (not ready in a group yet): {', '.join(sorted(set(healthy) - set(settled)))}")
            healthy = settled
        self.log(f"[{self.scenario.key}] {fault.label} on {', '.join(faulty)}")
        t0 = time.monotonic()
        self.apply(fault, faulty)
        if fault.kind in ("kill_main", "kill_tree"):
            time.sleep(5.0)
            row.orphans = len(sw.survivors(faulty[0]))
            time.sleep(max(0.0, fault.hold_s - 5.0))
        elif fault.kind == "cut_boot":
            time.sleep(1.0)
            row.newcomer_s = self.newcomer(t0 + fault.hold_s)
            time.sleep(max(0.0, t0 + fault.hold_s - time.monotonic()))
        else:
            time.sleep(fault.hold_s)
        if "n1" in sw.peers:  # the newcomer of the cut leaves: the healed swarm is the 4 trainers again
            sw.stop("n1")
        t1 = time.monotonic()
        self.undo(fault, faulty)
        restarted = t1
        time.sleep(fault.settle_s)
        if fault.kind == "cut_boot":  # a newcomer that only knows the healed bootstrap
            row.newcomer_after_s = self.newcomer_through_bootstrap()
        t2 = time.monotonic()
        self.measure(row, fault, faulty, healthy, ref, t0, t1, t2, restarted)
        if "n2" in sw.peers and sw.peers["n2"].proc.poll() is None:  # the short row goes on with its 4 trainers
            sw.stop("n2")
            time.sleep(5.0)
        row.notes += self.rows_notes
        self.rows_notes = []
        return row

    def settled(self, name: str) -> bool:
        """`name` answered ready, in a round of ≥ 2, at one of its last 5 polls."""
        return any(s.ok and s.ready and s.group >= 2 for s in self.swarm.peers[name].samples[-5:])

    def roles(self, fault: Fault) -> tuple[list[str], list[str]]:
        trainers = self.trainers
        if fault.kind == "cut_boot":
            return ["boot"], trainers
        if fault.kind == "split":
            return trainers[2:], trainers[:2]
        victim = {"kill_tree": trainers[-2]}.get(fault.kind, trainers[fault.victim])
        if self.scenario.victim_leads:
            victim = min(trainers, key=lambda name: self.swarm.identity(name)[1])
        return [victim], [t for t in trainers if t != victim]

    def apply(self, fault: Fault, faulty: list[str]) -> None:
        sw, lab = self.swarm, self.swarm.lab
        kind = fault.kind
        if kind in ("cut", "cut_boot"):
            lab.cut(faulty[0])
        elif kind == "split":
            lab.split(faulty, [n for n in lab.hosts if n not in faulty])
        elif kind == "loss":
            lab.loss(faulty[0], fault.amount)
        elif kind == "cap":
            lab.cap(faulty[0], fault.amount)
        elif kind == "stop":
            sw.signal_tree(faulty[0], signal.SIGSTOP)
        elif kind == "kill_main":
            sw.signal_main(faulty[0], signal.SIGKILL)
        elif kind == "kill_tree":
            sw.signal_tree(faulty[0], signal.SIGKILL)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def undo(self, fault: Fault, faulty: list[str]) -> None:
        sw = self.swarm
        if fault.kind == "stop":
            sw.signal_tree(faulty[0], signal.SIGCONT)
        elif fault.kind in ("kill_main", "kill_tree"):
            sw.peers[faulty[0]].proc.wait()
            sw.restart(faulty[0])  # whatever survived the kill still runs, as on a volunteer's machine
        else:
            sw.lab.clear()
            self.delay_every_host()  # (clear takes the row's delay away with the fault)

    def newcomer(self, until: float) -> Optional[float]:
        """(b) A trainer that knows the (cut-off) bootstrap and trainer t1 joins: seconds until it is in a group of ≥ 2."""
        sw = self.swarm
        _, t1_id = sw.identity("t1")
        peer = sw.start_trainer("n1", [sw.boot_maddr, sw.maddr("t1", t1_id)])
        began = peer.started_at
        while time.monotonic() < until:
            last = peer.last()
            if last is not None and last.group >= 2:
                return round(last.t - began, 1)
            time.sleep(0.5)
        last = peer.last()
        state = f"exited {peer.proc.returncode}" if peer.proc.poll() is not None else "running"
        self.rows_notes.append(
            f"newcomer through a trainer: {state}, {sum(s.ok for s in peer.samples)} of {len(peer.samples)} polls "
            f"answered, last group {last.group if last else None}: {last_error(peer.log)}"
        )
        return None

    def newcomer_through_bootstrap(self) -> Optional[float]:
        """(b) After healing: a trainer that knows only the bootstrap; seconds until it is in the full group."""
        sw = self.swarm
        expected = len(self.trainers) + 1
        peer = sw.start_trainer("n2", [sw.boot_maddr])
        deadline = peer.started_at + 60
        while time.monotonic() < deadline:
            last = peer.last()
            if last is not None and last.group >= expected:
                return round(last.t - peer.started_at, 1)
            if peer.proc.poll() is not None:
                break
            time.sleep(0.5)
        last = peer.last()
        self.rows_notes.append(
            f"newcomer through the bootstrap: {'exited ' + str(peer.proc.returncode) if peer.proc.poll() is not None else 'running'}, "
            f"last group {last.group if last else None}: {last_error(peer.log)}"
        )
        return None

    def measure(self, row: Row, fault: Fault, faulty: list[str], healthy: list[str], ref, t0, t1, t2, restarted) -> None:
        sw, attr = self.swarm, self.throughput_attr
        peers = {n: sw.peers[n].samples for n in sw.peers}
        row.stall_s = round(max(longest_stall(peers[n], t0, t2) for n in healthy), 1)
        trainers_faulty = [n for n in faulty if sw.peers[n].role == "trainer"]
        if trainers_faulty:
            row.faulty_stall_s = round(max(longest_stall(peers[n], t0, t1) for n in trainers_faulty), 1)
        row.rounds_during = min(delta(peers[n], t0, t1, "rounds_done") for n in healthy)
        row.rounds_failed = sum(delta(peers[n], t0, t2, "rounds_failed") for n in healthy)
        before = sum(rate(peers[n], ref[0], ref[1], attr) for n in healthy)
        during = sum(rate(peers[n], t0, t1, attr) for n in healthy)
        row.throughput = round(during / before, 2) if before > 0 else None
        if fault.kind not in ("kill_main", "kill_tree", "stop"):
            polls = [s for n in faulty for s in peers[n] if s.ok and t0 + GRACE_S <= s.t <= t1]
            row.ready_while_faulty = f"{sum(s.ready for s in polls)}/{len(polls)}"
        watched = faulty if fault.kind not in ("kill_main", "kill_tree") else []
        firsts = [next((s.t for s in peers[n] if s.ok and s.t > t1 and s.ready), None) for n in watched]
        if watched:
            row.ready_after_s = None if None in firsts else round(max(firsts) - t1, 1)
        if fault.kind in ("kill_main", "kill_tree"):
            victim = sw.peers[faulty[0]]
            n = self.full_group or len(self.trainers)
            done = next((s.t for s in victim.samples if s.ok and s.t > restarted and s.ready and s.group >= n), None)
            row.restart_ready_s = None if done is None else round(done - restarted, 1)
            if victim.proc.poll() is not None:
                row.notes.append(f"{faulty[0]} restart exited {victim.proc.returncode}: {last_error(victim.log)}")
        together = self.one_swarm_at(t1, t2)
        row.one_swarm_s = None if together is None else round(together - t1, 1)
        since = time.time() - (time.monotonic() - (together or t1))  # checkpoints written since, wall clock
        common, apart = sw.same_model(self.core, since)
        row.same_model = f"{len(common) - len(apart)}/{len(common)}"
        row.same_at_ends = bool(common) and common[0] not in apart and common[-1] not in apart
        if apart:  # which steps, and whether rounds were partial there, say what kept the members apart
            partial = sum(delta(peers[n], together or t1, t2, "rounds_partial") for n in self.core)
            row.notes.append(f"models apart at checkpoint steps {checkpoint_spans(apart)} of {common[0]}–{common[-1]}; "
                             f"partial rounds in the window: {partial}")  # fmt: skip

    def one_swarm_at(self, t1: float, t2: float) -> Optional[float]:
        """First poll time after `t1` at which every live trainer's last round had all of them and the bootstrap saw them all."""
        sw = self.swarm
        names = self.core
        boot = sw.peers["boot"].samples
        for s in (s for s in boot if s.ok and t1 < s.t <= t2):
            if s.peers_seen < len(names):
                continue
            lasts = [value_at(sw.peers[n].samples, s.t, "group") for n in names]
            if all(g is not None and g >= (self.full_group or len(names)) for g in lasts):
                return s.t
        return None


def checkpoint_spans(steps: list[int], every: int = 10) -> str:
    """"120–150, 300" for checkpoint steps 120, 130, 140, 150, 300."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step - runs[-1][-1] <= every:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def last_error(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "error" in ln.lower()] if log.exists() else []
    return lines[-1][:200] if lines else "(no error line in its log)"


# ---- acceptance ----------------------------------------------------------------------------


def _ready_none(text: Optional[str]) -> bool:
    return text is not None and text.split("/")[0] == "0" and text.split("/")[1] != "0"


CHECKS: dict[str, tuple[str, Callable[[Row], bool]]] = {
    "stall": (f"healthy peers' longest stall ≤ {MAX_STALL_S:g} s", lambda r: r.stall_s is not None and r.stall_s <= MAX_STALL_S),
    "rounds": ("rounds keep completing during the fault", lambda r: (r.rounds_during or 0) > 0),
    "rounds_5": ("rounds keep completing at 5 % loss", lambda r: not r.fault.startswith("loss 5 ") or (r.rounds_during or 0) > 0),
    "not_ready": ("/readyz 503 while cut off (after the grace)", lambda r: _ready_none(r.ready_while_faulty)),
    "ready_after": (f"ready within {REJOIN_S:g} s of healing", lambda r: r.ready_after_s is not None and r.ready_after_s <= REJOIN_S),
    "one_swarm": (
        f"one swarm within {REJOIN_S:g} s of healing, same model at the first common checkpoint after and at the last",
        lambda r: r.one_swarm_s is not None and r.one_swarm_s <= REJOIN_S and bool(r.same_at_ends),
    ),
    "newcomer": (
        "newcomers join during the cut (through a trainer) and after it (through the bootstrap)",
        lambda r: r.newcomer_s is not None and r.newcomer_after_s is not None,
    ),
    "orphans": ("no process of a SIGKILLed trainer 5 s later", lambda r: r.orphans == 0),
    "restart": (f"a restarted trainer is ready within {REJOIN_S:g} s", lambda r: r.restart_ready_s is not None and r.restart_ready_s <= REJOIN_S),
    "throughput": (
        f"the others keep ≥ {MIN_THROUGHPUT:.0%} of their throughput",
        lambda r: r.throughput is not None and r.throughput >= MIN_THROUGHPUT,
    ),
    "checkpoints": ("20 kills, 0 corrupt or missing checkpoints", lambda r: r.kills == 20 and r.corrupt == 0 and r.missing == 0),
}  # fmt: skip


def failed_checks(scenario: Scenario, rows: list[Row], checks: Optional[tuple[str, ...]] = None) -> list[str]:
    """The checks (default: all of the row's) that some row fails, one line each."""
    names = scenario.checks if checks is None else checks
    return [
        f"({r.scenario}) {r.fault}: {CHECKS[c][0]}"
        for c in names for r in rows if c in scenario.checks_of(r) and not CHECKS[c][1](r)
    ]  # fmt: skip


# Checks whose numbers a loaded machine can push over their bound (seconds, rates). Orphans, readiness
# while cut off and the checkpoints are not among them: those do not depend on how fast anything ran.
LOAD_BOUND = frozenset({"stall", "rounds", "rounds_5", "ready_after", "one_swarm", "newcomer", "restart", "throughput"})


def only_load_bound(scenario: Scenario, rows: list[Row], checks: tuple[str, ...]) -> bool:
    """Every failing check is one a loaded machine can fail (see LOAD_BOUND)."""
    return all(c in LOAD_BOUND for c in checks if failed_checks(scenario, rows, (c,)))


def run_scenario(scenario: Scenario, workdir: Path, log: Callable[[str], None] = print) -> list[Row]:
    workdir.mkdir(parents=True, exist_ok=True)
    if scenario.key == "g":
        from tests.faults.fault_checkpoints import run_checkpoint_kills

        return run_checkpoint_kills(workdir, log=log)
    return Runner(scenario, workdir, log).run()


COLUMNS = (
    "scenario", "fault", "stall_s", "faulty_stall_s", "rounds_during", "rounds_failed", "throughput", "ready_while_faulty",
    "ready_after_s", "one_swarm_s", "same_model", "accuracy", "orphans", "restart_ready_s", "newcomer_s", "newcomer_after_s",
    "kills", "kills_mid_write", "corrupt", "missing",
)  # fmt: skip


ALWAYS = {"scenario", "fault", "stall_s", "rounds_during", "rounds_failed", "throughput", "one_swarm_s", "same_model", "accuracy"}


def format_rows(rows: list[Row]) -> str:
    """A markdown table of the columns any row filled (— where not applicable)."""
    data = [asdict(r) for r in rows]
    cols = [c for c in COLUMNS if c in ALWAYS or any(d[c] is not None for d in data)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for d in data:
        lines.append("| " + " | ".join("—" if d[c] is None else str(d[c]) for c in cols) + " |")
    notes = [f"- ({d['scenario']}) {n}" for d in data for n in d["notes"]]
    return "\n".join(lines + notes)


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
