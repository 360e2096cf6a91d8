"""Many LoRA adapters over ONE frozen base model, via peft's multi-adapter support.

Every training client and every sampler "slot" is a named peft adapter injected into the
same module tree, so the base weights exist once; switching the active adapter touches
only the LoRA layers (O(number of layers)), never the base weights. Sampler snapshots are
plain dicts of cloned LoRA tensors; to sample from one, its tensors are copied into a
slot adapter of the same shape (O(LoRA size)).

``BaseWeights`` folds a snapshot into plain weights without touching the module tree:
the small-model sampler uses it from its own thread while training runs (see
``engine.local.compute.backend``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import LoraConfig
from peft.functional import delete_adapter, inject_adapter_in_model, set_adapter
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

_ATTN_HINT = re.compile(r"(^|\.)(self_attn|attn|attention|self_attention)(\.|$)")


@dataclass(frozen=True)
class TargetSet:
    """Which linear modules a LoRA spec adapts, by full module name."""

    modules: tuple[str, ...]

    @property
    def key(self) -> str:
        return "|".join(self.modules)


@dataclass(frozen=True)
class ModuleGroups:
    """The base model's adaptable linear layers, split the way Tinker's flags split them."""

    attn: tuple[str, ...]
    mlp: tuple[str, ...]
    unembed: tuple[str, ...]

    @property
    def all(self) -> frozenset[str]:
        return frozenset(self.attn + self.mlp + self.unembed)

    def select(self, *, attn: bool, mlp: bool, unembed: bool) -> TargetSet:
        chosen = (self.attn if attn else ()) + (self.mlp if mlp else ())
        chosen += self.unembed if unembed else ()
        return TargetSet(tuple(sorted(chosen)))


def find_module_groups(model: nn.Module) -> ModuleGroups:
    """Classify every linear layer of a causal LM as attention, MLP or unembedding.

    Works by structure, not by a per-architecture table: the output embedding is the
    module ``get_output_embeddings()`` returns; any other linear layer whose path passes
    through an attention block is "attn"; the remaining ones are "mlp".
    """
    getter = getattr(model, "get_output_embeddings", None)
    unembed_mod = getter() if callable(getter) else None
    attn: list[str] = []
    mlp: list[str] = []
    unembed: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear | Conv1D):
            continue
        if mod is unembed_mod:
            unembed.append(name)
        elif _ATTN_HINT.search(name):
            attn.append(name)
        else:
            mlp.append(name)
    return ModuleGroups(tuple(attn), tuple(mlp), tuple(unembed))


def lora_config(rank: int, alpha: int, targets: TargetSet) -> LoraConfig:
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=list(targets.modules),
        init_lora_weights=True,
    )


@dataclass(frozen=True)
class BaseWeights:
    """The adaptable layers' base weights, captured once, before any adapter exists.

    Nothing ever writes a base weight (only LoRA tensors train), and folding reads only
    these tensors and a snapshot's (immutable) ones, never a module: so a second thread
    can fold while the compute thread injects, removes and trains adapters.
    """

    weights: dict[str, torch.Tensor]
    """Module path -> base weight (``nn.Linear``: (out, in); ``Conv1D``: (in, out))."""
    transposed: frozenset[str]
    """Paths of ``Conv1D`` layers, whose weight is stored transposed."""
    alpha: int

    @classmethod
    def of(cls, model: nn.Module, groups: ModuleGroups, alpha: int) -> BaseWeights:
        weights: dict[str, torch.Tensor] = {}
        transposed: set[str] = set()
        for path in groups.attn + groups.mlp + groups.unembed:
            mod = model.get_submodule(path)
            if isinstance(mod, BaseTunerLayer):
                raise ValueError(f"{path} already holds an adapter: capture the base first")
            weight = mod.weight
            assert isinstance(weight, torch.Tensor)
            weights[path] = weight.detach()
            if isinstance(mod, Conv1D):
                transposed.add(path)
        return cls(weights, frozenset(transposed), alpha)

    def folded(self, rank: int | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every layer's weight plus the LoRA delta of ``tensors`` (an adapter's tensors
        keyed as ``AdapterHost.params`` keys them, of rank ``rank``; None and ``{}``: the
        base model; a layer they do not adapt keeps its base weight), computed as peft's
        ``get_delta_weight`` does."""
        out: dict[str, torch.Tensor] = {}
        for path, weight in self.weights.items():
            a = tensors.get(f"{path}.lora_A.weight")
            b = tensors.get(f"{path}.lora_B.weight")
            if a is None or b is None or rank is None:
                out[path] = weight
                continue
            delta = b @ a
            if path in self.transposed:
                delta = delta.T
            out[path] = weight + delta * (self.alpha / rank)
        return out


