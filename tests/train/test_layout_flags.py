"""--resident-layers / --device-layers auto: the memory plan's layout, printed as the flags that reproduce it and
recorded as numbers; a resume with auto continues with the checkpoint's layout."""
from __future__ import annotations

import json
import os

import pytest

from offload_ext.train import cli as train
from offload_ext.train import machine, prior_run

RUN = ["--device", "cpu-sim", "--backend", "native", "--steps", "3", "--batch-size", "2", "--seq-len", "16"]


@pytest.fixture(autouse=True)
def _no_progress_bar(monkeypatch):
    monkeypatch.setenv("OFFLOAD_TRAIN_NO_BAR", "1")


def _losses(out) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f)]


def test_a_dry_run_prints_the_chosen_layout_and_plans_it(capsys) -> None:
    train.main(["--dry-run", "--device", "cuda", "--gpu-memory", "24GB", "--host-memory", "125GB", "--model",
                "llama-8b", "--batch-size", "2", "--seq-len", "4096", "--resident-layers", "auto"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("offload-train: layout "))
    resident = int(line.split("--resident-layers ")[1].split()[0])
    assert resident > 0 and "--device-layers 2 (the plan at batch 2 x 4096" in line
    assert f"batch 2 x 4096, {resident} resident layers" in out  # the plan printed is the chosen layout's


def test_a_resume_with_auto_continues_with_the_checkpoints_layout(tmp_path, capsys) -> None:
    straight = str(tmp_path / "straight")
    train.run(train.parse_args(["--out", straight, *RUN, "--resident-layers", "1", "--device-layers", "3"]))
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--resident-layers", "1", "--device-layers", "3",
                                "--stop-after", "1", "--save-every", "1"]))
    capsys.readouterr()
    train.run(train.parse_args(["--out", out, *RUN, "--resident-layers", "auto", "--device-layers", "auto",
                                "--resume", "--save-every", "1"]))
    assert "offload-train: layout --resident-layers 1 --device-layers 3 (the checkpoint's)" in capsys.readouterr().out
    assert _losses(out) == _losses(straight)
    _, path = prior_run.complete_checkpoints(out)[-1]
    with open(os.path.join(path, "manifest.json")) as f:
        recorded = json.load(f)["args"]
    assert {k: recorded[k] for k in prior_run.AUTO_FLAGS} == {"resident_layers": 1, "device_layers": 3}


def test_auto_on_the_simulated_device_records_the_plain_layout_in_the_checkpoint(tmp_path, capsys) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--resident-layers", "auto"]))
    printed = capsys.readouterr().out
    assert "offload-train: layout --resident-layers 0 --device-layers 2 (no GPU memory figure" in printed
    _, path = prior_run.complete_checkpoints(out)[-1]
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["args"]["resident_layers"] == 0


def test_auto_without_the_engine_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(train, "build_model", lambda *a: pytest.fail("the model was built before the refusal"))
    with pytest.raises(SystemExit) as exc:
        train.main(["--out", str(tmp_path / "run"), "--device", "cpu", "--resident-layers", "auto"])
    assert exc.value.code == 2
    assert "--resident-layers and --device-layers auto lay out the offload engine: --backend none" in \
        capsys.readouterr().err


def test_the_engine_on_a_gpu_lays_itself_out_by_default_and_every_other_run_keeps_the_fixed_layout(capsys) -> None:
    train.main(["--dry-run", "--device", "cuda", "--gpu-memory", "24GB", "--host-memory", "125GB", "--model",
                "llama-8b", "--batch-size", "2", "--seq-len", "4096"])  # no layout flag
    assert any(x.startswith("offload-train: layout --resident-layers ") for x in capsys.readouterr().out.splitlines())
    for argv, on_gpu in ((["--backend", "none"], True), (["--fsdp"], True), ([], False)):
        args = train.parse_args(argv)
        args.backend = args.backend or "native"
        machine.apply_defaults(args, on_gpu)
        assert (args.resident_layers, args.device_layers) == (0, 2), argv
    args = train.parse_args(["--device-layers", "4"])
    args.backend = "native"
    machine.apply_defaults(args, True)
    assert (args.resident_layers, args.device_layers) == ("auto", 4)  # a flag given stays as given


@pytest.mark.parametrize("precision, resident, said", [("bf16-8bit-sr", "3", True), ("bf16-8bit", "0", False),
                                                        ("bf16-sr", "3", False)])
def test_a_dry_run_in_8_bit_moments_says_the_resident_layers_step_without_them(capsys, precision, resident,
                                                                                  said) -> None:
    train.main(["--dry-run", "--device", "cuda", "--gpu-memory", "24GB", "--host-memory", "125GB", "--model",
                "llama-1b", "--precision", precision, "--resident-layers", resident])
    note = [x for x in capsys.readouterr().out.splitlines() if "resident layers step on the GPU" in x]
    expected = [f"offload-train: the 3 resident layers step on the GPU in {precision.replace('-8bit', '')}, bf16 "
                "moments; the 8-bit moments are the streamed layers' (--resident-layers 0 streams them all)"]
    assert note == (expected if said else [])
