"""offload_ext.engine.recompute: a checkpointed call gives an unwrapped forward's loss and gradients bit for bit (under
autocast and dropout too, through torch.autograd.grad as through backward), keeps no saved tensor between forward
and backward, and stops its recompute once every saved tensor is back."""
from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import tiny_gpt2, tiny_llama
from offload_ext.engine.recompute import recompute_checkpoint

GPU = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _wrap(model: torch.nn.Module, rule: str | None) -> None:
    """Each layer's forward checkpointed by `rule` ("ours", "torch") or left alone (None)."""
    for layer in _layers(model):
        layer.__dict__.pop("forward", None)
        inner = layer.forward
        if rule == "ours":
            layer.forward = functools.partial(lambda f, *a, **k: recompute_checkpoint(f, a, k), inner)
        elif rule == "torch":
            layer.forward = functools.partial(lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k), inner)


Result = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _grads(model: torch.nn.Module, ids: torch.Tensor, rule: str | None, autocast: bool = False, seed: int = 1,
           by_grad: bool = False) -> Result:
    _wrap(model, rule)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = logits.float().square().mean()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if by_grad:
        grads = dict(zip((n for n, _ in named), torch.autograd.grad(loss, [p for _, p in named])))
    else:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in named}
    _wrap(model, None)
    return loss.detach(), grads


def _assert_same(a: Result, b: Result) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True])
def test_the_rule_gives_an_unwrapped_forwards_loss_and_gradients_bit_for_bit(autocast, device) -> None:
    # Under autocast the recompute (in backward, outside the caller's autocast) must run in the forward's
    # dtypes, or the saved tensors would come from an fp32 recompute. On the GPU in bf16, as the engine trains.
    model, ids = tiny_llama(layers=3).to(device), torch.randint(0, 128, (2, 16), device=device)
    if device == "cuda" and not autocast:
        model.to(torch.bfloat16)
    plain = _grads(model, ids, None, autocast)
    _assert_same(_grads(model, ids, "ours", autocast), plain)
    _assert_same(_grads(model, ids, "torch", autocast), plain)


def test_autograd_grad_reaches_the_parameters_and_a_frozen_embeddings_first_layer() -> None:
    # Nothing is nested, so torch.autograd.grad works; the first layer's input needs no gradient here (a frozen
    # embedding, as under LoRA) and its weights still get theirs.
    model, ids = tiny_llama(layers=2), torch.randint(0, 128, (2, 16))
    model.model.embed_tokens.weight.requires_grad_(False)
    _assert_same(_grads(model, ids, "ours", by_grad=True), _grads(model, ids, None, by_grad=True))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_in_the_recompute_draws_what_the_forward_drew(device) -> None:
    model = tiny_gpt2().to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.2
    model.train()
    ids = torch.randint(0, 128, (2, 16), device=device)
    plain = _grads(model, ids, None)
    assert not torch.equal(plain[0], _grads(model, ids, None, seed=2)[0])  # the dropout draws count
    _assert_same(_grads(model, ids, "ours"), plain)


def test_the_forward_keeps_no_saved_tensor_and_the_recompute_skips_the_layers_last_op() -> None:
    # Between forward and backward the layer's saved tensors are indices: the up projection's output, which the
    # MLP's product saves, is freed as the forward returns. The recompute stops at the last saved tensor: the
    # down projection saves its input before it computes, so it runs in the forward only (torch's early stop).
    model, ids = tiny_llama(layers=1), torch.randint(0, 128, (2, 16))
    mlp = model.model.layers[0].mlp
    runs, up_out = {"down": 0, "up": 0}, []
    mlp.down_proj.register_forward_hook(lambda *_: runs.__setitem__("down", runs["down"] + 1))
    mlp.up_proj.register_forward_hook(lambda m, a, out: runs.__setitem__("up", runs["up"] + 1) or
                                      up_out.append(weakref.ref(out)))
    hidden = model.model.embed_tokens(ids)
    rotary = model.model.rotary_emb(hidden, torch.arange(16)[None])
    for rule, freed in ((None, False), ("ours", True)):
        _wrap(model, rule)
        out = model.model.layers[0](hidden, position_embeddings=rotary)
        assert (up_out[-1]() is None) == freed, rule
        runs.update(down=0, up=0)
        out.float().square().mean().backward(retain_graph=True)
        assert runs == ({"down": 0, "up": 0} if rule is None else {"down": 0, "up": 1}), rule
    _wrap(model, None)


def test_a_recompute_that_saves_other_tensors_is_refused_with_the_reason() -> None:
    w = torch.ones(3, requires_grad=True)
    calls = []

    def changing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x * w).sin() if len(calls) == 1 else x * w  # the recompute takes a shorter path

    out = recompute_checkpoint(changing, (torch.ones(3, requires_grad=True),), {})
    with pytest.raises(RuntimeError, match="recompute saved 2 tensors where its forward saved 3"):
        out.sum().backward()
