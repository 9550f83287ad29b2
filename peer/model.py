"""The model a peer trains, on the device it asked for: what every training mode reads and writes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Optional

import torch

from phalanx.errors import ConfigError
from phalanx.peer.plan import TrainingConfig
from phalanx.tasks import Task


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: this machine has no CUDA GPU visible to torch; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


SKETCH_SIZE, SKETCH_SEED, SKETCH_CHUNK = 1024, 0x5E7C, 1 << 20


class Trainable:
    """Parameters and the optimizer that steps them, with the conversions the protocol needs (flat
    grads, named state). `module`, when given, adds its buffers (BatchNorm statistics) to the state."""

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        module: Optional[torch.nn.Module] = None,
        lr_factor: Optional[Callable[[int], float]] = None,
    ) -> None:
        self.module, self.optimizer, self.lr_factor = module, optimizer, lr_factor
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self._scaled = False  # the last step's learning rate was scaled (lr_scale): the next one sets it again
        self.params = [p for p in params if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        materialize_optimizer_state(optimizer, self.params)

    def apply(self, aggregate: torch.Tensor, step: int, lr_scale: float = 1.0) -> None:
        """Use the group's aggregate (numel,) as the gradient of `step` (the step it leads to the state of,
        counted from 0), at the learning rate the schedule gives that step, times `lr_scale`."""
        if self.lr_factor is not None or lr_scale != 1.0 or self._scaled:
            factor = (1.0 if self.lr_factor is None else self.lr_factor(step)) * lr_scale
            for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * factor
            self._scaled = lr_scale != 1.0
        aggregate = aggregate.to(self.params[0].device, non_blocking=True)
        offset = 0
        for p in self.params:
            p.grad = aggregate[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def flat_params(self) -> torch.Tensor:
        """A CPU float32 copy of the parameters (numel,)."""
        return torch.nn.utils.parameters_to_vector(self.params).detach().to("cpu", torch.float32).clone()

    def load_flat_params(self, vector: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(vector.to(self.params[0].device).clone(), self.params)

    def flat_momentum(self) -> Optional[torch.Tensor]:
        """The optimizer's momentum buffers as one CPU float32 vector (numel,); None without momentum."""
        buffers = [self.optimizer.state[p].get("momentum_buffer") for p in self.params]
        if any(b is None for b in buffers):
            return None
        return torch.cat([b.reshape(-1) for b in buffers]).detach().to("cpu", torch.float32)

    def load_flat_momentum(self, vector: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            buf = self.optimizer.state[p].get("momentum_buffer")
            if buf is not None:
                buf.copy_(vector[offset : offset + p.numel()].view_as(buf))
            offset += p.numel()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Named CPU copies of everything a newcomer needs: parameters, buffers, optimizer state."""
        if self.module is not None:
            tensors = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        else:
            tensors = {f"param.{i}": p.detach().to("cpu", copy=True) for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):
            for key, value in sorted(self.optimizer.state[p].items()):
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{i}.{key}"] = value.detach().to("cpu", copy=True)
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.module is not None:
            model_state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
            self.module.load_state_dict(model_state, strict=True)
        else:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    p.copy_(tensors[f"param.{i}"])
        for i, p in enumerate(self.params):
            for key, value in self.optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    value.copy_(tensors[f"optim.{i}.{key}"])

    def param_sketch(self) -> list[float]:
        """A count sketch of the parameters (the same on every peer): linear, so the mean of peers'
        sketches is the sketch of their mean, and their distances estimate the distances between the
        parameters within a few percent. What `phalanx swarm` measures the peers' spread with."""
        flat = self.flat_params()
        out = torch.zeros(SKETCH_SIZE, dtype=torch.float64)
        generator = torch.Generator().manual_seed(SKETCH_SEED)
        for start in range(0, flat.numel(), SKETCH_CHUNK):
            values = flat[start : start + SKETCH_CHUNK].double()
            buckets = torch.randint(SKETCH_SIZE, (values.numel(),), generator=generator)
            signs = torch.randint(2, (values.numel(),), generator=generator, dtype=torch.float64).mul_(2).sub_(1)
            out.index_add_(0, buckets, values.mul_(signs))
        return out.tolist()

    def param_hash(self) -> str:
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]


class Model(Trainable):
    """A task's model and optimizer, as `phalanx join` trains them."""

    def __init__(self, task: Task, config: TrainingConfig) -> None:
        self.task = task
        module = task.build_model(config.seed)
        optimizer = task.make_optimizer(
            [p for p in module.parameters() if p.requires_grad], config.lr, config.momentum, config.weight_decay
        )
        super().__init__(list(module.parameters()), optimizer, module, task.lr_factor)
        self.module: torch.nn.Module = module


def materialize_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create every optimizer buffer now, so the state layout a newcomer expects is the one a trained
    peer sends: one step on zero gradients at lr 0, then every state tensor zeroed (AdamW's moments
    and step count, SGD's momentum), which is what a fresh optimizer's first step starts from."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    zero_optimizer_state(optimizer)


def zero_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every state tensor to zero, in place: a fresh optimizer's state, in the layout of a used one."""
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
