"""A user's script on `phalanx.Optimizer` (examples/plain_loop.py's model and data) that saves its
parameters and AdamW state at every global step, for the newcomer test.

    api_peer.py NAME OUT_DIR --initial-peers … [--newcomer] [--peers N] [--rank R]

A peer trains until OUT_DIR/stop exists; a newcomer calls load_state_from_peers(), saves what it
got as NAME-loaded-STEP.pt, trains 3 more global steps and exits.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx
from tests.peer.trainer_procs import load_example  # run by its path: start_script puts the repository on PYTHONPATH

plain_loop = load_example("plain_loop")

parser = argparse.ArgumentParser()
parser.add_argument("name")
parser.add_argument("out", type=Path)
parser.add_argument("--initial-peers", nargs="+", required=True)
parser.add_argument("--peers", type=int, default=1)
parser.add_argument("--rank", type=int, default=0)
parser.add_argument("--newcomer", action="store_true")
args = parser.parse_args()

train, _ = plain_loop.digits()
model = plain_loop.make_model(seed=args.rank if args.newcomer else 0)  # a newcomer starts elsewhere
inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
opt = phalanx.Optimizer(
    inner, run_id="api-newcomer", initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    batch_size_per_step=8, target_batch_size=48, wait_for_peers=args.peers,
)  # fmt: skip


def save(tag: str) -> None:
    state = {"params": [p.detach().clone() for p in model.parameters()], "optimizer": inner.state_dict()}
    torch.save(state, args.out / f"{args.name}-{tag}{opt.global_step}.pt")


with opt:
    if args.newcomer:
        if not opt.load_state_from_peers():
            sys.exit("no peer handed over its state")
        save("loaded-")
        until = opt.global_step + 3
    step, saved = 0, -1
    while not (args.out / "stop").exists() and not (args.newcomer and opt.global_step >= until):
        inputs, labels = plain_loop.batch(train, args.rank, step, 8)
        F.cross_entropy(model(inputs), labels).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if opt.global_step != saved:
            saved = opt.global_step
            save("")
