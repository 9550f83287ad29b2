"""A round member that declares 1 GiB for each part it sends (docs/threat-model.md, "Round members").

Before sizes were checked against the codec, every honest reducer allocated the declared size before
reading a byte (400 → 1,427 MB RSS, 145 → 2.2 steps/s) and the attacker was never suspected. Now the
reducer refuses the part at its header: the attacker is kept out of the next groups (unverified) or
banned on the proof it signed (verified), and the honest trainers' memory never sees the gigabyte."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.adversary.live_swarm import open_live_swarm, peak_rss_bytes
from tests.peer.health.health_swarm import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

JOINER = str(Path(__file__).parent / "oversized_joiner.py")
ROUNDS = 30  # rounds every honest trainer completes with the attacker around
GIB = 1 << 30


def _longest_run_with(swarm, trainer, members: int) -> int:
    """The most consecutive steps whose round had `members` members, in `trainer`'s step events."""
    longest = run = 0
    for event in swarm.events(trainer, "step"):
        run = run + 1 if event["group"] == members else 0
        longest = max(longest, run)
    return longest


def _attacked(swarm, *, banned: bool) -> None:
    honest = swarm.trainers
    watched = [swarm.bootstrap, *honest]  # a banned attacker stops by itself
    wait_until(lambda: all(swarm.status(t)["rounds"]["ok"] >= ROUNDS for t in honest), f"{ROUNDS} rounds of each honest trainer", watched)
    for t in honest:
        log = t.stderr.read_text()
        assert "declared 1073741824 bytes for a part" in log, f"{t.name} never refused the attacker's part:\n{t.logs()}"
        # the attacker was in at most 2 rounds in a row: the one it was caught in, and one already forming
        assert _longest_run_with(swarm, t, len(honest) + 1) <= 2, [e["group"] for e in swarm.events(t, "step")]
        assert peak_rss_bytes(t.popen.pid) < GIB, f"{t.name} peaked at {peak_rss_bytes(t.popen.pid) / 2**20:.0f} MiB"
        if banned:
            assert swarm.attacker.peer_id in swarm.status(t)["bans"], f"{t.name} did not ban the attacker"


def test_a_member_declaring_huge_parts_is_refused_and_kept_out(tmp_path):
    with open_live_swarm(tmp_path, trainers=2, args=("--compression", "fp16"), attacker=[JOINER]) as swarm:
        _attacked(swarm, banned=False)


def test_a_member_signing_huge_parts_is_banned_in_verified_rounds(tmp_path):
    verified = ("--compression", "fp16", "--aggregator", "centered_clip", "--tau", "1", "--verify")
    with open_live_swarm(tmp_path, trainers=3, args=verified, attacker=[JOINER], attacker_args=("--attack", "oversized_part")) as swarm:
        _attacked(swarm, banned=True)
