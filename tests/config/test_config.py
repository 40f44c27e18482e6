"""OffloadConfig and EngineTuning: one configuration, validated once, that the Offloader, plan(), the trainers and
offload-train take; every field documented, reachable from the command line or API-only for a stated reason."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import offload_ext
from offload_ext import EngineTuning, OffloadConfig
from offload_ext.train.errors import UsageError
from offload_ext.train.flags import offload_config, parse_args
from offload_ext.train.machine import apply_defaults


def _cpu_args(argv: list[str]):
    """offload-train's arguments as its CLI completes them on a machine without a GPU (the native engine)."""
    args = parse_args(argv)
    args.backend = "native"
    apply_defaults(args, on_gpu=False)
    return args

CONFIGS = (OffloadConfig, EngineTuning)


def _fields() -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for cls in CONFIGS for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls,f", _fields(), ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_every_field_has_a_doc_line_a_range_and_a_flag_or_a_reason(cls, f) -> None:
    meta = f.metadata
    assert meta["doc"] and "\n" not in meta["doc"], f.name
    assert meta["valid"], f.name
    assert (meta["cli"] is None) != (meta["api_only"] is None), f.name
    if meta["cli"] is not None:
        assert meta["cli"] in _parser_flags(), f"{cls.__name__}.{f.name}: {meta['cli']} is not an offload-train flag"
    assert meta["ok"](getattr(cls(), f.name)), f"{cls.__name__}.{f.name}: its default is out of its own range"


def _parser_flags() -> set[str]:
    import argparse

    captured: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        captured.append(self)
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_args = capture
    try:
        parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = original
    return {s for action in captured[0]._actions for s in action.option_strings}


def test_an_unknown_field_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"Offloader: unknown option 'precison'; options are OffloadConfig's fields "
                                        r"\(.*precision.*\) and EngineTuning's \(.*num_threads.*\)"):
        OffloadConfig.from_options(precison="bf16")
    with pytest.raises(TypeError, match="unknown option 'grad_acum'"):
        offload_ext.Offloader(torch.nn.Linear(2, 2), device="cpu", grad_acum=2)
    with pytest.raises(TypeError):
        OffloadConfig(not_a_field=1)


@pytest.mark.parametrize("cls,name,bad,says", [
    (OffloadConfig, "precision", "fp8", "'bf16', 'bf16-sr'"),
    (OffloadConfig, "grad_accum", 0, "an int >= 1"),
    (OffloadConfig, "grad_accum", 2.0, "an int >= 1"),
    (OffloadConfig, "max_grad_norm", 0.0, "None or a finite number > 0"),
    (OffloadConfig, "max_grad_norm", float("inf"), "None or a finite number > 0"),
    (OffloadConfig, "device", "tpu", "'cuda', 'cuda:N' or 'cpu'"),
    (OffloadConfig, "activation_checkpointing", "some", "'all', 'none', 'auto' or an int >= 0"),
    (OffloadConfig, "activation_checkpointing", True, "'all', 'none', 'auto' or an int >= 0"),
    (OffloadConfig, "gpu_memory_budget", -1, "None or an int > 0"),
    (OffloadConfig, "offload_all", 1, "True or False"),
    (OffloadConfig, "sr_seed", -3, "an int >= 0"),
    (EngineTuning, "device_layers", 1, "an int >= 2"),
    (EngineTuning, "num_threads", 0, "None or an int >= 1"),
    (EngineTuning, "host_nice", 20, r"an int in \[0, 19\]"),
    (EngineTuning, "device_redo_layers", -1, "None or an int >= 0"),
    (EngineTuning, "async_step", "yes", "None, True or False"),
])
def test_an_out_of_range_field_is_refused_with_its_name_and_range(cls, name, bad, says) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be {says}.*, got {re.escape(repr(bad))}$"):
        cls(**{name: bad})


def test_a_size_string_budget_is_read_as_bytes() -> None:
    assert OffloadConfig(gpu_memory_budget="20GB").gpu_memory_budget == 20 * 10**9
    assert OffloadConfig(gpu_memory_budget="1GiB").gpu_memory_budget == 1 << 30


def test_replace_routes_each_name_to_its_level_and_keeps_the_rest() -> None:
    base = OffloadConfig(precision="mixed", tuning=EngineTuning(num_threads=3))
    changed = base.replace(grad_accum=4, device_layers=3)
    assert (changed.precision, changed.grad_accum) == ("mixed", 4)
    assert (changed.tuning.num_threads, changed.tuning.device_layers) == (3, 3)
    assert base.grad_accum == 1 and base.tuning.device_layers == 2  # frozen: the original is untouched


def test_the_offloader_keeps_the_config_it_was_built_from() -> None:
    from helpers import tiny_llama

    config = OffloadConfig(device="cpu", precision="mixed", tuning=EngineTuning(backend="python"))
    off = offload_ext.Offloader(tiny_llama(layers=2), config=config, grad_accum=2)
    try:
        assert off.config == config.replace(grad_accum=2)
        assert (off.precision, off.backend_name, off.grad_accum) == ("mixed", "python", 2)
    finally:
        off.close()


def test_the_command_line_builds_the_same_config_as_the_api() -> None:
    args = _cpu_args(["--precision", "mixed", "--grad-accum", "2", "--max-grad-norm", "1.0", "--device-layers", "3",
                      "--accumulate-on", "host", "--gpu-memory-budget", "2GB", "--seed", "7",
                      "--tuning", "num_threads=2,device_redo_layers=0,pin_threads=false,async_step=auto"])
    got = offload_config(args, torch.device("cpu"))
    want = OffloadConfig(precision="mixed", device=torch.device("cpu"), grad_accum=2, max_grad_norm=1.0,
                         gpu_memory_budget=2 * 10**9, sr_seed=7,
                         tuning=EngineTuning(device_layers=3, accumulate_on_device=False, num_threads=2,
                                             device_redo_layers=0, pin_threads=False, async_step=None))
    assert got == want


def test_a_bad_tuning_flag_is_one_line_naming_the_field() -> None:
    args = _cpu_args(["--tuning", "num_threads=0"])
    with pytest.raises(UsageError, match=r"EngineTuning\.num_threads must be None or an int >= 1, got 0"):
        offload_config(args, torch.device("cpu"))
    with pytest.raises(SystemExit):
        parse_args(["--tuning", "num_thread=2"])
