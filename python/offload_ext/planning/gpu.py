"""GPU estimate: the device memory a model needs under the Offloader's choices, each device buffer counted
the way it is allocated, activations from a Llama-style decoder layer's and the chunked loss's live tensors,
and what torch's allocator statistics do not see as a stated margin."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload_ext.config import eight_bit
from offload_ext.models.quantized_base import dequantize_temp_bytes
from offload_ext.planning.layout import Layout

if TYPE_CHECKING:  # choices.py imports this module for device_free_bytes
    from offload_ext.planning.choices import EngineChoices

# What torch.cuda.max_memory_allocated sees beyond the Offloader's tensors: the cuBLAS workspace of the
# compute stream (torch's default on Hopper, :4096:8), allocated through the caching allocator.
CUBLAS_WORKSPACE = 32 << 20
# Estimates for what it does not see, added before comparing with free memory: the caching allocator
# reserves more than it hands out (fragmentation), and kernels loaded on first use and library handles
# take device memory outside it.
FRAGMENTATION = 0.05
OUTSIDE_ALLOCATOR = 256 << 20
# A device planned from its size (gpu_memory=) loses the CUDA context before torch allocates anything.
CUDA_CONTEXT = 512 << 20

# Device redo (engine.device_redo): two sets of buffers, each a piece of at most REDO_PIECE elements.
REDO_SETS = 2
REDO_PIECE = 1 << 24


def redo_piece(largest: int) -> int:
    """Elements of each device buffer for units of at most `largest` trainable elements."""
    return min(largest, REDO_PIECE)


def redo_element_bytes(precision: str) -> int:
    """Device bytes per element of one set: params and moments in the state's dtype, the bf16 gradient and
    ("mixed", fp32 masters) the bf16 params the step also writes; in 8 bits a byte a moment, and one more that
    bounds their absmaxes (8 bytes a block of 256)."""
    return 3 * 4 + 2 + 2 if precision == "mixed" else 2 + 2 + 1 + 1 + 1 if eight_bit(precision) else 4 * 2


def device_free_bytes(device: torch.device) -> int:
    """What this process may still allocate on a CUDA device: its free memory, within the process's cap."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch only
    cap = (fraction(device) if fraction else 1.0) * total
    return int(min(free, cap - torch.cuda.memory_reserved(device)))



@dataclass(frozen=True)
class Shape:
    """The sizes the activation terms need: a decoder layer's and the head's."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model: nn.Module) -> Shape | None:
        """From the model's config (a transformers config, also through a peft wrapper); None without one."""
        cfg = getattr(model, "config", None)
        hidden = getattr(cfg, "hidden_size", None)
        if not isinstance(hidden, int):
            return None
        heads = getattr(cfg, "num_attention_heads", None) or 1
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
        head = _output_weight(model)
        vocab = head.shape[0] if head is not None else getattr(cfg, "vocab_size", 0)
        return cls(hidden, inter, heads, kv, head_dim, vocab)


def _output_weight(model: nn.Module) -> nn.Parameter | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return getattr(head, "weight", None)


def _input_weight(model: nn.Module) -> nn.Parameter | None:
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    return getattr(embedding, "weight", None)


def layer_activation_bytes(shape: Shape, tokens: int, largest_param: int) -> int:
    """Peak bytes a checkpointed Llama-style decoder layer (RMSNorm, rotary, SDPA, gated MLP) holds during
    its recompute and backward, beyond its input and its output's gradient: what a layer's live tensors
    add up to at the peak of its MLP's backward (tests/test_memory_plan.py tracks them). Per token:
    both norms keep their input in fp32 and their output in bf16 (12 bytes per hidden unit), q after rotary,
    the attention output, the residual sum, the norms' weighted outputs and the projections' inputs (10
    more); k and v (2 bytes each per kv unit); the attention's log-sum-exp (fp32 per head); the norms'
    rsqrt. In the MLP, gate, silu(gate), up, their product and the product's gradient (2 bytes each per
    intermediate unit), and last either the second of the product's gradients or down_proj's weight
    gradient (before its hook moves it into the flat gradient buffer), whichever is larger."""
    t, h, i = tokens, shape.hidden, shape.intermediate
    return (22 * t * h + 10 * t * i + max(2 * t * i, 2 * largest_param) + 4 * t * shape.kv_heads * shape.head_dim
            + 4 * t * shape.heads + 8 * t)


