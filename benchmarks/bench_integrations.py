"""The integrations' speed beside the Offloader's own loop, on one recipe: the B1 shape (Llama-3.2-1B: 16 layers x
2048, vocab 128256), batches of 4 x 2048 random tokens, AdamW lr 1e-4 without weight decay, the chunked loss
(causal_lm_loss) everywhere. Modes, each in a process of its own, one after another:

- `offloader`: the loop offload-train runs (forward with causal_lm_loss, loss.backward(), off.step()), clip 1.0;
- `trainer`: OffloadTrainer (transformers' Trainer, its compute_loss the same causal_lm_loss), clip 1.0;
- `offloader-noclip`: the Offloader's loop without clipping;
- `per-layer`: PerLayerOffloadWithBackwardGradient's loop, as written for the hook offloader (which has no
  clipping);
- `offloader-auto`, `trainer-auto`: the first two with the GPU layout the Trainer chooses by default when given
  its micro-batch's length (`seq_len`), both sides the same layout (`hf_trainer.trainer_layout`), clip 1.0.

Each row: the median step time over the timed steps (after the warm-up, and with clipping after the engine has
measured how many layers the device redoes: the steady state on both sides), tokens/s and its ratio to the
Offloader's loop on the same recipe (`offloader` for the Trainer, `offloader-noclip` for the drop-in,
`offloader-auto` for `trainer-auto`).

    python benchmarks/bench_integrations.py [--steps 10] [--warmup 3] [--device cuda] [--tiny]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time

import torch

import _common
from offload_ext.engine.redo_tuning import SAMPLES, WARMUP

# Each mode, in its order, with the Offloader loop of its recipe it is compared with: the drop-in clips nothing
# (the hook offloader has no max_grad_norm), so its peer is the loop without clipping.
PEER = {"offloader": "offloader", "trainer": "offloader", "offloader-noclip": "offloader-noclip",
        "per-layer": "offloader-noclip", "offloader-auto": "offloader-auto", "trainer-auto": "offloader-auto"}
MODES = tuple(PEER)
CLIPPED = {"offloader", "trainer", "offloader-auto", "trainer-auto"}
# Steps a clipped mode may spend while the engine measures its device redos (engine/redo_tuning.py: WARMUP redone
# steps, then SAMPLES for each of at most five counts, then the step that decides), drawn on top of --warmup + --steps.
TUNING_STEPS = WARMUP + 5 * SAMPLES + 1


def _config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:  # the same code path on the simulated device, for a test
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)


def _model(tiny: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(tiny), dtype=torch.bfloat16)


def _batches(n: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(n)]


def _settled(off) -> bool:
    """Whether the Offloader's count of device-redone layers is decided (none measured: it is)."""
    return off.redo_tuning is None or off.redo_tuning.chosen is not None


def _timed(step, batches: list[torch.Tensor], device: str, settled=lambda: True) -> tuple[list[float], list[bool]]:
    times, flags = [], []
    for x in batches:
        flags.append(settled())
        t0 = time.perf_counter()
        step(x.to(device))
        if device == "cuda":  # the compute stream, as bench_train's steps: the engine's side streams run on
            torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t0)
    return times, flags


