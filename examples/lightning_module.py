"""PyTorch Lightning on a Phalanx swarm: return `phalanx.Optimizer` from `configure_optimizers`.

Needs `pip install phalanx[lightning]`. Start a bootstrap (`phalanx bootstrap`), then on each machine:

    python examples/lightning_module.py --initial-peers /ip4/…/p2p/… --rank 0 --peers 2
    python examples/lightning_module.py --initial-peers /ip4/…/p2p/… --rank 1 --peers 2

Lightning calls `step(closure)`; the closure runs the forward and backward pass, then the
swarm averages the gradient. Digits from scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import phalanx


class Classifier(L.LightningModule):
    def __init__(self, swarm: dict) -> None:
        super().__init__()
        torch.manual_seed(0)  # every peer builds the same initial model
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        self.swarm = swarm
        self.opt = None

    def training_step(self, batch, _):
        inputs, labels = batch
        return F.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        self.opt = phalanx.Optimizer(torch.optim.AdamW(self.net.parameters(), lr=3e-3), **self.swarm)
        return self.opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="write the final parameters and statistics here (JSON)")
    args = parser.parse_args()

    x, y = load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(
        torch.tensor(x / 16.0, dtype=torch.float32)[args.rank :: args.peers], torch.tensor(y)[args.rank :: args.peers]
    )
    loopback = bool(args.initial_peers) and "/127.0.0.1/" in args.initial_peers[0]
    swarm = {
        "run_id": "lightning", "initial_peers": args.initial_peers, "batch_size_per_step": 16, "wait_for_peers": args.peers,
        "host_maddrs": ["/ip4/127.0.0.1/tcp/0"] if loopback else [],
    }  # fmt: skip
    module = Classifier(swarm)
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
    with module.opt as opt:
        stats = opt.statistics()
        params = torch.nn.utils.parameters_to_vector(module.net.parameters()).tolist()
    print(f"global step {stats.global_step}, {stats.peers_last_round} peers in the last round")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": params, **dataclasses.asdict(stats)}, f)


if __name__ == "__main__":
    main()