def kept_layer_bytes(shape: Shape, batch: int, seq: int) -> int:
    """Bytes a Llama-style decoder layer run without recompute saves for its backward beyond its input (what
    activation_checkpointing keeps per kept layer), measured on the simulated device by "auto"'s count
    (tests/test_memory_plan.py): per token 20 bytes per hidden unit (the norms' fp32 inputs and normalised
    values, their bf16 outputs, q, the attention output, the projections' inputs), 8 per intermediate unit
    (gate, silu(gate), up, their product), k and v (2 bytes each per kv unit), the attention's log-sum-exp
    (fp32 per head) and the norms' rsqrt; per position the rotary cos and sin (bf16, shared by the batch)."""
    t, h, i = batch * seq, shape.hidden, shape.intermediate
    return t * (20 * h + 8 * i + 4 * shape.kv_heads * shape.head_dim + 4 * shape.heads + 8) + 4 * shape.head_dim * seq


def loss_rows(shape: Shape, batch: int, seq: int, chunk_tokens: int, native: bool,
              head_grad: int) -> list[tuple[str, int]]:
    """The loss's peak (losses.lm_head_loss) on top of the checkpointed inputs: the final norm's saved
    input (fp32) and output (bf16), the head's input (a copy when batch > 1) and its gradient, one chunk
    of logits and the head's weight gradient. The native cross-entropy writes the logits' gradient over
    the logits (2 bytes per logit); torch's keeps fp32 log-softmax output and two fp32 gradients at its
    peak (12). With more than one chunk the checkpointed ones are recomputed in backward and each one's
    head gradient is summed into the previous ones' (two of them at once); the native path's peak holds
    the head gradient, torch's only from the second chunk on (`head_grad`: 0 for a frozen head)."""
    rows = max(1, batch * (seq - 1))
    chunk = min(chunk_tokens, rows)
    several = rows > chunk
    logits = (2 if native else 12) * chunk * shape.vocab
    grads = head_grad * ((2 if several else 1) if native else (1 if several else 0))
    around = 6 * batch * seq * shape.hidden + 4 * rows * shape.hidden
    return [(f"{chunk} x {shape.vocab} logits ({'native' if native else 'torch'} cross-entropy)", logits),
            ("the head's weight gradient" + (" (two chunks' at once)" if several and native else ""), grads),
            ("the final norm's and the head's inputs, a gradient", around)]


@dataclass(frozen=True)
class DeviceFacts:
    """The device-side sizes of a layout: parameters kept there and the Offloader's device buffers."""

    outer: int               # numel of the parameters outside the stacks kept on the device
    outer_trainable: int
    resident: int            # numel of the resident layers' parameters
    resident_trainable: int
    head_side: int           # trainable device numel whose gradients exist from the loss on (not the embedding's)
    head_grad: int           # bytes of the head's weight gradient (0: frozen)
    embedding_grad: int      # bytes of the input embedding's weight gradient (0: frozen)
    tied: bool               # the head's weight is the input embedding's (and trained)
    ring: int                # bytes of the layer buffers
    grad_buffers: int        # bytes of the gradient buffers (staging, or one sum per unit on the device)
    ring_layers: int         # layer buffers per stack
    checkpointed: int        # layers whose input is kept through forward (streamed and resident)
    largest_param: int       # numel of the largest trainable parameter inside a layer
    kept: int = 0            # layers run without recompute, their saved tensors kept (kept_layer_bytes each)
    dequantized: int = 0     # bytes of the buffers a quantized base is dequantized into (one layer per stack)

    @classmethod
    def of(cls, model: nn.Module, choices: EngineChoices, device_layers: int, frozen: bool = False,
           kept_per_stack: int = 0) -> DeviceFacts:
        """`frozen`: as if every parameter were frozen (LoRA's base, its adapters not counted); `kept_per_stack`:
        the top layers of each stack that run without recompute."""
        layout = choices.layout
        trains = (lambda p: False) if frozen else (lambda p: p.requires_grad)
        resident = {id(p) for layer in layout.resident for p in layer.parameters()}
        outer = [p for p in layout.device_params if id(p) not in resident]
        kept = [p for p in layout.device_params if id(p) in resident]
        embedding, head = _input_weight(model), _output_weight(model)
        side = [p for p in outer if trains(p) and (p is not embedding or p is head)]
        # Kept on the device or (offload_all) hosted, the head's .grad is made whole in the loss's backward.
        head_grad = 2 * head.numel() if head is not None and trains(head) else 0
        embedding_grad = 2 * embedding.numel() if embedding is not None and trains(embedding) else 0
        ring = grad = 0
        for part in layout.parts:
            largest = max(u.numel for u in part.units)
            trainable = [u.trainable_numel if not frozen else 0 for u in part.units]
            buffers = min(len(part.units), device_layers) if part.layers else 1
            ring += 2 * buffers * largest
            grad += (2 * sum(trainable) if choices.rule.sums_on_device
                     else 2 * min(2, buffers) * max(1, max(trainable)))
        streamed = [s.param for part in layout.stacks for u in part.units for s in u.spans]
        largest_param = max((p.numel() for p in (*streamed, *kept) if trains(p)), default=0)
        no_recompute = kept_per_stack * len(layout.stacks)
        dequantized = sum(2 * max(sum(s.numel for s in u.spans if s.quant) for u in part.units)
                          for part in layout.stacks if part.units)
        if dequantized:  # the temporaries, once: layers dequantize one after another
            dequantized += dequantize_temp_bytes()
        return cls(sum(p.numel() for p in outer), sum(p.numel() for p in outer if trains(p)),
                   sum(p.numel() for p in kept), sum(p.numel() for p in kept if trains(p)),
                   sum(p.numel() for p in side), head_grad, embedding_grad, head_grad > 0 and head is embedding,
                   ring, grad,
                   min(device_layers, min((len(p.units) for p in layout.stacks), default=0)),
                   layout.stack_layers - no_recompute, largest_param, no_recompute, dequantized)


