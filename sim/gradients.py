"""Real gradients for many simulated workers at once: one batched call per group of jobs.

Worker k's minibatch at its step s is the task's own `Task.batch(seed, "sim-k", s, B)`, so
a simulated gradient is exactly the one a live peer with that ID would compute at those
parameters. Engines (same results up to float rounding; tests compare them):

- ``mlp``: an `nn.Sequential` of `Linear` and elementwise activations with the task's
  default cross-entropy loss, run as one batched matmul chain over stacked per-worker
  weights (m, out, in) with autograd; per-row Python overhead is what dominates a tiny model.
- ``vmap``: any model without buffers, via `torch.func.functional_call` + `vmap(grad)`.
- ``loop``: anything (BatchNorm too): `compute_gradient` row by row, the reference.

Weight decay is added to the gradient (g + wd·θ_read), so staleness corrections scale it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phalanx.errors import ConfigError
from phalanx.tasks.base import Task, compute_gradient, flat_params, set_flat_params

ENGINES = ("auto", "mlp", "vmap", "loop")
# Modules the mlp engine applies as they are to (m, B, features): elementwise, no parameters.
_ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity)


def peer_id(worker: int) -> str:
    """The peer ID simulated worker ``worker`` draws its minibatches under."""
    return f"sim-{worker}"


class GradientOracle:
    """Loss and flat gradient of `task` for rows of (parameters, worker, step), computed together.

    ``flip`` rows use flipped labels y → C − 1 − y (the label-flip attack): the same batch,
    honest computation, wrong targets.
    """

    def __init__(self, task: Task, *, seed: int, batch_size: int, engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ConfigError(f"gradient engine {engine!r} is unknown; use one of {', '.join(ENGINES)}")
        self.task = task
        self.seed = seed
        self.batch_size = batch_size
        self.model = task.build_model(seed)
        self.theta0 = flat_params(self.model)  # (d,)
        self.num_classes = int(task.train_targets.max()) + 1
        self.weight_decay = float(task.weight_decay)
        self._layers = _mlp_plan(self.model) if type(task).loss is Task.loss else None
        if engine == "auto":
            engine = "mlp" if self._layers is not None else "vmap" if not list(self.model.buffers()) else "loop"
        elif engine == "mlp" and self._layers is None:
            raise ConfigError(
                f"gradient engine 'mlp' needs an nn.Sequential of Linear and activations with the default loss; "
                f"task {task.name!r} is not one: use vmap or loop"
            )
        self.engine = engine
        self.calls = 0
        self.rows = 0

    @property
    def dim(self) -> int:
        return self.theta0.numel()

    def compute(
        self, params: Tensor, workers: Sequence[int], steps: Sequence[int], flip: Sequence[bool]
    ) -> tuple[Tensor, list[float]]:
        """Gradients (m, d) and losses for m rows; params is (m, d), one parameter vector per row."""
        m = params.shape[0]
        self.calls += 1
        self.rows += m
        if self.engine == "loop":
            grads, losses = self._loop(params, workers, steps, flip)
        else:
            batches = [self._batch(w, s, f) for w, s, f in zip(workers, steps, flip, strict=True)]
            inputs = torch.stack([x for x, _ in batches])  # (m, B, ...)
            targets = torch.stack([y for _, y in batches])  # (m, B)
            fn = self._mlp if self.engine == "mlp" else self._vmap
            grads, loss_t = fn(params, inputs, targets)
            losses = loss_t.tolist()  # one host sync per call
        if self.weight_decay:
            grads = grads + self.weight_decay * params
        return grads, losses

    def evaluate(self, theta: Tensor) -> dict[str, float]:
        """Test accuracy and loss of flat parameters θ (the task's own evaluation)."""
        set_flat_params(self.model, theta)
        return self.task.evaluate(self.model)

    # ---- engines -------------------------------------------------------------------

    def _batch(self, worker: int, step: int, flip: bool) -> tuple[Tensor, Tensor]:
        inputs, targets = self.task.batch(self.seed, peer_id(worker), step, self.batch_size)
        return inputs, (self.num_classes - 1 - targets) if flip else targets

    def _mlp(self, params: Tensor, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        assert self._layers is not None
        p = params.detach().clone().requires_grad_(True)  # (m, d) leaf: row i only reaches loss i
        m, batch = inputs.shape[0], inputs.shape[1]
        h = inputs.reshape(m, batch, -1)  # (m, B, in)
        for layer in self._layers:
            if isinstance(layer, _Linear):
                w = p[:, layer.w0 : layer.w0 + layer.out * layer.inp].view(m, layer.out, layer.inp)
                if layer.b0 is None:
                    h = torch.bmm(h, w.transpose(1, 2))
                else:
                    h = torch.baddbmm(p[:, layer.b0 : layer.b0 + layer.out].unsqueeze(1), h, w.transpose(1, 2))
            else:
                h = layer(h)  # (m, B, features), elementwise
        logits = h.reshape(m * batch, -1)  # (m·B, C)
        losses = F.cross_entropy(logits, targets.reshape(-1), reduction="none").view(m, batch).mean(dim=1)  # (m,)
        (grads,) = torch.autograd.grad(losses.sum(), p)
        return grads, losses.detach()

    def _vmap(self, params: Tensor, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        from torch.func import grad_and_value, vmap

        names = [name for name, _ in self.model.named_parameters()]
        shapes = [p.shape for _, p in self.model.named_parameters()]
        sizes = [p.numel() for _, p in self.model.named_parameters()]
        model, task = self.model, self.task

        def loss_at(flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
            named = {n: c.view(s) for n, c, s in zip(names, flat.split(sizes), shapes, strict=True)}
            return task.loss(_Stateless(model, named), x, y)  # type: ignore[arg-type]

        grads, losses = vmap(grad_and_value(loss_at))(params, inputs, targets)
        return grads, losses

    def _loop(
        self, params: Tensor, workers: Sequence[int], steps: Sequence[int], flip: Sequence[bool]
    ) -> tuple[Tensor, list[float]]:
        grads, losses = [], []
        for theta, w, s, f in zip(params, workers, steps, flip, strict=True):
            set_flat_params(self.model, theta)
            if not f:
                loss, g = compute_gradient(self.task, self.model, self.seed, peer_id(w), s, self.batch_size)
            else:
                self.model.zero_grad(set_to_none=True)
                x, y = self._batch(w, s, True)
                loss_t = self.task.loss(self.model, x, y)
                loss_t.backward()
                g = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])  # type: ignore[union-attr]
                loss = loss_t.item()
            grads.append(g)
            losses.append(loss)
        return torch.stack(grads), losses


class _Stateless:
    """Calls ``model`` with ``params`` substituted (torch.func.functional_call), for `Task.loss`."""

    def __init__(self, model: nn.Module, params: dict[str, Tensor]) -> None:
        self.model, self.params = model, params

    def __call__(self, x: Tensor) -> Tensor:
        from torch.func import functional_call

        return functional_call(self.model, self.params, (x,))


class _Linear:
    """Where one Linear layer's weight (out, in) and bias (out,) sit in the flat parameter vector."""

    def __init__(self, w0: int, out: int, inp: int, b0: int | None) -> None:
        self.w0, self.out, self.inp, self.b0 = w0, out, inp, b0


def _mlp_plan(model: nn.Module) -> list[_Linear | nn.Module] | None:
    """The layer plan of an nn.Sequential of Linear and elementwise modules, or None if it is not one."""
    if not isinstance(model, nn.Sequential) or list(model.buffers()):
        return None
    plan: list[_Linear | nn.Module] = []
    offset = 0
    for module in model:
        if isinstance(module, nn.Linear):
            out, inp = module.weight.shape
            w0 = offset
            offset += out * inp
            b0 = None
            if module.bias is not None:
                b0 = offset
                offset += out
            plan.append(_Linear(w0, out, inp, b0))
        elif isinstance(module, nn.Flatten) and module.start_dim == 1 and module.end_dim == -1:
            continue  # inputs are flattened to (m, B, in) before the first layer
        elif isinstance(module, _ELEMENTWISE):
            plan.append(module)
        else:
            return None
    if not plan or not isinstance(plan[0], _Linear):
        return None
    return plan
