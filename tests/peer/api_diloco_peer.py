"""A user's script on `phalanx.Optimizer(mode="diloco")` (examples/plain_loop.py's model and data):
plain SGD inside, the outer Nesterov step across the swarm; writes its final θ and outer momentum.

    api_diloco_peer.py OUT_JSON --initial-peers … --rank R --peers N --outer-steps T
        [--inner-steps H] [--outer-lr η] [--outer-momentum μ] [--lr γ] [--overlap on|off]
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx
from tests.peer.trainer_procs import load_example  # run by its path: start_script puts the repository on PYTHONPATH

plain_loop = load_example("plain_loop")

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--initial-peers", nargs="+", required=True)
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--peers", type=int, required=True)
parser.add_argument("--outer-steps", type=int, required=True)
parser.add_argument("--inner-steps", type=int, default=1)
parser.add_argument("--outer-lr", type=float, default=1.0)
parser.add_argument("--outer-momentum", type=float, default=0.0)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--overlap", choices=["on", "off"], default="off")
args = parser.parse_args()

train, valid = plain_loop.digits()
model = plain_loop.make_model()
opt = phalanx.Optimizer(
    torch.optim.SGD(model.parameters(), lr=args.lr), run_id="api-diloco", initial_peers=args.initial_peers,
    host_maddrs=["/ip4/127.0.0.1/tcp/0"], batch_size_per_step=args.batch_size, wait_for_peers=args.peers,
    mode="diloco", inner_steps=args.inner_steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
    overlap=args.overlap,
)  # fmt: skip
with opt:
    step = 0
    while opt.global_step < args.outer_steps:
        inputs, labels = plain_loop.batch(train, args.rank, step, args.batch_size)
        F.cross_entropy(model(inputs), labels).backward()
        opt.step()
        opt.zero_grad()
        step += 1
    params = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()  # x, before a checkpoint lands a round
    state = opt.state_dict()
    result = {
        **dataclasses.asdict(opt.statistics()),
        "local_steps": step,
        "validation_loss": plain_loop.validation_loss(model, valid),
    }
    result["params"] = params
    result["outer_momentum"] = state["outer_momentum"].tolist()
    result["outer_anchor"] = state["outer_anchor"].tolist()
args.out.write_text(json.dumps(result))
