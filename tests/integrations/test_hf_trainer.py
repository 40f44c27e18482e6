"""OffloadTrainer: transformers' Trainer with the Offloader as its optimizer trains as Trainer does without offload
(torch's fused AdamW on the same bf16 parameters), logs the global gradient norm, clips by it, and resumes from
its checkpoints exactly. On the simulated device (TrainingArguments(use_cpu=True))."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers import tiny_llama

transformers = pytest.importorskip("transformers")
from offload_ext.integrations.hf_trainer import OffloadTrainer  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 16, vocab: int = 128) -> None:
        gen = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _args(out, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=1e-3, weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, seed=0, optim="adamw_torch_fused", lr_scheduler_type="linear",
                dataloader_drop_last=True)
    return transformers.TrainingArguments(**(base | kw))


def _run(trainer_cls, model, args, **kw) -> list[dict]:
    trainer = trainer_cls(model=model, args=args, train_dataset=_Tokens(), **kw)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], trainer


def test_offload_trainer_trains_as_trainer_does_without_offload(tmp_path) -> None:
    model = tiny_llama(layers=3).bfloat16()
    ref = copy.deepcopy(model)
    ours, trainer = _run(OffloadTrainer, model, _args(tmp_path / "a", max_grad_norm=0.0))
    theirs, _ = _run(transformers.Trainer, ref, _args(tmp_path / "b", max_grad_norm=0.0))
    # The same forward and backward on the same bf16 weights, and the host AdamW's rule is torch's fused one:
    # every logged loss is the same number.
    assert [h["loss"] for h in ours] == [h["loss"] for h in theirs]
    trainer.offloader.close()


def test_offload_trainer_logs_the_global_norm_and_clips_by_it(tmp_path) -> None:
    model = tiny_llama(layers=3).bfloat16()
    ref = copy.deepcopy(model)
    ours, trainer = _run(OffloadTrainer, model, _args(tmp_path / "a", max_grad_norm=0.5))
    theirs, _ = _run(transformers.Trainer, ref, _args(tmp_path / "b", max_grad_norm=0.5))
    # Trainer's clip_grad_norm_ sums each gradient's norm in its own dtype (bf16: 8 bits of mantissa, a relative
    # error up to 2^-8 per tensor, and so in the total); the Offloader's sums squares in float64. The first
    # step's norms are of the same gradients: they agree within 2^-8.
    assert math.isclose(ours[0]["grad_norm"], theirs[0]["grad_norm"], rel_tol=2**-8)
    assert all(h["grad_norm"] > 0.5 for h in ours) == all(h["grad_norm"] > 0.5 for h in theirs)
    assert trainer.offloader.last_clip_action in ("committed", "redone", "clipped", "unclipped")
    # Later steps follow weights clipped by scales that differ in the last bits: the losses stay within 1 %.
    for a, b in zip(ours, theirs):
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.01), (a, b)
    trainer.offloader.close()


def test_the_trainer_logs_the_measured_device_redo_count_once_with_the_config_that_fixes_it(tmp_path,
                                                                                             caplog) -> None:
    # One micro-batch a step, every step clipped: the redone steps measure one of the three layers on the device
    # and none, then keep one; the log line says which and how to fix it.
    import logging

    from offload_ext.engine.redo_tuning import SAMPLES, WARMUP

    steps = WARMUP + 2 * SAMPLES + 2
    args = _args(tmp_path, gradient_accumulation_steps=1, max_grad_norm=1e-3, max_steps=steps)
    with caplog.at_level(logging.INFO, logger="offload_ext.integrations.hf_trainer"):
        _, trainer = _run(OffloadTrainer, tiny_llama(layers=3).bfloat16(), args)
    told = [r.getMessage() for r in caplog.records if "device redo of clipped steps" in r.getMessage()]
    chosen = trainer.offloader.redo_tuning.chosen
    assert len(told) == 1 and f"from_options(device_redo_layers={chosen})" in told[0] and chosen in (0, 1)
    assert trainer.offloader.last_clip_action == "redone"
    trainer.offloader.close()


def test_offload_trainer_resumes_from_its_checkpoint_exactly(tmp_path) -> None:
    model = tiny_llama(layers=3).bfloat16()
    fresh = copy.deepcopy(model)
    whole, trainer = _run(OffloadTrainer, model, _args(tmp_path / "a", max_grad_norm=1.0, save_strategy="steps",
                                                       save_steps=2))
    trainer.offloader.close()
    resumed_trainer = OffloadTrainer(model=fresh, args=_args(tmp_path / "a", max_grad_norm=1.0),
                                     train_dataset=_Tokens())
    resumed_trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    resumed = [h for h in resumed_trainer.state.log_history if "loss" in h]
    assert [h["loss"] for h in resumed if h["step"] > 2] == [h["loss"] for h in whole if h["step"] > 2]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-4")
    assert loaded.config.num_hidden_layers == 3
    resumed_trainer.offloader.close()


def _checkpoints_2_and_4_the_last_cut_short(out) -> list[dict]:
    """A run saving at steps 2 and 4, then killed in checkpoint-4's save before Trainer's last file: its losses."""
    whole, trainer = _run(OffloadTrainer, tiny_llama(layers=3).bfloat16(),
                          _args(out, max_grad_norm=1.0, save_strategy="steps", save_steps=2))
    trainer.offloader.close()
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    return whole


def test_resume_true_continues_from_the_newest_whole_checkpoint_and_names_the_one_cut_short(tmp_path, caplog) -> None:
    import logging

    whole = _checkpoints_2_and_4_the_last_cut_short(tmp_path / "a")
    trainer = OffloadTrainer(model=tiny_llama(layers=3).bfloat16(), args=_args(tmp_path / "a", max_grad_norm=1.0),
                             train_dataset=_Tokens())
    with caplog.at_level(logging.WARNING, logger="offload_ext.integrations.trainer_checkpoints"):
        trainer.train(resume_from_checkpoint=True)
    told = [r.getMessage() for r in caplog.records if r.name == "offload_ext.integrations.trainer_checkpoints"]
    assert told == [f"OffloadTrainer: not resuming from {tmp_path / 'a' / 'checkpoint-4'}: it has no "
                    "trainer_state.json, the file Trainer writes last: its save was interrupted"]
    resumed = [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 2]
    assert resumed == [h["loss"] for h in whole if h["step"] > 2]  # steps 3 and 4 again, from checkpoint-2
    trainer.offloader.close()


def test_a_checkpoint_cut_short_is_refused_naming_the_newest_whole_one(tmp_path) -> None:
    _checkpoints_2_and_4_the_last_cut_short(tmp_path / "a")
    torn, whole = tmp_path / "a" / "checkpoint-4", tmp_path / "a" / "checkpoint-2"
    trainer = OffloadTrainer(model=tiny_llama(layers=3).bfloat16(), args=_args(tmp_path / "b"),
                             train_dataset=_Tokens())
    with pytest.raises(ValueError) as refused:
        trainer.train(resume_from_checkpoint=str(torn))
    assert str(refused.value) == (f"OffloadTrainer: resume_from_checkpoint={str(torn)!r}: it has no "
                                  "trainer_state.json, the file Trainer writes last: its save was interrupted; use "
                                  f"resume_from_checkpoint={str(whole)!r}, the newest whole one")
    trainer.offloader.close()


def test_with_no_whole_checkpoint_a_resume_is_refused_saying_to_start_afresh(tmp_path) -> None:
    from offload_ext.integrations.trainer_checkpoints import resume_target

    (tmp_path / "checkpoint-3").mkdir()  # killed before any file of its save landed
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True: no whole checkpoint in .*; start without"):
        resume_target(str(tmp_path), True)
    with pytest.raises(ValueError, match=r"its save was interrupted; no whole checkpoint is beside it: start without"):
        resume_target(str(tmp_path), str(tmp_path / "checkpoint-3"))
    assert resume_target(str(tmp_path), None) is None and resume_target(str(tmp_path), False) is None


def test_what_the_offloader_cannot_honour_is_refused(tmp_path) -> None:
    model = tiny_llama(layers=2).bfloat16()
    with pytest.raises(ValueError, match="optim='adamw_torch'"):
        OffloadTrainer(model=model, args=_args(tmp_path, optim="sgd"), train_dataset=_Tokens())
    with pytest.raises(ValueError, match="the Offloader is the optimizer"):
        OffloadTrainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(),
                       optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


def test_an_accelerate_loop_trains_as_the_offloader_alone() -> None:
    accelerate = pytest.importorskip("accelerate")
    import offload_ext
    from helpers import batches, offloaded_training

    model = tiny_llama(layers=3).bfloat16()
    ref = copy.deepcopy(model)
    data = batches(4)
    accelerator = accelerate.Accelerator(cpu=True)
    off = offload_ext.Offloader(model, lr=1e-3, device="cpu", max_grad_norm=1.0)
    model, opt = accelerator.prepare(model, off)
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)  # a plain loss.backward() underneath
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    off_ref = offload_ext.Offloader(ref, lr=1e-3, device="cpu", max_grad_norm=1.0)
    assert losses == offloaded_training(off_ref, ref, data)
    off.close()
    off_ref.close()


def _chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = "user assistant hello how are you fine thanks what is two plus two four bye".split()
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return fast


def test_trls_sft_trainer_with_the_mixin_trains_as_without_offload(tmp_path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from offload_ext.integrations.hf_trainer import OffloadTrainerMixin

    class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer):
        pass

    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in [("hello how are you", "fine thanks"), ("what is two plus two", "four"),
                          ("hello", "hello"), ("bye", "bye thanks")] * 4]
    data = datasets.Dataset.from_dict({"messages": chats})
    tokenizer = _chat_tokenizer()
    model = tiny_llama(layers=3).bfloat16()
    ref = copy.deepcopy(model)
    runs = []
    for cls, m, out in ((OffloadSFTTrainer, model, "a"), (trl.SFTTrainer, ref, "b")):
        args = trl.SFTConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, optim="adamw_torch_fused", max_grad_norm=0.0, max_length=32,
                             dataloader_drop_last=True)
        trainer = cls(model=m, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        runs.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    # The same chat-templated tokens, forward and backward on the same bf16 weights, torch's AdamW rule: the same
    # losses, every one.
    assert runs[0] == runs[1] and len(runs[0]) == 3


def _gpu(gb: str):
    from offload_ext.planning.plan import machine
    return machine("cuda", host_memory="64GB", gpu_memory=gb)  # a GPU of that size, planned for on any machine


def test_on_a_gpu_the_trainer_plans_its_layout_for_its_micro_batch_as_offload_train_does(tmp_path) -> None:
    from offload_ext.config import OffloadConfig
    from offload_ext.integrations.hf_trainer import trainer_layout
    model, args = tiny_llama(layers=3).bfloat16(), _args(tmp_path)
    roomy = trainer_layout(model, args, OffloadConfig(device="cuda"), 16, _gpu("80GB"))
    # every layer but one resident (a stack keeps one streamed), planned for 2 x 16 tokens
    assert (roomy.resident_layers, roomy.device_layers) == (2, 2) and "batch 2 x 16" in roomy.reason
    cramped = trainer_layout(model, args, OffloadConfig(device="cuda"), 16, _gpu("0.5GB"))
    assert cramped.resident_layers == 0 and "over" in cramped.reason  # the CUDA context alone fills it


def test_the_trainer_takes_trl_s_max_length_and_a_layout_named_in_offload_config_as_given(tmp_path) -> None:
    from offload_ext.config import OffloadConfig
    from offload_ext.integrations.hf_trainer import trainer_layout
    model, args = tiny_llama(layers=3).bfloat16(), _args(tmp_path)
    args.max_length = 24  # TRL's SFTConfig field
    assert "batch 2 x 24" in trainer_layout(model, args, OffloadConfig(device="cuda"), None, _gpu("80GB")).reason
    named = OffloadConfig().replace(device="cuda", resident_layers=1)
    assert trainer_layout(model, args, named, None, _gpu("80GB")) is None


def test_without_a_sequence_length_the_trainer_warns_and_keeps_the_fixed_layout(tmp_path) -> None:
    from offload_ext.config import OffloadConfig
    from offload_ext.integrations.hf_trainer import trainer_layout
    with pytest.warns(UserWarning, match="pass seq_len="):
        got = trainer_layout(tiny_llama(layers=3).bfloat16(), _args(tmp_path), OffloadConfig(device="cuda"), None,
                             _gpu("80GB"))
    assert got is None


def test_on_the_simulated_device_the_trainer_keeps_the_fixed_layout(tmp_path) -> None:
    model = tiny_llama(layers=3).bfloat16()
    trainer = OffloadTrainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(), seq_len=16)
    assert trainer.layout_choice is None and trainer.offloader.layout.resident == ()
    trainer.offloader.close()
