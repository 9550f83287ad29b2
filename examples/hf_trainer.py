"""A Hugging Face `Trainer` on a Phalanx swarm: pass `phalanx.Optimizer` in `optimizers=(opt, scheduler)`.

Needs `pip install phalanx[hf]`. Start a bootstrap (`phalanx bootstrap`), then on each machine:

    python examples/hf_trainer.py --initial-peers /ip4/…/p2p/… --rank 0 --peers 2
    python examples/hf_trainer.py --initial-peers /ip4/…/p2p/… --rank 1 --peers 2

The model is a small GPT-2 built from a config (no weights are downloaded), trained byte by byte on
this Python's standard-library source. Every Trainer step is a global step of the swarm (no
target_batch_size), so the scheduler the Trainer steps follows the swarm's step too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import phalanx
from phalanx.tasks.text import stdlib_corpus

CONTEXT = 64


class Windows(torch.utils.data.Dataset):
    """Byte windows of the corpus; each rank reads its own part."""

    def __init__(self, data: bytes, rank: int, peers: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.starts = torch.arange(rank * CONTEXT, len(self.data) - CONTEXT, CONTEXT * peers)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[self.starts[i] : self.starts[i] + CONTEXT].long()
        return {"input_ids": window, "labels": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="hf-trainer-output")
    parser.add_argument("--out", help="write the final parameters and statistics here (JSON)")
    args = parser.parse_args()

    torch.manual_seed(0)  # every peer builds the same initial model
    config = GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    loopback = bool(args.initial_peers) and "/127.0.0.1/" in args.initial_peers[0]
    opt = phalanx.Optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        run_id="hf-trainer",
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"] if loopback else [],
        batch_size_per_step=8,
        wait_for_peers=args.peers,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=8, max_steps=args.steps, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=10, disable_tqdm=True, seed=args.rank,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Windows(stdlib_corpus()[0], args.rank, args.peers),
        optimizers=(opt, scheduler),
    )
    with opt:
        trainer.train()
        stats = opt.statistics()
    print(f"global step {stats.global_step}, {stats.peers_last_round} peers in the last round")
    if args.out:
        params = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()
        with open(args.out, "w") as f:
            json.dump({"params": params, **dataclasses.asdict(stats)}, f)


if __name__ == "__main__":
    main()
