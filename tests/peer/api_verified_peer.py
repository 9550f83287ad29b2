"""A user's script on `phalanx.Optimizer(verify=True)`: digits, AdamW, CenteredClip, public batches.

    api_verified_peer.py OUT_JSON --initial-peers … --peers N [--cheat] [--mode diloco --inner-steps H]

A cheater flips and scales its gradient after backward(); the validators' recomputation of its
public batch (diloco: their replay of its H inner steps) gives another one, so the swarm bans it.
Exit 0 after --global-steps (diloco: outer steps), 3 when banned.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx
from phalanx.errors import PhalanxError
from phalanx.tasks import batch_generator
from tests.peer.trainer_procs import load_example  # run by its path: start_script puts the repository on PYTHONPATH

plain_loop = load_example("plain_loop")

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--initial-peers", nargs="+", required=True)
parser.add_argument("--peers", type=int, required=True)
parser.add_argument("--global-steps", type=int, default=40)
parser.add_argument("--cheat", action="store_true")
parser.add_argument("--mode", default="sync", choices=("sync", "diloco"))
parser.add_argument("--inner-steps", type=int, default=4)
args = parser.parse_args()

train, valid = plain_loop.digits()


def batch_fn(seed: int, peer_id: str, step: int):
    index = torch.randint(len(train[1]), (16,), generator=batch_generator(seed, peer_id, step))
    return train[0][index], train[1][index]


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


model = plain_loop.make_model()
diloco = {"inner_steps": args.inner_steps, "outer_lr": 0.7, "outer_momentum": 0.5} if args.mode == "diloco" else {}
opt = phalanx.Optimizer(
    torch.optim.AdamW(model.parameters(), lr=3e-3), run_id=f"api-verified-{args.mode}", mode=args.mode, **diloco,
    initial_peers=args.initial_peers,
    host_maddrs=["/ip4/127.0.0.1/tcp/0"], batch_size_per_step=16, wait_for_peers=args.peers,
    verify=True, model=model, batch_fn=batch_fn, loss_fn=loss_fn, aggregator="centered_clip", tau=1.0,
    validators=2, phase_timeout_s=3.0,
)  # fmt: skip
code = 0
with opt:
    try:
        while opt.global_step < args.global_steps:
            loss_fn(model, opt.public_batch()).backward()
            if args.cheat:
                for p in model.parameters():
                    p.grad.mul_(-3.0)
            opt.step()
            opt.zero_grad()
    except PhalanxError as e:
        print(f"stopped: {e}", flush=True)
        code = 3
    stats = opt.statistics()
    result = {
        **dataclasses.asdict(stats),
        "peer_id": opt.node.peer_id,
        "validation_loss": plain_loop.validation_loss(model, valid),
    }
    result["params"] = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()
args.out.write_text(json.dumps(result))
sys.exit(code)
