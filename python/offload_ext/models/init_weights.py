"""InitWeights: a model's meta parameters given fresh values by the model's own init rule, each module drawn
from a seed of its own, so the values are a function of the run's seed and the model alone; and random-looking
values at memory-copy speed (tile_random) where the rule does not matter."""
from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn


class InitWeights:
    """Fresh weights by the model's own rule, as transformers' initialize_weights applies it: a module's
    parameters are made real on `device` and given its `_init_weights`, then each of its ancestors' (as the
    post-order walk does: GPT-2's attention and MLP blocks redraw their `c_proj` with the depth-scaled std),
    in the model's dtype, and handed out one by one, so at most one module's are held at once. Each module
    draws from its own seed, a hash of `seed` and its name, so the values are a function of the seed and the
    model alone, whatever order a layout fills them in (resident layers, offload_all), and of the device kind
    that drew them. A GPU draws 8 B parameters in well under a second, where the CPU's generator (one thread)
    took minutes."""

    thread_safe = False  # a module is drawn whole, with the process's RNG

    def __init__(self, model: nn.Module, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if not hasattr(model, "_init_weights"):
            raise ValueError(f"InitWeights: {type(model).__name__} has no _init_weights (a transformers model has)")
        self.model = model
        self.seed = seed
        self.device = torch.device(device)
        self.owner: dict[int, tuple[str, nn.Module]] = {}
        for name, module in model.named_modules():
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    self.owner.setdefault(id(p), (name, module))
        self._ready: dict[int, torch.Tensor] = {}  # drawn with their module, not handed out yet

    def _draw(self, name: str, module: nn.Module) -> None:
        metas = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
        real = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device), requires_grad=p.requires_grad)
                for n, p in metas.items()}
        module._parameters.update(real)
        cuda = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        # The process's RNG states are put back afterwards: drawing leaves the training's own RNG untouched.
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            try:
                for init, target in self._init_chain(name):
                    init(target)
            finally:
                module._parameters.update(metas)  # the meta objects stay the model's until filled
        for n, p in metas.items():
            self._ready[id(p)] = real[n].data

    def _init_chain(self, name: str) -> list[tuple[Any, nn.Module]]:
        """The module `name` and its ancestors, innermost first, each with the `_init_weights` transformers
        gives it (that of the nearest pretrained model holding it: a composite's parts have their own). An
        ancestor's rule touches only this module's parameters here: every other one is still on the meta
        device, where a draw is a no-op."""
        parts = name.split(".") if name else []
        chain = [self.model.get_submodule(".".join(parts[:k])) for k in range(len(parts), -1, -1)]
        from transformers import PreTrainedModel

        out = []
        for k, module in enumerate(chain):
            owner = next((m for m in chain[k:] if isinstance(m, PreTrainedModel)), self.model)
            out.append((owner._init_weights, module))
        return out

    def _take(self, param: nn.Parameter) -> torch.Tensor:
        if id(param) not in self._ready:
            self._draw(*self.owner[id(param)])
        return self._ready.pop(id(param))

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        dst.view(-1).copy_(self._take(param).reshape(-1))

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        # Drawn on the training device already: no round trip through the host (1.9 s for the 8 B
        # shape's two 1 GB embeddings on the GPU machine).
        return self._take(param).to(device)


def module_seed(seed: int, name: str) -> int:
    """The seed module `name` draws its initial weights from: a hash of the run's seed and the name, so no
    module's values depend on which others were drawn before it."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # torch.manual_seed takes below 2**63


def tile_random(flat: torch.Tensor, block: torch.Tensor, gen: torch.Generator) -> None:
    """Fill `flat` with copies of `block` (pre-drawn random values), each starting at a random place in
    it: random-looking weights at memory-copy speed, where drawing every value (normal_) takes tens of
    seconds per billion parameters."""
    done = 0
    while done < flat.numel():
        start = int(torch.randint(0, block.numel(), (1,), generator=gen))
        n = min(block.numel() - start, flat.numel() - done)
        flat[done:done + n].copy_(block[start:start + n])
        done += n