def redo_buffer_bytes(layout: Layout, units: frozenset[int], precision: str) -> int:
    """offload_ext.engine.device_redo's buffers for these units: REDO_SETS sets of one piece of each span."""
    largest = max((u.trainable_numel for part in layout.stacks for u in part.units if u.index in units), default=0)
    return REDO_SETS * redo_element_bytes(precision) * redo_piece(largest)


def _state_bytes(precision: str) -> int:
    """Device bytes per trainable parameter of the device optimizer's state: torch's AdamW keeps its moments
    in the parameter's dtype (bf16); "mixed" steps fp32 masters (4) with fp32 moments (8)."""
    return 12 if precision == "mixed" else 4


@dataclass(frozen=True)
class GpuEstimate:
    """Device memory as torch.cuda.max_memory_allocated would read it: what stays allocated through the run
    (`static`) and, for each phase of a step, what comes on top of it; plus the margin not seen there."""

    static: tuple[tuple[str, int], ...]
    phases: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    cuda: bool  # a CUDA device: the margins apply

    @property
    def static_bytes(self) -> int:
        return sum(b for _, b in self.static)

    def phase_bytes(self, name: str) -> int:
        return sum(b for _, b in dict(self.phases)[name])

    @property
    def peak_phase(self) -> str | None:
        return max(dict(self.phases), key=self.phase_bytes) if self.phases else None

    @property
    def peak(self) -> int:
        return self.static_bytes + (self.phase_bytes(self.peak_phase) if self.phases else 0)

    @property
    def margin(self) -> int:
        return int(FRAGMENTATION * self.peak) + OUTSIDE_ALLOCATOR if self.cuda else 0

    @property
    def needed(self) -> int:
        return self.peak + self.margin


Rows = tuple[tuple[str, int], ...]


