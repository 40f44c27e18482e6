"""bench_train's interleaved runs: modes set up side by side in one process and stepped in turns train exactly as
they do one after another, each timed over its own steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"
SHAPE = ["--device", "cpu", "--layers", "3", "--hidden", "64", "--intermediate", "128", "--heads", "4",
         "--kv-heads", "2", "--vocab", "128", "--batch", "4", "--seq", "16", "--steps", "3", "--warmup", "2",
         "--batches", "2"]
MODES = "resident-accum2,native-bf16-d3-r1-accum2"


def _rows(tmp_path: Path, stem: str, *extra: str) -> dict[str, dict]:
    subprocess.run([sys.executable, str(BENCH), *SHAPE, "--modes", MODES, "--stem", str(tmp_path / stem), *extra],
                   check=True, capture_output=True, cwd=tmp_path)
    return {r["mode"]: r for r in json.loads((tmp_path / f"{stem}.json").read_text())["rows"]}


def test_interleaved_modes_train_bit_exactly_as_one_after_another(tmp_path) -> None:
    alone = _rows(tmp_path, "alone")
    turns = _rows(tmp_path, "turns", "--interleave", "2")
    for mode in MODES.split(","):
        # warmup 2, then 3 timed steps in turns of a lead-in and up to 2: 7 steps, the first 5 as run alone
        assert len(turns[mode]["losses"]) == 7 and turns[mode]["losses"][:5] == alone[mode]["losses"], mode
        assert len(turns[mode]["step_times_s"]) == 3 and turns[mode]["gpu_peak_gb"] is None, mode
    assert turns["native-bf16-d3-r1-accum2"]["resident_peer"] == "resident-accum2"


def test_interleave_refuses_a_per_mode_gpu_cap_before_building_anything(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), *SHAPE, "--modes", MODES, "--interleave", "2",
                           "--gpu-cap-gb", "24"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0 and "drop --gpu-cap-gb" in done.stderr, done.stderr


def test_resident_under_the_engines_checkpoint_trains_the_same_losses_and_is_never_a_peer(tmp_path) -> None:
    modes = "resident-accum2,resident-lean-accum2,native-bf16-d3-r1-accum2"
    subprocess.run([sys.executable, str(BENCH), *SHAPE, "--modes", modes, "--stem", str(tmp_path / "lean")],
                   check=True, capture_output=True, cwd=tmp_path)
    rows = {r["mode"]: r for r in json.loads((tmp_path / "lean.json").read_text())["rows"]}
    assert rows["resident-lean-accum2"]["losses"] == rows["resident-accum2"]["losses"]
    assert rows["native-bf16-d3-r1-accum2"]["resident_peer"] == "resident-accum2"
    done = subprocess.run([sys.executable, str(BENCH), *SHAPE, "--modes", "native-bf16-lean"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0 and "lean is a resident mode's checkpoint" in done.stderr, done.stderr


def test_a_quantized_base_trains_the_same_losses_resident_and_offloaded(tmp_path) -> None:
    modes = "resident-lean-lora4-baseint8,native-bf16-lora4-baseint8"
    subprocess.run([sys.executable, str(BENCH), *SHAPE, "--vocab", "128", "--modes", modes, "--stem",
                    str(tmp_path / "base")], check=True, capture_output=True, cwd=tmp_path)
    rows = {r["mode"]: r for r in json.loads((tmp_path / "base.json").read_text())["rows"]}
    # the same adapters, the base dequantized alike, each linear's backward through its own weight: step for step
    losses = rows["resident-lean-lora4-baseint8"]["losses"]
    assert len(losses) == 5 and losses == rows["native-bf16-lora4-baseint8"]["losses"]
    done = subprocess.run([sys.executable, str(BENCH), *SHAPE, "--modes", "native-bf16-basenf4"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0 and "base<format> takes one of" in done.stderr, done.stderr


def test_a_clipped_mode_warms_up_until_the_engine_has_measured_its_device_redos(tmp_path) -> None:
    # Every step clips; three layers: the device redoes one layer or none, each measured for SAMPLES redone steps
    # after WARMUP. The timed steps come after the choice: what a long run gets.
    from offload_ext.engine.redo_tuning import SAMPLES, WARMUP

    subprocess.run([sys.executable, str(BENCH), *SHAPE, "--modes", "native-bf16-clipall", "--stem",
                    str(tmp_path / "clip")], check=True, capture_output=True, cwd=tmp_path)
    row = json.loads((tmp_path / "clip.json").read_text())["rows"][0]
    extra = WARMUP + 2 * SAMPLES + 1 - 2  # the redone step whose clipped step chooses, past --warmup 2
    assert row["tuning_warmup_steps"] == extra and len(row["losses"]) == 2 + extra + 3
    assert len(row["step_times_s"]) == 3 and row["engine"]["device_redo_chosen"]
    assert set(row["engine"]["device_redo_times_s"]) == {"0", "1"}  # JSON's keys: the layer counts measured
    assert row["clipped_fraction"] == 1.0
    assert row["model_tflops"] > 0


def test_model_flops_count_every_matmul_weight_of_the_built_model_and_attention() -> None:
    # The oracle: the model's own nn.Linear weights (the head's too), not the config's arithmetic.
    sys.path.insert(0, str(BENCH.parent))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import _common

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=300, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 12 * 3 * (4 * 32) * 128
    assert _common.model_flops_per_token(config, 128) == 6 * matmul + attention
    assert _common.model_flops_per_token(config, 128, trainable=1000) == 4 * matmul + 2 * 1000 + attention
