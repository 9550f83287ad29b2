"""What a peer trains: a `Task` bundles model, data, loss and evaluation.

Every minibatch is a pure function of (swarm seed, peer ID, step), and every initial
model a pure function of the seed, so any third peer can recompute another peer's
gradient bit-identically (same hardware, same library versions) to verify it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phalanx.tasks.metric import ACCURACY, Metric

# Inputs of a batch before `preprocess`, and the CPU generator the batch was drawn with.
Augment = Callable[[Tensor, torch.Generator], Tensor]


def batch_generator(seed: int, peer_id: str, step: int) -> torch.Generator:
    """A CPU generator seeded from SHA-256 of (seed, peer ID, step): independent streams per peer and step."""
    digest = hashlib.sha256(f"phalanx-batch\0{seed}\0{peer_id}\0{step}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))
    return generator


@dataclass(kw_only=True, eq=False)
class Task:
    """A model architecture, a train/test split held as tensors, a loss and an evaluation.

    Inputs are stored compactly (e.g. uint8 images) and turned into model inputs per
    batch by `preprocess`; `augment` (optional) randomizes raw training inputs with the
    batch's own generator, so augmentation is as reproducible as the batch indices.
    Subclass and override `loss`/`evaluate` for tasks that are not classification.
    """

    name: str
    """Registry name (or import path) peers exchange; identical tasks must share it."""
    model_fn: Callable[[], nn.Module]
    """Builds a fresh model; it may use torch's global RNG, which `build_model` seeds and restores."""
    train_inputs: Tensor = field(repr=False)
    """Shape (N, ...): raw training inputs."""
    train_targets: Tensor = field(repr=False)
    """Shape (N,): int64 class labels."""
    test_inputs: Tensor = field(repr=False)
    """Shape (M, ...): raw held-out inputs, same layout as train_inputs."""
    test_targets: Tensor = field(repr=False)
    """Shape (M,): int64 class labels."""
    preprocess: Callable[[Tensor], Tensor] | None = None
    """Raw inputs → model inputs (e.g. uint8 → normalized float); runs on the task's device."""
    augment: Augment | None = None
    """Raw training inputs + batch generator → augmented raw inputs; never used for evaluation."""
    lr: float = 0.1
    """Recommended SGD learning rate for this task."""
    momentum: float = 0.9
    """Recommended SGD momentum."""
    weight_decay: float = 0.0
    """Recommended L2 weight decay."""
    batch_size: int = 32
    """Recommended per-peer minibatch size (samples)."""
    eval_batch_size: int = 2048
    """Samples per forward pass in `evaluate` (bounded memory, few launches)."""
    metric: Metric = ACCURACY
    """What `evaluate()`'s result is judged by (VALIDATION_LOSS for language models): reports show it and
    a run's target is in it."""
    default_target: Optional[float] = None
    """The metric's value `phalanx swarm` stops at when given no target; None: it runs its --steps."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the data tensors live; set by `to`."""

    def to(self, device: torch.device | str) -> Task:
        """Move the data to `device` once, so batches are gathered there without host copies; returns self."""
        device = torch.device(device)
        self.train_inputs = self.train_inputs.to(device)
        self.train_targets = self.train_targets.to(device)
        self.test_inputs = self.test_inputs.to(device)
        self.test_targets = self.test_targets.to(device)
        self.device = device
        return self

    def build_model(self, seed: int = 0) -> nn.Module:
        """The initial model for `seed`, on the task's device; identical on every peer with the same seed.

        Seeds torch's CPU RNG only inside `fork_rng`, so the caller's RNG state is untouched.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.model_fn()  # built on CPU: the CPU RNG alone decides the initial values
        return model.to(self.device)

    def make_optimizer(
        self,
        params: Iterable[Tensor],
        lr: float | None = None,
        momentum: float | None = None,
        weight_decay: float | None = None,
    ) -> torch.optim.Optimizer:
        """SGD with momentum; arguments left as None take the task's recommended values."""
        return torch.optim.SGD(
            params,
            lr=self.lr if lr is None else lr,
            momentum=self.momentum if momentum is None else momentum,
            weight_decay=self.weight_decay if weight_decay is None else weight_decay,
        )

    def lr_factor(self, step: int) -> float:
        """The learning rate at `step` as a multiple of the optimizer's (a schedule; constant here)."""
        return 1.0

    def batch(self, seed: int, peer_id: str, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """The minibatch of `peer_id` at `step`: indices sampled with replacement from the training split."""
        generator = batch_generator(seed, peer_id, step)
        # Indices are drawn on the CPU generator so every device sees the same batch; only B ints cross.
        index = torch.randint(len(self.train_targets), (batch_size,), generator=generator).to(self.device)
        inputs = self.train_inputs[index]  # (B, ...) raw
        if self.augment is not None:
            inputs = self.augment(inputs, generator)
        return self._prepare(inputs), self.train_targets[index]

    def loss(self, model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the model's logits (B, classes) against targets (B,)."""
        return F.cross_entropy(model(inputs), targets)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device | str | None = None) -> dict[str, float]:
        """Accuracy and mean cross-entropy on the whole test split; the model's train/eval mode is restored."""
        device = self.device if device is None else torch.device(device)
        was_training = model.training
        model.eval()
        try:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            correct = torch.zeros((), dtype=torch.int64, device=device)
            for start in range(0, len(self.test_targets), self.eval_batch_size):
                inputs = self.test_inputs[start : start + self.eval_batch_size].to(device)
                targets = self.test_targets[start : start + self.eval_batch_size].to(device)
                logits = model(self._prepare(inputs))  # (b, classes)
                loss_sum += F.cross_entropy(logits, targets, reduction="sum").double()
                correct += (logits.argmax(dim=1) == targets).sum()
        finally:
            model.train(was_training)
        count = max(len(self.test_targets), 1)
        # The only host syncs of the evaluation: two scalars at the end.
        return {"accuracy": correct.item() / count, "loss": loss_sum.item() / count}

    def _prepare(self, inputs: Tensor) -> Tensor:
        return inputs if self.preprocess is None else self.preprocess(inputs)


def compute_gradient(
    task: Task, model: nn.Module, seed: int, peer_id: str, step: int, batch_size: int
) -> tuple[float, Tensor]:
    """Loss and flat gradient (shape (P,), P = number of parameters) on `peer_id`'s batch at `step`.

    Zeroes the model's gradients first. BatchNorm running statistics are updated as in
    any training forward pass, so a verifier should recompute on a copy of the model.
    On CUDA, bit-identical recomputation also needs deterministic kernels, a process-wide
    choice: `torch.use_deterministic_algorithms(True)` and `torch.backends.cudnn.benchmark = False`.
    """
    model.zero_grad(set_to_none=True)
    inputs, targets = task.batch(seed, peer_id, step, batch_size)
    loss = task.loss(model, inputs, targets)
    loss.backward()
    # Parameters the loss never reached have no .grad; they count as zeros so the layout matches flat_params.
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    grad_flat = torch.nn.utils.parameters_to_vector(grads)
    return loss.item(), grad_flat  # .item() is a host sync: one per step


def flat_params(model: nn.Module) -> Tensor:
    """A detached copy of all parameters as one vector (P,), in `model.parameters()` order."""
    with torch.no_grad():
        return torch.nn.utils.parameters_to_vector(model.parameters())


def set_flat_params(model: nn.Module, vec: Tensor) -> None:
    """Copy `vec` (P,) into the parameters in place.

    Unlike torch's `vector_to_parameters`, which re-points each `param.data` at a view
    of `vec` (so later writes to `vec` would silently change the model), this copies.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if vec.dim() != 1 or vec.numel() != total:
        raise ValueError(f"set_flat_params needs a vector of {total} values, got shape {tuple(vec.shape)}")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(vec[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
