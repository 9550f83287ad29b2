"""Your own model, data, AdamW and loop on a Phalanx swarm: only the optimizer line changes.

Start a bootstrap (`phalanx bootstrap` prints its address), then on each machine:

    python examples/plain_loop.py --initial-peers /ip4/…/p2p/… --rank 0 --peers 2
    python examples/plain_loop.py --initial-peers /ip4/…/p2p/… --rank 1 --peers 2

Each peer trains on its own batches (drawn from its rank); every global step averages the
gradients of `--target-batch-size` samples across the swarm, as one process with that batch would.
With `--mode lasgd` (or `gossip`) local steps never wait: every `--sync-every` steps the peers'
progress is averaged in the background, and a global step is one such average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import phalanx


def digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, validation) splits of scikit-learn's bundled 8×8 digits: inputs (N, 64) in [0, 1], labels (N,)."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # every peer starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batch(train, rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer `rank`'s minibatch of its local step `step`."""
    index = torch.randint(len(train[1]), (size,), generator=torch.Generator().manual_seed(1_000_003 * rank + step))
    return train[0][index], train[1][index]


@torch.no_grad()
def validation_loss(model: torch.nn.Module, valid) -> float:
    return F.cross_entropy(model(valid[0]), valid[1]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs printed by `phalanx bootstrap`")
    parser.add_argument("--rank", type=int, default=0, help="which batches this peer draws")
    parser.add_argument("--peers", type=int, default=1, help="trainers to wait for before the first step")
    parser.add_argument("--global-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per local step")
    parser.add_argument("--target-batch-size", type=int, default=48, help="samples per global step, swarm-wide")
    parser.add_argument("--mode", choices=("sync", "lasgd", "gossip"), default="sync")
    parser.add_argument("--sync-every", type=int, default=5, help="lasgd/gossip: local steps between exchanges")
    parser.add_argument("--run-id", default="plain-loop")
    parser.add_argument("--out", help="write the final validation loss and statistics here (JSON)")
    args = parser.parse_args()

    train, valid = digits()
    model = make_model()
    opt = phalanx.Optimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
        run_id=args.run_id,
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"] if args.initial_peers and "/127.0.0.1/" in args.initial_peers[0] else [],
        batch_size_per_step=args.batch_size,
        wait_for_peers=args.peers,
        **(
            {"target_batch_size": args.target_batch_size}
            if args.mode == "sync"
            else {"mode": args.mode, "sync_every": args.sync_every}
        ),
    )
    with opt:
        step = 0
        while opt.global_step < args.global_steps:
            inputs, labels = batch(train, args.rank, step, args.batch_size)
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
        stats = opt.statistics()
        result = {"validation_loss": validation_loss(model, valid), "local_steps": step, **dataclasses.asdict(stats)}
        result["params"] = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()
    print(f"global step {stats.global_step}: validation loss {result['validation_loss']:.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
