"""`tiny-gpt`: a GPT-style byte-level decoder trained with AdamW (linear warm-up, cosine decay).

The default corpus is the source of this Python's standard library (top-level modules), which every
machine has: files whose name hashes to 0 mod 10 are validation, the rest training. `--data-file`
trains on a text file of your own instead (its last tenth, cut at a line break, is validation).
Peers must train on the same bytes: with the default corpus, run the same Python minor version.

The model scales by task options (`--task-options dim=768,layers=14,heads=12,context=256` is about
100M parameters); the defaults (≈0.8M) train on a CPU.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phalanx.errors import ConfigError
from phalanx.tasks.base import Task, batch_generator
from phalanx.tasks.metric import VALIDATION_LOSS, Metric, perplexity

VOCAB = 256  # bytes


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm decoder blocks, and a head tied to the token embedding."""

    def __init__(self, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, dim), nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor) -> Tensor:  # (B, T) int64 -> (B, T, VOCAB) logits
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        return self.ln(x) @ self.tokens.weight.T


@dataclass(kw_only=True, eq=False)
class TextTask(Task):
    """Next-byte prediction on a corpus held as two uint8 tensors (train_inputs, test_inputs)."""

    context: int = 128
    """Bytes per training window."""
    eval_windows: int = 64
    """Validation windows (consecutive, non-overlapping) an evaluation averages over."""
    warmup_steps: int = 100
    """Steps of linear learning-rate warm-up from 0."""
    decay_steps: int = 5000
    """Steps of cosine decay after the warm-up, down to a tenth of the learning rate."""
    metric: Metric = VALIDATION_LOSS
    """A language model is judged by its validation loss per byte (its next-byte accuracy says little);
    no default target: what loss a corpus and a model size reach is the run's own question."""

    def batch(self, seed: int, peer_id: str, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), both (B, context) int64: random windows and the same shifted by one byte."""
        generator = batch_generator(seed, peer_id, step)
        starts = torch.randint(len(self.train_inputs) - self.context - 1, (batch_size, 1), generator=generator)
        windows = self.train_inputs[(starts + torch.arange(self.context + 1)).to(self.device)].long()
        return windows[:, :-1], windows[:, 1:]

    def loss(self, model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device | str | None = None) -> dict[str, float]:
        """Mean validation loss per byte, its perplexity, and next-byte accuracy."""
        device = self.device if device is None else torch.device(device)
        count = min(self.eval_windows, (len(self.test_inputs) - 1) // self.context)
        starts = torch.arange(count).unsqueeze(1) * self.context
        was_training = model.training
        model.eval()
        try:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            correct = torch.zeros((), dtype=torch.int64, device=device)
            for chunk in starts.split(32):
                windows = (
                    self.test_inputs[(chunk + torch.arange(self.context + 1)).to(self.test_inputs.device)]
                    .to(device)
                    .long()
                )
                logits = model(windows[:, :-1]).flatten(0, 1)
                targets = windows[:, 1:].flatten()
                loss_sum += F.cross_entropy(logits, targets, reduction="sum").double()
                correct += (logits.argmax(dim=1) == targets).sum()
        finally:
            model.train(was_training)
        tokens = max(count * self.context, 1)
        loss = loss_sum.item() / tokens
        return {"accuracy": correct.item() / tokens, "loss": loss, "perplexity": perplexity(loss)}

    def make_optimizer(self, params, lr=None, momentum=None, weight_decay=None) -> torch.optim.Optimizer:
        """AdamW (β = 0.9, 0.95); --momentum is SGD's and does not apply."""
        return torch.optim.AdamW(
            params, lr=self.lr if lr is None else lr, betas=(0.9, 0.95),
            weight_decay=self.weight_decay if weight_decay is None else weight_decay,
        )  # fmt: skip

    def lr_factor(self, step: int) -> float:
        """Linear warm-up over warmup_steps, then cosine decay to 0.1 over decay_steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(self.decay_steps, 1))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def stdlib_corpus() -> tuple[bytes, bytes]:
    """(train, validation) bytes: this Python's top-level standard-library modules, split by file name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid = [], []
    for path in sorted(root.glob("*.py")):
        (valid if hashlib.sha256(path.name.encode()).digest()[0] % 10 == 0 else train).append(path.read_bytes())
    return b"\n".join(train), b"\n".join(valid)


def file_corpus(path: Path) -> tuple[bytes, bytes]:
    """(train, validation) bytes of a text file: its last tenth, from a line break on, is validation."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--data-file {path}: cannot read it ({e.strerror}); give a text file") from None
    cut = data.find(b"\n", int(len(data) * 0.9))
    cut = int(len(data) * 0.9) if cut < 0 else cut + 1
    return data[:cut], data[cut:]


def tiny_gpt(
    data_file: Optional[Path] = None, dim: int = 128, layers: int = 4, heads: int = 4, context: int = 128
) -> TextTask:
    """The task; `data_file` None trains on the standard library's source."""
    if dim % heads:
        raise ConfigError(f"--task-options dim={dim} must be a multiple of heads={heads}")
    train, valid = stdlib_corpus() if data_file is None else file_corpus(Path(data_file))
    for name, part in (("training", train), ("validation", valid)):
        if len(part) < 2 * context + 2:
            raise ConfigError(
                f"--data-file: its {name} part has {len(part)} bytes, fewer than two windows of "
                f"{context + 1}; give a longer text (or a smaller --task-options context=)"
            )
    return TextTask(
        name="tiny-gpt",
        model_fn=lambda: TinyGPT(dim, layers, heads, context),
        train_inputs=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        train_targets=torch.empty(0, dtype=torch.int64),
        test_inputs=torch.frombuffer(bytearray(valid), dtype=torch.uint8),
        test_targets=torch.empty(0, dtype=torch.int64),
        context=context,
        lr=3e-3,
        weight_decay=0.1,
        batch_size=16,
    )
