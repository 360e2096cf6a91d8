"""A training client's state on the local server and the rules that keep it intact: a
failed forward_backward leaves no gradient behind, a failed optim_step is undone, Adam's
hyperparameters and a saved optimizer state are checked before use."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.local.compute.backend_types import AdamConfig, AdapterSpec, BackendError
from engine.local.models.lora import TargetSet

__all__ = [
    "Client",
    "TrainingState",
    "all_finite",
    "check_adam",
    "check_finite",
    "check_optimizer",
    "gradients_kept_only_on_success",
    "new_adam",
    "restore_adam",
]


@dataclass
class Client:
    """One training client: its adapter, LoRA spec, optimizer and step count."""

    adapter: str
    spec: AdapterSpec
    targets: TargetSet
    seed: int
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


def new_adam(params: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW:
    # hyperparameters are overwritten from AdamConfig on every step
    return torch.optim.AdamW(list(params.values()), lr=0.0, foreach=False)


def restore_adam(client: Client, saved: dict[str, torch.Tensor], src: Path) -> None:
    for key, p in client.params.items():
        names = (f"exp_avg/{key}", f"exp_avg_sq/{key}", f"step/{key}")
        present = [n in saved for n in names]
        if not any(present):
            continue  # never stepped when saved
        if not all(present):
            raise BackendError(f"{src}: optimizer state for {key} is incomplete")
        client.optimizer.state[p] = {
            "step": saved[names[2]].reshape(()).clone(),
            "exp_avg": saved[names[0]].clone(),
            "exp_avg_sq": saved[names[1]].clone(),
        }


def check_optimizer(
    src: Path, saved: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]]
) -> None:
    """Adam state as ``save_state`` writes it: moments shaped like their weights, one
    step count each, all finite."""
    for name, tensor in saved.items():
        kind, _, key = name.partition("/")
        expected = (1,) if kind == "step" else shapes.get(key)
        if kind not in ("exp_avg", "exp_avg_sq", "step") or key not in shapes:
            raise BackendError(f"{src}: unexpected optimizer tensor {name}")
        if tuple(tensor.shape) != expected:
            raise BackendError(
                f"{src}: optimizer tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {expected}"
            )
        check_finite(src, name, tensor)


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def check_finite(src: Path, name: str, tensor: torch.Tensor) -> None:
    if not all_finite([tensor]):
        raise BackendError(f"{src}: tensor {name} holds NaN or infinite values")


@contextlib.contextmanager
def gradients_kept_only_on_success(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Gradients computed inside the block start from zero; when it succeeds they are
    added to the ones accumulated before, when it raises they are dropped and the earlier
    ones are restored untouched (a failed forward_backward leaves no trace)."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        for p, grad in zip(params, earlier, strict=True):
            p.grad = grad
        raise
    for p, grad in zip(params, earlier, strict=True):
        if grad is not None:
            p.grad = grad if p.grad is None else grad.add_(p.grad)


@dataclass(frozen=True)
class TrainingState:
    """A copy of a client's weights, gradients and optimizer state (to undo a step)."""

    weights: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    optimizer: dict[str, Any]
    steps: int

    @classmethod
    def of(cls, client: Client) -> TrainingState:
        params = list(client.params.values())
        return cls(
            weights=[p.detach().clone() for p in params],
            grads=[None if p.grad is None else p.grad.clone() for p in params],
            optimizer=copy.deepcopy(client.optimizer.state_dict()),
            steps=client.steps,
        )

    def restore(self, client: Client) -> None:
        with torch.no_grad():
            for p, weight, grad in zip(
                client.params.values(), self.weights, self.grads, strict=True
            ):
                p.copy_(weight)
                p.grad = grad
        client.optimizer.load_state_dict(self.optimizer)
        client.steps = self.steps


def check_adam(adam: AdamConfig) -> None:
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps >= 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not (math.isfinite(value) and ok):
            raise BackendError(f"invalid AdamParams.{name}: {value}")
