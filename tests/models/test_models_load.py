"""Every checkpoint that transformers' save_pretrained writes streams into the engine: the model's own
conversion mapping (renamed keys, per-expert tensors fused) is applied, so Offloader.from_pretrained trains
exactly like transformers' from_pretrained followed by Offloader."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import offload_ext
from helpers import batches, offloaded_training

LR, WD = 1e-3, 0.01
_SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
CONFIGS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    "gpt_neox": dict(),
}


def _saved(model_type: str, path: str, tied: bool) -> str:
    cfg = AutoConfig.for_model(model_type, **_SHAPE, **CONFIGS[model_type], tie_word_embeddings=tied)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _train(off: offload_ext.Offloader) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = offloaded_training(off, off.model, batches(3))
    weights = off.model_state_dict()
    off.close()
    return losses, weights


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_a_save_pretrained_checkpoint_streams_in_and_trains_like_transformers_loaded_it(tmp_path, model_type,
                                                                                        tied) -> None:
    path = _saved(model_type, str(tmp_path / model_type), tied)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    kw = dict(lr=LR, weight_decay=WD, precision="bf16", backend="native", device="cpu")
    ref_losses, ref_weights = _train(offload_ext.Offloader(ref, **kw))
    losses, weights = _train(offload_ext.Offloader.from_pretrained(path, **kw))
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for name, value in weights.items():
        assert torch.equal(value, ref_weights[name]), name


def test_a_fused_expert_tensor_of_another_shape_is_refused_naming_it(tmp_path) -> None:
    path = _saved("mixtral", str(tmp_path / "m"), tied=False)
    cfg = AutoConfig.from_pretrained(path)
    cfg.intermediate_size = 48
    cfg.save_pretrained(path)
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj.*shape"):
        offload_ext.Offloader.from_pretrained(path, backend="native", device="cpu")


# offload-train --model DIR: what the directory holds decides, never a silent change of the model.

FAST = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--device", "cpu-sim", "--backend", "python"]


@pytest.fixture(autouse=True)
def _no_progress_bar(monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_TRAIN_NO_BAR", "1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A tiny model trained by offload-train: its checkpoint has weights, a config and the saved tokenizer."""
    from offload_ext.train import cli as train

    out = str(tmp_path_factory.mktemp("trained") / "run")
    train.run(train.parse_args(["--out", out, "--model", "tiny", "--steps", "30", "--batch-size", "4",
                                "--seq-len", "32", "--device", "cpu-sim", "--backend", "python"]))
    return os.path.join(out, "latest")


def _first_loss(out: str, *argv: str) -> float:
    from offload_ext.train import cli as train

    train.run(train.parse_args(["--out", out, *argv]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def _refused(argv: list[str], capsys) -> str:
    from offload_ext.train import cli as train

    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_a_model_directory_with_weights_is_fine_tuned_by_default_and_drawn_fresh_only_when_asked(trained,
                                                                                                 tmp_path) -> None:
    default = _first_loss(str(tmp_path / "default"), "--model", trained, *FAST)
    pretrained = _first_loss(str(tmp_path / "pretrained"), "--model", trained, "--pretrained", *FAST)
    scratch = _first_loss(str(tmp_path / "scratch"), "--model", trained, "--from-scratch", *FAST)
    assert default == pretrained
    assert scratch > pretrained + 0.3  # a fresh draw starts near log(vocab), the trained weights below it


def test_the_saved_tokenizer_names_its_special_tokens_as_transformers_users_expect(trained) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained)
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.bos_token_id == 0
    assert tok("a b", padding="max_length", max_length=8)["input_ids"][-1] == tok.pad_token_id
    config = AutoConfig.from_pretrained(trained)
    assert config.eos_token_id == config.bos_token_id == tok.eos_token_id  # generate() stops at it


def test_a_tokenizer_json_file_is_accepted_as_the_tokenizer(trained, tmp_path) -> None:
    from_file = _first_loss(str(tmp_path / "file"), "--model", trained,
                            "--tokenizer", os.path.join(trained, "tokenizer.json"), *FAST)
    from_dir = _first_loss(str(tmp_path / "dir"), "--model", trained, *FAST)
    assert from_file == from_dir


def test_a_tokenizer_larger_than_the_models_embedding_is_refused_naming_both_sizes(trained, tmp_path,
                                                                                   capsys) -> None:
    from transformers import AutoConfig

    small = tmp_path / "small"
    config = AutoConfig.from_pretrained(trained)
    config.vocab_size = 512
    config.save_pretrained(str(small))
    err = _refused(["--out", str(tmp_path / "o"), "--model", str(small), "--tokenizer", trained, *FAST], capsys)
    assert f"--model {small}: the tokenizer has 1024 tokens, more than the model's embedding of 512" in err
    assert "--tokenizer" in err and "Traceback" not in err


def test_lora_on_a_base_drawn_at_random_is_refused_with_the_fix(tmp_path, capsys) -> None:
    err = _refused(["--out", str(tmp_path / "o"), "--model", "tiny", "--lora-r", "4", *FAST], capsys)
    assert "--lora-r: the base model would be drawn at random (--model tiny is a built-in config)" in err
    assert "--pretrained" in err


def test_offload_train_streams_a_mixtral_checkpoint_with_transformers_first_loss(tmp_path) -> None:
    from offload_ext.train import data

    path = str(tmp_path / "mixtral")
    cfg = AutoConfig.for_model("mixtral", **{**_SHAPE, "vocab_size": 512}, **CONFIGS["mixtral"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    tok = data.train_tokenizer(["def f(x):\n    return x + 1\n" * 50], 300, os.path.join(path, "tokenizer.json"))
    data.hf_tokenizer(tok).save_pretrained(path)
    run = ["--model", path, "--pretrained", "--steps", "1", "--batch-size", "2", "--seq-len", "32"]
    streamed = _first_loss(str(tmp_path / "streamed"), *run, "--device", "cpu-sim", "--backend", "native")
    loaded = _first_loss(str(tmp_path / "loaded"), *run, "--device", "cpu", "--backend", "none")
    assert streamed == loaded
