"""offload-train --task sft: the loss on the assistant turns only, packed examples that do not see each other, a
stream that resumes where it stopped, and runs on the embedded chat default and on chat files."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import tiny_llama
from offload_ext.train import chat
from offload_ext.train import cli as train

CHAT = [{"role": "user", "content": "aa bb"}, {"role": "assistant", "content": "cc"}]


def _encode(texts: list[str]) -> list[list[int]]:
    """A toy tokenizer: one id per character."""
    return [[ord(c) % 120 + 1 for c in t] for t in texts]


def test_only_the_assistants_tokens_and_the_closing_end_of_text_carry_loss() -> None:
    ids, mask = chat.encode_chat(CHAT, _encode, eos=0, template=None)
    text = "User: aa bb\nAssistant: cc"
    assert ids.tolist() == [i for piece in _encode([text]) for i in piece] + [0]
    assert "".join(c for c, m in zip(text + "$", mask) if m) == "cc$"  # "cc" and the end-of-text token


def test_a_chat_template_marks_the_turns_it_renders() -> None:
    template = lambda ms: "".join(f"<{m['role']}>{m['content']}" for m in ms)  # noqa: E731
    ids, mask = chat.encode_chat(CHAT, _encode, eos=0, template=template)
    rendered = template(CHAT)
    assert len(ids) == len(rendered)
    assert "".join(c for c, m in zip(rendered, mask) if m) == "<assistant>cc"


def test_packed_rows_restart_positions_and_mask_each_examples_first_token() -> None:
    examples = [(np.arange(1, 4), np.array([False, True, True])), (np.arange(5, 10), np.ones(5, dtype=bool))]
    (row,) = chat.pack(examples, [0, 1], seq_len=10, pad=99)
    ids, labels, positions, segments = row
    assert ids.tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 99, 99]
    assert labels.tolist() == [-100, 2, 3, -100, 6, 7, 8, 9, -100, -100]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0] and segments.tolist()[-2:] == [-1, -1]


def test_packed_examples_do_not_see_each_other() -> None:
    torch.manual_seed(0)
    model = tiny_llama(layers=2).float().eval()
    examples = [(torch.randint(1, 100, (n,)).numpy(), np.ones(n, dtype=bool)) for n in (5, 7, 3)]
    stream = chat.ChatStream(1, 16, seed=0, examples=examples, pad=0)
    batch = stream.next_batch()
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       attention_mask=batch.attention_mask).logits[0]
        starts = (batch.position_ids[0] == 0).nonzero().flatten().tolist()  # each example's, then the padding's
        assert len(starts) == 4 and starts[-1] == 15  # 5 + 7 + 3 tokens, one of padding
        for segment, (at, end) in enumerate(zip(starts, starts[1:])):
            n = end - at
            alone = model(input_ids=batch.input_ids[:, at:end]).logits[0]
            # fp32 on the CPU; attention over the same keys, the masked ones weighted exactly 0: the same logits
            # up to the summation order of a longer masked row (a few ulps)
            assert torch.allclose(packed[at:at + n], alone, atol=1e-5), segment


def test_the_stream_resumes_at_the_batch_it_stopped_at() -> None:
    examples = [(np.arange(1, 2 + k % 7), np.ones(1 + k % 7, dtype=bool)) for k in range(40)]
    whole = chat.ChatStream(2, 12, seed=3, examples=examples, pad=0)
    batches = [whole.next_batch() for _ in range(12)]  # several epochs, each packed in its own order
    resumed = chat.ChatStream(2, 12, seed=3, examples=examples, pad=0)
    resumed.restore({"batches_done": 7})
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches[7:], [resumed.next_batch()
                                                                                  for _ in range(5)]))


FAST = ["--device", "cpu-sim", "--model", "tiny", "--steps", "20", "--batch-size", "4", "--seq-len", "64"]


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_on_the_embedded_chats_learns(tmp_path) -> None:
    train.run(train.parse_args(["--task", "sft", "--out", str(tmp_path), *FAST]))
    losses = _losses(tmp_path)
    assert len(losses) == 20 and np.mean(losses[-5:]) < losses[0] - 0.5


@pytest.mark.parametrize("rows", [
    [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
     for w in ("alpha", "beta", "gamma", "delta") * 20],
    [{"prompt": f"say {w}", "completion": w} for w in ("alpha", "beta", "gamma", "delta") * 20],
], ids=["messages", "prompt-completion"])
def test_sft_on_a_chat_file_learns(tmp_path, rows) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    train.run(train.parse_args(["--task", "sft", "--dataset", str(data), "--out", str(out), *FAST,
                                "--tokenizer", str(_embedded_tokenizer(tmp_path))]))
    losses = _losses(out)
    assert np.mean(losses[-5:]) < losses[0] - 0.5


def test_a_file_without_chat_columns_is_one_line_naming_them(tmp_path, capsys) -> None:
    data = tmp_path / "plain.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(SystemExit) as exited:
        train.main(["--task", "sft", "--dataset", str(data), "--out", str(tmp_path / "o"), *FAST,
                    "--tokenizer", str(_embedded_tokenizer(tmp_path))])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "expected a 'messages' column" in err and "its columns are ['text']" in err


def _embedded_tokenizer(tmp_path) -> object:
    """The embedded corpus's tokenizer, as a tokenizer.json file (what --tokenizer takes)."""
    path = tmp_path / "tok" / "tokenizer.json"
    if not path.exists():
        train.run(train.parse_args(["--out", str(tmp_path / "tok"), *FAST, "--steps", "1"]))
    return path