def gpu_estimate(model: nn.Module, choices: EngineChoices, precision: str, device_layers: int, cuda: bool,
                 batch: int | None = None, seq: int | None = None, chunk_tokens: int = 4096,
                 native_loss: bool = True, frozen: bool = False, kept_per_stack: int = 0,
                 activation_offload: bool = False) -> GpuEstimate:
    """Device memory of the Offloader with these choices; with `batch` and `seq`, of training on that batch
    (each backward's micro-batch) too; `kept_per_stack` top layers of each stack run without recompute."""
    f = DeviceFacts.of(model, choices, device_layers, frozen, kept_per_stack)
    if activation_offload:  # the checkpointed inputs on the device: the one in use and the next one down
        f = dataclasses.replace(f, checkpointed=min(f.checkpointed, 2))
    state = _state_bytes(precision)
    kind = " (fp32 masters, moments)" if precision == "mixed" else " (bf16 moments)"
    static = [("params outside the stacks (bf16)", 2 * f.outer),
              ("their optimizer state" + kind, state * f.outer_trainable),
              ("resident layers (params and optimizer state)", 2 * f.resident + state * f.resident_trainable),
              (f"layer buffers ({f.ring_layers} per stack, bf16)", f.ring),
              ("quantized base dequantized (one layer per stack, bf16, and any temporaries)", f.dequantized),
              ("gradient buffers" + (" (a sum per layer)" if choices.rule.sums_on_device else ""), f.grad_buffers),
              ("clipped redos on the device",
               0 if frozen else redo_buffer_bytes(choices.layout, choices.device_redo_units, precision))]
    if cuda:
        static.append(("cuBLAS workspace", CUBLAS_WORKSPACE))
    accumulating = choices.rule.grad_accum > 1
    shape = Shape.of(model)
    tokens = batch * seq if batch and seq and shape is not None else 0
    phases = [_embedding_phase(f, tokens * shape.hidden if tokens else 0, accumulating), _step_phase(f, precision)]
    if tokens:
        phases += _backward_phases(f, shape, batch, seq, chunk_tokens, native_loss, accumulating)
    return GpuEstimate(tuple(static), tuple(phases), cuda)


def _held_grads(f: DeviceFacts, accumulating: bool) -> int:
    """Gradients of device parameters held through a backward after the loss's: the head's side (in a later
    micro-batch of an accumulation every device parameter's .grad). A tied head's gradient waits in
    autograd's input buffer for the embedding's, beside the .grad an accumulation already holds."""
    if not accumulating:
        return 2 * f.head_side
    return 2 * (f.outer_trainable + f.resident_trainable) + (f.head_grad if f.tied else 0)


def _embedding_phase(f: DeviceFacts, token_units: int, accumulating: bool) -> tuple[str, Rows]:
    """The end of backward: the input embedding's dense weight gradient, new, beside the gradients already
    held (and the resident layers', just made). Tied to the head, or accumulating, it is summed into an
    existing gradient and so comes on top of it; `token_units` (tokens x hidden) sizes the backward's fp32
    partial sums."""
    held = _held_grads(f, accumulating) + (0 if accumulating else 2 * f.resident_trainable)
    return ("embedding backward", (("gradients held by then", held), ("the embedding's new weight gradient",
                                                                       f.embedding_grad),
                                   ("its fp32 partial sums", 4 * token_units if f.embedding_grad else 0)))


def _step_phase(f: DeviceFacts, precision: str) -> tuple[str, Rows]:
    """After backward: the device optimizer's step over every device gradient ("mixed" steps fp32 copies of
    them). state_dict() copies the device optimizer's state to the host, so a checkpoint needs nothing here."""
    trainable = f.outer_trainable + f.resident_trainable
    fp32 = 4 * trainable if precision == "mixed" else 0
    return ("optimizer step", (("gradients of the parameters on the device", 2 * trainable),
                               ("their fp32 copies (mixed)", fp32)))


def _backward_phases(f: DeviceFacts, shape: Shape, batch: int, seq: int, chunk_tokens: int, native_loss: bool,
                     accumulating: bool) -> list[tuple[str, Rows]]:
    """The loss's backward and the top layer's, each on top of every layer's checkpointed input. Gradients of
    the parameters outside the stacks persist through the later micro-batches of an accumulation."""
    tokens = batch * seq
    ckpt = ("checkpointed layer inputs", 2 * f.checkpointed * tokens * shape.hidden)
    kept = ("kept layers' saved tensors", f.kept * kept_layer_bytes(shape, batch, seq))
    all_grads = 2 * (f.outer_trainable + f.resident_trainable)
    layer = (ckpt, kept, ("one layer's recompute and backward", layer_activation_bytes(shape, tokens, f.largest_param)),
             ("the gradient of its output", 2 * tokens * shape.hidden),
             ("gradients of the head's side", _held_grads(f, accumulating)))
    loss = (ckpt, kept, *loss_rows(shape, batch, seq, chunk_tokens, native_loss, f.head_grad),
            ("gradients held from earlier micro-batches", all_grads if accumulating else 0))
    return [("layer backward", layer), ("loss", loss)]
