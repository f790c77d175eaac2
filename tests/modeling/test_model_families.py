"""Any causal LM transformers trains (issue 46): the attention implementation is chosen per model family, eager where
the family has no SDPA attention (BLOOM in transformers 5.24: `BloomForCausalLM._supports_sdpa` is false), said in the
start line and run.json; the model folder's own files (generation_config.json, tokenizer_config.json) are read by
preflight and named when broken. Before: a BLOOM folder was refused as "not a transformers model directory", a broken
generation_config.json was ignored without a word and a broken tokenizer_config.json blamed the whole folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from finetune.config.validate import build_config
from finetune.modeling import attention
from finetune.preflight.model_files import model_problems
from tests.training.test_faults import cli_train


def save_tiny_bloom(folder: Path, tokenizer) -> Path:
    """A random 2-layer BLOOM with the bundled model's tokenizer, built from a config (no download)."""
    config = transformers.BloomConfig(
        vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=2, pad_token_id=tokenizer.pad_token_id
    )
    transformers.BloomForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_family_decides_the_attention_implementation():
    assert transformers.BloomForCausalLM._supports_sdpa is False  # the premise, as transformers 5.24 declares it
    chosen, why = attention.for_family("bloom", "sdpa")
    assert chosen == "eager" and why.startswith("BloomForCausalLM (bloom) has no SDPA attention in transformers")
    assert attention.for_family("llama", "sdpa") == ("sdpa", None)
    assert attention.for_family("bloom", "eager") == ("eager", None)
    with pytest.raises(Exception, match="model.attn_implementation: flash_attention_2, but BloomForCausalLM"):
        attention.for_family("bloom", "flash_attention_2")


@pytest.mark.integration
def test_a_family_without_sdpa_trains_with_eager_attention_and_says_so(tmp_path, tokenizer):
    model = save_tiny_bloom(tmp_path / "tiny-bloom", tokenizer)
    run_dir = tmp_path / "run"
    args = [
        *("--recipe", "demo", f"--model.name_or_path={model}", "--data.demo_train_size=16"),
        *("--eval.exact_match=false", "--training.max_steps=2", "--training.per_device_train_batch_size=4"),
    ]
    code, out, _ = cli_train(args, run_dir=run_dir, env={})
    assert code == 0, out[-4000:]  # before: exit 2, "is not a transformers model directory"
    said = "attention: BloomForCausalLM (bloom) has no SDPA attention in transformers"
    assert said in out, out[-4000:]  # the start line
    attn = json.loads((run_dir / "run.json").read_text())["speed"]["attention"]
    assert attn["implementation"] == "eager" and attn["requested"] == "sdpa", attn
    assert attn["fallback"].startswith("BloomForCausalLM (bloom) has no SDPA") and attn["sdpa_backends_enabled"] is None
    code, out, _ = cli_train([*args, "--data.padding_free=true"], run_dir=tmp_path / "run2", env={})
    assert code == 2 and "its own attention was not checked to keep examples apart" in out, out[-4000:]


BROKEN = {
    "generation_config.json": (lambda t: t[: len(t) // 2], "not valid JSON (line"),
    "tokenizer_config.json": (lambda t: t.replace("{", "[", 1), "not valid JSON (line"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_file_of_the_model_folder_is_named(tmp_path, tiny_model_dir, name):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    cut, said = BROKEN[name]
    (model / name).write_text(cut((model / name).read_text()))
    problems = model_problems(build_config({"model": {"name_or_path": str(model)}}))
    assert len(problems) == 1 and problems[0].startswith(f"model.name_or_path: {model / name}: {said}"), problems


def test_generation_config_values_transformers_refuses_are_named(tmp_path, tiny_model_dir):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    values = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**values, "eos_token_id": "</s>"}))
    problems = model_problems(build_config({"model": {"name_or_path": str(model)}}))
    assert problems == [
        f"model.name_or_path: {model}/generation_config.json: eos_token_id '</s>' is not a token id (an integer >= 0; "
        "eos_token_id may be a list of them)"
    ], problems