def _training_args(a: argparse.Namespace, steps: int):
    """The Trainer's arguments of every trainer mode (and of the layout the auto modes share)."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="/tmp/bench_integrations", per_device_train_batch_size=a.batch,
                             max_steps=steps, learning_rate=1e-4, weight_decay=0.0, lr_scheduler_type="constant",
                             max_grad_norm=1.0, logging_steps=10**6, save_strategy="no", report_to=[],
                             use_cpu=a.device == "cpu", optim="adamw_torch_fused", dataloader_drop_last=True)


def _chosen_layout(a: argparse.Namespace, model: torch.nn.Module) -> dict[str, int]:
    """The layout OffloadTrainer chooses for this micro-batch (none on the simulated device: the fixed one), from
    the config the Trainer itself builds (clipping included: its device redo buffers are in the plan)."""
    from offload_ext.integrations.hf_trainer import _device_config, trainer_layout
    from offload_ext.planning.plan import machine

    args = _training_args(a, 1)
    config = _device_config(args, None)
    choice = trainer_layout(model, args, config, a.seq, machine(config.device, model=model))
    return {} if choice is None else dict(resident_layers=choice.resident_layers, device_layers=choice.device_layers)


# a mode's step times, whether each step began with the device-redo count decided, and the layout it chose (auto
# modes; else empty)
Run = tuple[list[float], list[bool], dict[str, int]]


def _run_offloader(a: argparse.Namespace, batches: list[torch.Tensor], max_grad_norm: float | None = 1.0,
                   auto: bool = False) -> Run:
    import offload_ext

    model = _model(a.tiny)
    layout = _chosen_layout(a, model) if auto else {}
    off = offload_ext.Offloader(model, lr=1e-4, device=a.device, max_grad_norm=max_grad_norm, **layout)

    def step(x: torch.Tensor) -> None:
        offload_ext.causal_lm_loss(model, x).backward()
        off.step()
        off.zero_grad()
    return *_timed(step, batches, a.device, lambda: _settled(off)), layout


def _run_per_layer(a: argparse.Namespace, batches: list[torch.Tensor]) -> Run:
    import offload_ext

    model = _model(a.tiny)
    offloader = offload_ext.PerLayerOffloadWithBackwardGradient(model, torch.optim.AdamW,
                                                                 dict(lr=1e-4, weight_decay=0.0, fused=True))
    offloader.cuda() if a.device == "cuda" else offloader.cpu()

    def step(x: torch.Tensor) -> None:
        loss = offload_ext.causal_lm_loss(model, x)
        offloader.disable_forward_hook = True
        loss.backward()
        offloader.disable_forward_hook = False
        offloader.optim_step()
        offloader.optim_zero_grad()
    return *_timed(step, batches, a.device), {}


def _run_trainer(a: argparse.Namespace, batches: list[torch.Tensor], auto: bool = False) -> Run:
    from transformers import TrainerCallback

    import offload_ext
    from offload_ext.integrations.hf_trainer import OffloadTrainer

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(batches) * batches[0].shape[0]

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            row = batches[i // batches[0].shape[0]][i % batches[0].shape[0]]
            return {"input_ids": row, "labels": row}

    class ChunkedLoss(OffloadTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return offload_ext.causal_lm_loss(model, inputs["input_ids"])

    stamps: list[float] = []
    flags: list[bool] = []
    offloader = []  # the trainer's, once built

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            flags.append(_settled(offloader[0]))
            stamps.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            if a.device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    trainer = ChunkedLoss(model=_model(a.tiny), args=_training_args(a, len(batches)), train_dataset=Rows(),
                          callbacks=[Stamp()], seq_len=a.seq if auto else None)
    offloader.append(trainer.offloader)
    choice = trainer.layout_choice
    layout = {} if choice is None else dict(resident_layers=choice.resident_layers,
                                            device_layers=choice.device_layers)
    trainer.train()
    return [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])], flags, layout


def _child(a: argparse.Namespace) -> None:
    cfg = _config(a.tiny)
    extra = TUNING_STEPS if a.child in CLIPPED else 0
    batches = _batches(a.warmup + a.steps + extra, a.batch, a.seq, cfg.vocab_size)
    run = {"offloader": _run_offloader, "trainer": _run_trainer, "per-layer": _run_per_layer,
           "offloader-noclip": functools.partial(_run_offloader, max_grad_norm=None),
           "offloader-auto": functools.partial(_run_offloader, auto=True),
           "trainer-auto": functools.partial(_run_trainer, auto=True)}[a.child]
    times, settled, layout = run(a, batches)
    timed = [k for k in range(a.warmup, len(times)) if settled[k]][:a.steps]
    peak = torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else None
    print(json.dumps({"mode": a.child, "step_times_s": [times[k] for k in timed], "gpu_peak_gb": peak,
                      "tuning_warmup_steps": timed[0] - a.warmup if timed else None, "layout": layout or None,
                      "host_peak_gb": _common._proc_kb("/proc/self/status", "VmHWM") / 1e6}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a two-layer model (the CPU test's)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stem", default="integrations_b1")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a)
    rows = []
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["median_step_s"] = statistics.median(row["step_times_s"])
        row["spread_s"] = [min(row["step_times_s"]), max(row["step_times_s"])]
        row["tokens_per_s"] = a.batch * a.seq / row["median_step_s"]
        rows.append(row)
        # each mode's figure as it lands: a call cut short by its time limit still shows the modes it finished
        print(f"{mode}: {row['median_step_s']:.4f} s/step (median; {row['spread_s'][0]:.4f}-{row['spread_s'][1]:.4f})",
              flush=True)
    tok_s = {r["mode"]: r["tokens_per_s"] for r in rows}
    lines = ["| mode | s/step (median) | min-max | tok/s | vs the Offloader's loop, same recipe | GPU peak GB | "
             "host peak GB |", "|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        peer = PEER[r["mode"]]
        ratio = f"{r['tokens_per_s'] / tok_s[peer]:.3f}x ({peer})" if peer in tok_s else "-"
        gpu = f"{r['gpu_peak_gb']:.1f}" if r["gpu_peak_gb"] is not None else "-"
        lines.append(f"| {r['mode']} | {r['median_step_s']:.4f} | {r['spread_s'][0]:.4f}-{r['spread_s'][1]:.4f} | "
                     f"{r['tokens_per_s']:.0f} | {ratio} | {gpu} | {r['host_peak_gb']:.1f} |")
    print("\n".join(lines))
    for path in _common.write_results(a.stem, {"args": vars(a), "rows": rows}, "\n".join(lines) + "\n"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
