"""The Offloader's backward, begun and ended around autograd's: by off.backward(loss), or by a plain
loss.backward() whose gradient reaches the offloaded layers (a hook on each stack's top output, or a gradient of an
offloaded part outside the stacks) and whose end autograd's end-of-backward callback marks."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class BackwardHooks:
    """The Offloader's backward bookkeeping, a mixin: it reads the Offloader's policy, gradient paths, rings, saved
    weights and backend."""

    def _begin_backward(self) -> None:
        self._check_open()
        self._check_backward_ended()
        hypers = self._hypers()
        self._saved.measuring = False  # "auto" counts what the first micro-batch's forward saved
        self._policy.begin_backward(self._backend)
        first, last = self._policy.micro == 1, self._policy.micro == self._policy.grad_accum
        for path, ring in zip(self._grad_paths, self._rings):
            path.begin_micro(first=first, last=last)
            ring.begin_backward(last)
        for path in self._grad_paths:
            path.armed = True
        self._in_backward = True
        try:
            self._backend.begin_step(hypers)
        except BaseException as e:
            self._fail(e)
            raise

    def _end_backward(self) -> None:
        for path in self._grad_paths:
            path.armed = False
        self._in_backward = False

    def _backward_reached(self) -> None:
        """A plain loss.backward() reached the offloaded layers (a stack's top output, or a gradient of a part
        outside the stacks): the backward begins here and ends when autograd's graph task does."""
        if self._in_backward:
            return
        self._begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _check_backward_ended(self) -> None:
        # autograd runs its end-of-backward callbacks only when the backward completes: one still pending means an
        # error stopped a plain loss.backward() part way, with some layers' host steps queued and others not.
        if self._in_backward:
            error = RuntimeError("Offloader: the last backward did not complete (an error stopped it part way); "
                                 "its layers may be at different steps: close() it and continue from a checkpoint")
            self._fail(error)
            raise error

    def _output_reached(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of each stack's top layer: its output's gradient marks the backward's arrival."""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:  # no grad, or a recompute
            return
        tensor = output if isinstance(output, torch.Tensor) else next(
            (t for t in output if isinstance(t, torch.Tensor)), None)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: self._backward_reached())
