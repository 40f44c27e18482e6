"""offload_ext.recompute: the reentrant checkpoint rule gives an unwrapped forward's gradients bit for bit,
under autocast and dropout too, keeps only the layer's input, and declines the calls it cannot serve."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import tiny_gpt2, tiny_llama
from offload_ext.recompute import applies, recompute_checkpoint

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def _wrap(model: torch.nn.Module, rule: str | None) -> None:
    """Each layer's forward checkpointed by `rule` ("ours", "torch") or left alone (None)."""
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    for layer in layers:
        layer.__dict__.pop("forward", None)
        inner = layer.forward
        if rule == "ours":
            layer.forward = functools.partial(lambda f, *a, **k: recompute_checkpoint(f, a, k), inner)
        elif rule == "torch":
            layer.forward = functools.partial(lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k), inner)


def _grads(model: torch.nn.Module, ids: torch.Tensor, rule: str | None, autocast: bool = False,
           seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _wrap(model, rule)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = logits.float().square().mean()
    loss.backward()
    _wrap(model, None)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a: tuple[torch.Tensor, dict[str, torch.Tensor]], b: tuple[torch.Tensor, dict[str, torch.Tensor]]):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True])
def test_the_rule_gives_an_unwrapped_forwards_loss_and_gradients_bit_for_bit(autocast, device) -> None:
    # Under autocast the recompute (in backward, outside the caller's autocast) must run in the forward's
    # dtypes, or the weights' gradients would come from an fp32 recompute. On the GPU in bf16 as the engine
    # trains: SDPA's kernel is chosen by whether grad is needed, and the forward runs under grad as HF's does.
    model, ids = tiny_llama(layers=3).to(device), torch.randint(0, 128, (2, 16), device=device)
    if device == "cuda" and not autocast:
        model.to(torch.bfloat16)
    plain = _grads(model, ids, None, autocast)
    _assert_same(_grads(model, ids, "ours", autocast), plain)
    _assert_same(_grads(model, ids, "torch", autocast), plain)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_in_the_recompute_draws_what_the_forward_drew(device) -> None:
    model = tiny_gpt2().to(device)
    model.config.resid_pdrop = model.config.attn_pdrop = 0.2
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.2
    model.train()
    ids = torch.randint(0, 128, (2, 16), device=device)
    plain = _grads(model, ids, None)
    assert not torch.equal(plain[0], _grads(model, ids, None, seed=2)[0])  # the dropout draws count
    _assert_same(_grads(model, ids, "ours"), plain)


def _nodes_between(out: torch.Tensor, stop: torch.autograd.graph.Node) -> int:
    """How many autograd nodes lie between a layer's output and its input's node."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node is stop or node in seen:
            continue
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
    return len(seen)


def test_a_layer_call_leaves_one_autograd_node_holding_only_its_input() -> None:
    # What makes the rule cheap: the layer's graph is dropped as its forward returns, one node standing for it
    # with the input as its only saved tensor; torch's non-reentrant checkpoint keeps the layer's whole graph,
    # each saved tensor behind a holder of its own.
    model, ids = tiny_llama(layers=2), torch.randint(0, 128, (2, 16))
    hidden = model.model.embed_tokens(ids)
    rotary = model.model.rotary_emb(hidden, torch.arange(16)[None])
    nodes, packed = {}, []
    for rule in ("ours", "torch"):
        _wrap(model, rule)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = model.model.layers[0](hidden, position_embeddings=rotary)
        nodes[rule] = _nodes_between(out, hidden.grad_fn)
        if rule == "ours":
            assert len(packed) == 1 and packed[0].data_ptr() == hidden.data_ptr()
    _wrap(model, None)
    assert nodes["ours"] == 1 and nodes["torch"] > 10


def test_calls_the_rule_cannot_serve_are_declined() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    frozen = torch.ones(2, 3)
    assert applies((x,), {"mask": frozen})
    assert not applies((frozen,), {})  # a frozen embedding below: the output would need no gradient
    assert not applies((), {"hidden_states": x})  # the hidden states by keyword
    assert not applies((x,), {"position_embeddings": (frozen, x)})  # a gradient inside a keyword's tuple
    assert not applies((x, x * 2), {})


def test_integer_outputs_pass_through_without_a_gradient() -> None:
    w = torch.ones(3, requires_grad=True)
    x = torch.arange(3.0, requires_grad=True)
    out, index = recompute_checkpoint(lambda t: (t * w, t.argmax()), (x,), {})
    assert not index.requires_grad and index.item() == 2
    out.sum().backward()
    assert torch.equal(w.grad, torch.arange(3.0)) and torch.equal(x.grad, torch.ones(3))
