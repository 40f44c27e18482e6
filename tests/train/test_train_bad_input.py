"""offload-train's bad inputs: each one line `offload-train: error: ...` naming the input, what was expected
and the fix, exit status 2, no traceback (unless --debug), and nothing written: --out is not there after."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import safetensors.torch
import torch

from offload_ext.train import cli as train
from offload_ext.train import inputs as train_inputs
from offload_ext.train.errors import UsageError
from offload_ext.train.model_configs import BUILTIN

_WHOLE = safetensors.torch.save({"w": torch.zeros(2048)})  # the checkpoint that _truncated_checkpoint cuts short
_BUILTINS = ", ".join(BUILTIN)
_DATA_TYPES = ".txt, .jsonl, .json, .csv, .parquet"
_HUB = ("the Hugging Face hub (huggingface.co) cannot be reached to fetch it as a hub id; expected {what}: check the "
        "path, connect, or set HF_HUB_OFFLINE=1 to use a copy already in the hub's cache")
_MODEL_WHAT = f"a built-in config ({_BUILTINS}), a model directory or a hub id"
_DATA_WHAT = f"a data file ({_DATA_TYPES}), a dataset directory or a hub id"
_NO_CUDA = torch.cuda.is_available()  # cases that need a machine without CUDA are skipped on one with it
_OFFLOAD_ON_CPU = ("the offload engine needs a CUDA device or the simulated one; use --device cpu-sim to run it on "
                   "the CPU, or leave --backend out to train on the CPU without offload")


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]
    line: str  # the whole line after "offload-train: error: "
    needs_no_cuda: bool = False


CASES = [
    Case("zero batch", ["--batch-size", "0"], "--batch-size must be at least 1 (sequences per micro-batch), got 0"),
    Case("zero seq-len", ["--seq-len", "0"], "--seq-len must be at least 1 (tokens per sequence), got 0"),
    Case("zero grad-accum", ["--grad-accum", "0"], "--grad-accum must be at least 1 (micro-batches per step), got 0"),
    Case("zero steps", ["--steps", "0"], "--steps must be at least 1 (optimizer steps), got 0"),
    Case("negative warm-up", ["--warmup-steps", "-1"], "--warmup-steps must be at least 0 (steps), got -1"),
    Case("negative lr without offload", ["--lr", "-1", "--device", "cpu"],
         "--lr must be a finite number above 0 (e.g. 3e-4), got -1.0"),
    Case("nan lr", ["--lr", "nan"], "--lr must be a finite number above 0 (e.g. 3e-4), got nan"),
    Case("negative weight decay", ["--weight-decay", "-0.1"],
         "--weight-decay must be a finite number of at least 0 (e.g. 0.1), got -0.1"),
    Case("zero clipping norm", ["--max-grad-norm", "0"],
         "--max-grad-norm must be a finite number above 0 (e.g. 1.0), got 0.0"),
    Case("negative save-every", ["--save-every", "-1"],
         "--save-every must be at least 0 (steps; 0: only at the end), got -1"),
    Case("zero log-every", ["--log-every", "0"], "--log-every must be at least 1 (steps), got 0"),
    Case("zero loss chunk", ["--loss-chunk-tokens", "0"], "--loss-chunk-tokens must be at least 1 (tokens), got 0"),
    Case("one device layer", ["--device-layers", "1"], "--device-layers must be at least 2 (layer buffers), got 1"),
    Case("negative resident layers", ["--resident-layers", "-1"],
         "--resident-layers must be at least 0 (layers), got -1"),
    Case("zero stop-after", ["--stop-after", "0"], "--stop-after must be at least 1 (steps), got 0"),
    Case("zero lora rank", ["--lora-r", "0"], "--lora-r must be at least 1 (the adapters' rank), got 0"),
    Case("zero lora alpha", ["--lora-r", "4", "--lora-alpha", "0"],
         "--lora-alpha must be a finite number above 0 (e.g. 16), got 0.0"),
    Case("negative seed", ["--seed", "-1"], "--seed must be at least 0 (numpy takes 0 to 2**32 - 1), got -1"),
    Case("seed past numpy's", ["--seed", str(2**32)], f"--seed must be below 2**32 ({2**32}), got {2**32}"),
    Case("unknown checkpointing", ["--activation-checkpointing", "some"],
         "--activation-checkpointing some: expected all, none, auto or a number of layers"),
    Case("not a number", ["--batch-size", "x"],
         "argument --batch-size: invalid int value: 'x' (offload-train --help lists the options)"),
    Case("missing model path", ["--model", "./nope", "--pretrained"],
         f"--model ./nope: no such file or directory; expected {_MODEL_WHAT} (check the path)"),
    Case("missing model under a directory that is here", ["--model", "models/does_not_exist", "--pretrained"],
         f"--model models/does_not_exist: no such file or directory; expected {_MODEL_WHAT} (check the path)"),
    Case("missing model that may be a hub id, hub unreachable", ["--model", "nobody/nothing", "--pretrained"],
         "--model nobody/nothing: no such file or directory, and " + _HUB.format(what=_MODEL_WHAT)),
    Case("model directory without config", ["--model", "tok", "--from-scratch"],
         "--model tok: the directory has no config.json; expected a transformers model directory (save_pretrained "
         "writes one)"),
    Case("truncated safetensors", ["--model", "truncated", "--pretrained"],
         f"--model truncated: model.safetensors is truncated (4000 bytes, its header says {len(_WHOLE)}); copy or "
         "download the checkpoint again"),
    Case("built-in model with --pretrained", ["--model", "tiny", "--pretrained"],
         "--pretrained: built-in config 'tiny' has no weights; use --from-scratch, or --model DIR or a hub id with "
         "weights"),
    Case("missing tokenizer file", ["--tokenizer", "path/tokenizer.json"],
         "--tokenizer path/tokenizer.json: no such file or directory; expected a tokenizer directory, a "
         "tokenizer.json or a hub id (check the path)"),
    Case("missing data file", ["--dataset", "data/nope.jsonl", "--tokenizer", "tok"],
         f"--dataset data/nope.jsonl: no such file or directory; expected {_DATA_WHAT} (check the path)"),
    Case("dataset hub id, hub unreachable", ["--dataset", "nobody/texts", "--tokenizer", "tok"],
         "--dataset nobody/texts: no such file or directory, and " + _HUB.format(what=_DATA_WHAT)),
    Case("empty jsonl", ["--dataset", "empty.jsonl", "--tokenizer", "tok"],
         '--dataset empty.jsonl: the file is empty; expected one JSON object a line, e.g. {"text": "..."}'),
    Case("empty txt", ["--dataset", "empty.txt", "--tokenizer", "tok"],
         "--dataset empty.txt: the file is empty; expected one document a line"),
    Case("csv without rows", ["--dataset", "header.csv", "--tokenizer", "tok"],
         "--dataset header.csv: the file has a header and no rows; expected a header and one row a line"),
    Case("jsonl line that is not JSON", ["--dataset", "garbled.jsonl", "--tokenizer", "tok"],
         "--dataset garbled.jsonl: the first line is not JSON (Expecting value: line 1 column 1 (char 0)); "
         'expected one JSON object a line, e.g. {"text": "..."}'),
    Case("jsonl without the text field", ["--dataset", "content.jsonl", "--tokenizer", "tok"],
         "--text-field 'text' is not a column of content.jsonl; its columns are ['content'] (pass --text-field NAME)"),
    Case("unknown data file type", ["--dataset", "data.xyz", "--tokenizer", "tok"],
         f"--dataset data.xyz: unknown file type .xyz; expected {_DATA_TYPES} (rename it, or convert it)"),
    Case("empty dataset directory", ["--dataset", "nodata", "--tokenizer", "tok"],
         f"--dataset nodata: the directory has no files; expected data files ({_DATA_TYPES}) or a dataset "
         "repository's files"),
    Case("not a device", ["--device", "gpu"],
         "--device gpu: not a device; expected cuda, cuda:N, cpu, cpu-sim (the offload engine on the simulated "
         "device) or auto"),
    Case("cuda where there is none", ["--device", "cuda"],
         "--device cuda: CUDA is not available here; use --device cpu or cpu-sim", needs_no_cuda=True),
    Case("native backend on the plain CPU", ["--backend", "native", "--device", "cpu"],
         f"--backend native --device cpu: {_OFFLOAD_ON_CPU}"),
    Case("explicit native backend without CUDA", ["--backend", "native"],
         f"--backend native: there is no CUDA device here, and {_OFFLOAD_ON_CPU}", needs_no_cuda=True),
    Case("explicit python backend without CUDA", ["--backend", "python"],
         f"--backend python: there is no CUDA device here, and {_OFFLOAD_ON_CPU}", needs_no_cuda=True),
    Case("a size that is not one", ["--gpu-memory-budget", "abc"],
         "--gpu-memory-budget: expected a size such as 125GB, 139GiB or 80 (GB), got 'abc'"),
    Case("out that is a file", ["--out", "data.xyz"],
         "--out data.xyz: a file is there; expected a directory (made when missing): pass another --out"),
    Case("out under a file", ["--out", "data.xyz/run"],
         f"--out data.xyz/run: {{tmp}}{os.sep}data.xyz is a file, not a directory; pass another --out"),
    Case("simulated device without offload", ["--device", "cpu-sim", "--backend", "none"],
         "--device cpu-sim runs the offload engine: pick --backend native or python, or --device cpu to train on the "
         "CPU without offload"),
    Case("plan sizes without --dry-run", ["--gpu-memory", "80GB"],
         "--gpu-memory and --host-memory describe the machine a plan is for: use them with --dry-run"),
]


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A working directory with the files the cases name, and a hub that cannot be reached."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OFFLOAD_TRAIN_NO_BAR", "1")
    for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(offline, raising=False)
    monkeypatch.setattr(train_inputs, "_hub_reachable", lambda: False)
    for name, text in (("empty.jsonl", ""), ("empty.txt", "\n \n"), ("header.csv", "title,text\n"),
                       ("garbled.jsonl", "text: hello\n"), ("content.jsonl", json.dumps({"content": "x"}) + "\n"),
                       ("data.xyz", "hello\n")):
        (tmp_path / name).write_text(text)
    for directory in ("tok", "nodata", "models"):
        (tmp_path / directory).mkdir()
    _truncated_checkpoint(tmp_path / "truncated")
    return tmp_path


def _truncated_checkpoint(path) -> None:
    """A model directory whose model.safetensors was cut at 4000 bytes, as an interrupted copy leaves it."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(_WHOLE[:4000])