class AdapterHost:
    """Owns the frozen base model and the named adapters injected into it."""

    def __init__(self, model: nn.Module, alpha: int) -> None:
        self.model = model
        self.alpha = alpha
        self.groups = find_module_groups(model)
        self._adapters: dict[str, tuple[int, TargetSet]] = {}
        self._layers: list[BaseTunerLayer] = []
        self._params: dict[str, dict[str, nn.Parameter]] = {}
        self._current: str | None = None
        """The adapter peft has active (None: unknown); switching walks every module."""

    def add(self, name: str, rank: int, targets: TargetSet, seed: int) -> dict[str, nn.Parameter]:
        """Inject a fresh adapter (A ~ kaiming-uniform from ``seed``, B = 0); return its
        parameters keyed by adapter-independent names."""
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # several adapters in one model is the point here, not a mistake
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            torch.manual_seed(seed)
            inject_adapter_in_model(lora_config(rank, self.alpha, targets), self.model, name)
        self._adapters[name] = (rank, targets)
        self._module_tree_changed()
        params = self.params(name)
        for p in params.values():
            p.requires_grad_(True)
        return params

    def remove(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            return
        with warnings.catch_warnings():
            # we always set the adapter we need before running the model
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            delete_adapter(self.model, name, prefix="lora_")
        self._module_tree_changed()

    def _module_tree_changed(self) -> None:
        self._layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self._params.clear()
        self._current = None

    def shapes(self, rank: int, targets: TargetSet) -> dict[str, tuple[int, int]]:
        """The tensor shapes an adapter of this rank over ``targets`` must have."""
        out: dict[str, tuple[int, int]] = {}
        for name in targets.modules:
            mod = self.model.get_submodule(name)
            base = mod.get_base_layer() if isinstance(mod, BaseTunerLayer) else mod
            weight = base.weight
            assert isinstance(weight, torch.Tensor)
            rows, cols = weight.shape
            fan_in, fan_out = (rows, cols) if isinstance(base, Conv1D) else (cols, rows)
            out[f"{name}.lora_A.weight"] = (rank, int(fan_in))
            out[f"{name}.lora_B.weight"] = (int(fan_out), rank)
        return out

    def has(self, name: str) -> bool:
        return name in self._adapters

    def params(self, name: str) -> dict[str, nn.Parameter]:
        """The adapter's tensors as ``{"<module path>.lora_A.weight": param, ...}``."""
        cached = self._params.get(name)
        if cached is not None:
            return dict(cached)
        marker = f".{name}."
        out: dict[str, nn.Parameter] = {}
        for pname, p in self.model.named_parameters():
            if marker in pname:
                out[pname.replace(marker, ".", 1)] = p
        self._params[name] = out
        return dict(out)

    @contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """Run the model with adapter ``name`` active (None: the bare base model)."""
        if name is None:
            for layer in self._layers:
                layer.enable_adapters(False)
            try:
                yield
            finally:
                for layer in self._layers:
                    layer.enable_adapters(True)
            return
        if name != self._current:
            set_adapter(self.model, name)
            self._current = name
        yield
