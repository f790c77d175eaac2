"""Issue 27 item 10: the label boundary rules, as docs/data.md states them, on the bundled model's
tokenizer and chat template; the bundled model as README.md states it."""

from __future__ import annotations

from types import SimpleNamespace

from finetune.data.render import IGNORE_INDEX, Renderer, tokenize
from tests.conftest import REPO

DOC = (REPO / "docs" / "data.md").read_text()


def _trained(tokenizer, row: dict, *, chat: bool) -> list[tuple[str, bool]]:
    cfg = SimpleNamespace(train_on_prompt=False, system_prompt=None, chat_template=chat)
    (example,) = tokenize([Renderer(tokenizer, "prompt_completion", cfg, "rows").render(row)], tokenizer)
    return [(tokenizer.decode([i]), label != IGNORE_INDEX) for i, label in zip(example.input_ids, example.labels)]


def test_the_newline_after_the_assistant_header_is_not_trained_and_the_end_of_turn_is(tokenizer):
    tokens = _trained(tokenizer, {"prompt": "Add 2 and 3.", "completion": "5"}, chat=True)
    header = max(i for i, (t, _) in enumerate(tokens) if t == "<|im_start|>")
    assert [t for t, _ in tokens[header:]] == ["<|im_start|>", "ass", "istant", "\n", "5", "<|im_end|>", "\n"]
    assert [trained for _, trained in tokens[header:]] == [False, False, False, False, True, True, True]
    assert not any(trained for _, trained in tokens[:header])
    assert "the newline after it, is not trained" in " ".join(DOC.split())


def test_a_token_across_the_prompt_completion_join_is_not_trained(tokenizer):
    tokens = _trained(tokenizer, {"prompt": "The answer is fif", "completion": "teen apples"}, chat=False)
    assert (" fifteen", False) in tokens  # half prompt, half completion: one token, not trained
    assert (" apples", True) in tokens
    # control: the same words with the join on a token boundary train the completion's first word
    aligned = _trained(tokenizer, {"prompt": "The answer is", "completion": " fifteen apples"}, chat=False)
    assert (" fifteen", True) in aligned
    text = " ".join(DOC.split())
    assert "A token across the prompt/completion join is not trained." in text and "TRL's SFTTrainer" in text


def test_the_bundled_model_is_the_q4_1_gguf_dequantized_to_float32(bundled_model_dir):
    import json

    from finetune.modeling import bundled

    assert bundled.GGUF_MEMBER.endswith(".Q4_1.gguf")
    config = json.loads((bundled_model_dir / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "Q4_1 GGUF file" in readme and "dequantized once to a float32 safetensors directory" in readme