def _refusal(argv: list[str], capsys) -> tuple[int | str | None, str]:
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_bad_input_gets_one_line_exit_2_and_nothing_written(case: Case, inputs, capsys) -> None:
    if case.needs_no_cuda and torch.cuda.is_available():
        pytest.skip("the case is about a machine without CUDA")
    code, err = _refusal(["--out", "run", *case.argv], capsys)  # the case's own --out, where it has one, wins
    assert code == 2
    assert err.strip().splitlines()[-1] == "offload-train: error: " + case.line.replace("{tmp}", str(inputs))
    assert err.count("offload-train: error:") == 1 and "Traceback" not in err
    assert not (inputs / "run").exists()


def test_a_missing_path_is_refused_without_asking_the_hub(inputs, capsys, monkeypatch) -> None:
    def asked() -> bool:
        raise AssertionError("the hub was asked about a local path")

    monkeypatch.setattr(train_inputs, "_hub_reachable", asked)
    code, err = _refusal(["--dataset", "data/nope.jsonl", "--tokenizer", "tok", "--out", "run"], capsys)
    assert code == 2 and "no such file or directory" in err


def test_hub_offline_mode_leaves_a_hub_id_to_the_cache_without_the_reachability_check(inputs, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(train_inputs, "_hub_reachable", lambda: pytest.fail("probed the hub in offline mode"))
    train_inputs.check_inputs(train.parse_args(["--model", "nobody/nothing", "--out", "run"]))


# Refused only once the model is built (its positions are in its config), after the corpus's tokenizer went
# into --out.
_LATE = ["--model", "short", "--from-scratch", "--steps", "1", "--batch-size", "1", "--seq-len", "128"]
_LATE_LINE = "offload-train: error: --seq-len 128 is above the model's maximum of 64 positions"


@pytest.fixture
def short_model(inputs):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64).save_pretrained(str(inputs / "short"))
    return inputs


