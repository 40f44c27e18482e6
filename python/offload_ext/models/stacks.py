"""Finding the homogeneous layer stacks of a model: the parts the Offloader streams."""
from __future__ import annotations

from torch import nn


def find_layer_stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every nn.ModuleList / nn.Sequential of two or more children of one type that hold parameters.

    HF Llama, Qwen2, Mistral: `model.layers`; GPT-2: `transformer.h`. Stacks nested inside a stack
    already found are skipped (the outer one is streamed whole, layer by layer).
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        if len({type(child) for child in module}) == 1 and any(True for _ in module.parameters()):
            found.append((name, module))
    return found
