"""causal_lm_loss equals the model's own loss and gradients with either cross-entropy kernel and any
chunk size; the native row kernels match F.cross_entropy; the last chunk is not recomputed."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload_ext
from helpers import batches, tiny_llama
from offload_ext import ops
from offload_ext.models import losses

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("chunk", [7, 30, 4096])
def test_chunked_loss_matches_the_models_loss_and_grads(chunk: int, kernel: str) -> None:
    model, x = tiny_llama(layers=2), batches(1)[0]
    ref = copy.deepcopy(model)
    expected = ref(input_ids=x, labels=x).loss
    expected.backward()
    loss = offload_ext.causal_lm_loss(model, x, chunk_tokens=chunk, kernel=kernel)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1003, 4096])  # 1003: rows not 16-byte aligned, scalar path on CUDA
def test_row_kernels_match_cross_entropy_on_fp32_logits(device: str, dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(37, vocab, generator=gen) * 4).to(device, dtype)
    labels = torch.randint(0, vocab, (37,), generator=gen).to(device)
    labels[[3, 20]] = losses.IGNORE_INDEX
    weights = torch.rand(37, generator=gen).to(device)
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, _ = ops.cross_entropy_rows(mine, labels, losses.IGNORE_INDEX)
    expected = F.cross_entropy(ref.float(), labels, reduction="none")
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=2e-6)
    assert mine.grad.dtype == dtype and not mine.grad[[3, 20]].any()
    # Both compute the gradient in fp32 and round it once to the logits' dtype, by different formulas
    # (exp(x - lse) here, softmax's exp(x - max) / sum there): a few fp32 ulps, at most one rounding step.
    rtol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(mine.grad.float(), ref.grad.float(), rtol=rtol, atol=1e-7)


def test_overwriting_backward_fails_loudly_when_the_logits_are_needed_again() -> None:
    logits = torch.randn(4, 10, requires_grad=True)
    probs = logits.exp()  # exp's backward needs its output: the tensor the loss would overwrite
    loss = ops.cross_entropy_rows(probs, torch.tensor([1, 2, 3, 4]), overwrite=True)[0].sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("head", [nn.Linear(16, 50, bias=False), nn.Sequential(nn.Linear(16, 50, bias=False))],
                         ids=["linear", "wrapped-linear"])
def test_the_logits_gradient_overwrites_the_logits_only_behind_a_plain_linear_head(head: nn.Module) -> None:
    grads_at = []

    def record(module: nn.Module, args: tuple, logits: torch.Tensor) -> None:
        logits.register_hook(lambda g: grads_at.append((g.data_ptr(), logits.data_ptr())))

    (head if isinstance(head, nn.Linear) else head[0]).register_forward_hook(record)
    hidden = torch.randn(1, 9, 16, requires_grad=True)
    offload_ext.lm_head_loss(head, hidden, torch.randint(0, 50, (1, 9)), kernel="native").backward()
    (grad_ptr, logits_ptr), = grads_at
    assert (grad_ptr == logits_ptr) == isinstance(head, nn.Linear)


def test_only_chunks_before_the_last_are_recomputed_in_backward() -> None:
    head = nn.Linear(16, 50, bias=False)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    hidden = torch.randn(2, 11, 16, requires_grad=True)  # 20 predicted tokens
    labels = torch.randint(0, 50, (2, 11))
    loss = offload_ext.lm_head_loss(head, hidden, labels, chunk_tokens=8)  # chunks of 8, 8, 4
    assert len(calls) == 3
    loss.backward()
    assert len(calls) == 5


def test_loss_rejects_a_label_outside_the_vocabulary() -> None:
    head = nn.Linear(8, 10)
    labels = torch.tensor([[0, 3, 10]])
    with pytest.raises(RuntimeError, match="label 10 of row 1 is outside the vocabulary"):
        offload_ext.lm_head_loss(head, torch.randn(1, 3, 8), labels, kernel="native")


def test_auto_kernel_is_the_native_one_only_on_cuda() -> None:
    assert losses.resolve_loss_kernel("auto", torch.device("cpu")) == "torch"
    assert losses.resolve_loss_kernel("native", torch.device("cpu")) == "native"
    if torch.cuda.is_available():
        assert losses.resolve_loss_kernel("auto", torch.device("cuda")) == "native"


def test_loss_rejects_an_unknown_kernel_and_a_bad_chunk_size() -> None:
    head, hidden, labels = nn.Linear(8, 10), torch.randn(1, 3, 8), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="kernel must be one of"):
        offload_ext.lm_head_loss(head, hidden, labels, kernel="fused")
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1"):
        offload_ext.lm_head_loss(head, hidden, labels, chunk_tokens=0)