def test_a_refusal_after_the_data_was_prepared_leaves_no_out_behind(short_model, capsys) -> None:
    code, err = _refusal([*_LATE, "--out", "run"], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == _LATE_LINE and "Traceback" not in err
    assert not (short_model / "run").exists()


def test_a_refusal_after_the_data_was_prepared_keeps_an_out_that_was_there(short_model, capsys) -> None:
    (short_model / "run").mkdir()
    (short_model / "run" / "notes.txt").write_text("mine")
    code, err = _refusal([*_LATE, "--out", "run"], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == _LATE_LINE
    assert (short_model / "run" / "notes.txt").read_text() == "mine"


def test_debug_raises_the_error_instead_of_the_line(inputs, capsys) -> None:
    with pytest.raises(UsageError, match="--batch-size must be at least 1"):
        train.main(["--batch-size", "0", "--debug", "--out", "run"])
    assert "offload-train: error" not in capsys.readouterr().err


def _cli(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload_ext.train.cli", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OFFLOAD_TRAIN_NO_BAR": "1"})


def test_the_command_prints_only_the_line_and_with_debug_the_traceback(tmp_path) -> None:
    plain = _cli("--batch-size", "0", "--out", "run", cwd=tmp_path)
    assert (plain.returncode, plain.stderr) == (
        2, "offload-train: error: --batch-size must be at least 1 (sequences per micro-batch), got 0\n")
    debug = _cli("--batch-size", "0", "--debug", "--out", "run", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "UsageError" in debug.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device, said", [("cpu", "--device cpu"), ("auto", "no CUDA device")])
def test_the_default_backend_on_the_plain_cpu_trains_without_offload_and_says_so(device, said, capsys,
                                                                                 monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = train.parse_args(["--device", device])
    dev, simulated = train.choose_device(args)
    assert (dev.type, simulated, args.backend) == ("cpu", False, "none")
    assert capsys.readouterr().out == (f"offload-train: {said}: training on the CPU without offload (--backend none); "
                                       "--device cpu-sim runs the offload engine on the CPU\n")


@pytest.mark.parametrize("argv, backend", [(["--device", "cpu-sim"], "native"), (["--backend", "none"], "none"),
                                           (["--device", "cpu-sim", "--backend", "python"], "python")])
def test_the_backend_is_native_by_default_and_as_given_otherwise(argv, backend, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = train.parse_args(argv)
    train.choose_device(args)
    assert args.backend == backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="the profiler's complaint is a CPU machine's")
def test_trace_on_a_cpu_machine_prints_no_profiler_error(tmp_path) -> None:
    code = ("import argparse, torch; from offload_ext.train import loop; "
            f"p = loop.torch_profiler(argparse.Namespace(out={str(tmp_path)!r}))\n"
            "for _ in range(7):\n    torch.ones(4).sum(); p.step()\np.stop()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"})
    assert done.returncode == 0, done.stderr
    assert "ERROR" not in done.stderr + done.stdout and (tmp_path / "trace.json").exists()
