"""The model's own files before any weights load (issue 23, categories 5 and 6): a model that is not a
causal LM is refused naming its model_type; a weight file cut short or missing is named with the fix;
an embedding smaller than the tokenizer's ids is refused before the model loads (on main: an
IndexError at step 1). Configs are written with transformers' own config classes; no weights load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune import preflight
from finetune.errors import ConfigError, UserError
from finetune.launch import accelerate as launcher

ACCEPTED = "accepted: decoder-only models with a causal-LM class in transformers (MODEL_FOR_CAUSAL_LM_MAPPING"


def preflight_problems(tmp_path: Path, model: Path, *extra: str) -> list[str]:
    """`finetune train`'s preflight on the demo recipe with this model (the run directory is new)."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n' * 4)
    args = [str(launcher.TRAIN_SCRIPT), "--recipe", "demo", f"--model.name_or_path={model}", f"--data.path={data}"]
    args += extra
    try:
        preflight.check_launch([*args, "--eval.exact_match=false", f"--run.output_dir={tmp_path / 'run'}"])
    except ConfigError as e:
        return e.problems
    return []


def config_dir(tmp_path: Path, name: str, config) -> Path:
    folder = tmp_path / name
    config.save_pretrained(folder)
    return folder


def test_an_encoder_model_is_refused_naming_its_model_type(tmp_path):
    """On main a BERT checkpoint loaded as BertLMHeadModel with is_decoder false and trained with
    attention that sees the answer."""
    from transformers import BertConfig

    bert = config_dir(tmp_path, "bert", BertConfig(architectures=["BertForMaskedLM"]))
    assert preflight_problems(tmp_path, bert) == [
        f"model.name_or_path: {bert / 'config.json'}: model_type 'bert' (BertForMaskedLM) is an encoder (is_decoder: "
        "false): its attention sees every position, the answer included, so trained as a causal LM it would learn "
        f"to copy, not to predict; {ACCEPTED}: llama, mistral, qwen2, gemma, phi3, gpt2 and "
        f"{len(__import__('transformers').models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - 6} more)"
    ]
    # control: the same family trained as a decoder (is_decoder: true) is a causal LM
    decoder = config_dir(tmp_path, "bert-decoder", BertConfig(is_decoder=True, architectures=["BertLMHeadModel"]))
    assert preflight_problems(tmp_path, decoder) == []


def test_encoder_decoder_and_non_causal_model_types_are_refused(tmp_path):
    from transformers import BartConfig, GPTNeoXConfig, T5Config

    bart = config_dir(tmp_path, "bart", BartConfig(architectures=["BartForConditionalGeneration"]))
    (msg,) = preflight_problems(tmp_path, bart)
    assert "model_type 'bart' (BartForConditionalGeneration) is an encoder-decoder (seq2seq) model" in msg
    t5 = config_dir(tmp_path, "t5", T5Config())
    (msg,) = preflight_problems(tmp_path, t5)
    assert "model_type 't5' has no causal-LM class in transformers, so it cannot be fine-tuned here" in msg
    # control: GPT-NeoX's config class has is_decoder false too, but its architecture is a causal LM
    neox = config_dir(tmp_path, "neox", GPTNeoXConfig(architectures=["GPTNeoXForCausalLM"]))
    assert preflight_problems(tmp_path, neox) == []


def test_a_truncated_safetensors_file_is_named_before_loading(tmp_path, tiny_model_dir):
    """On main: safetensors' "incomplete metadata, file not fully covered" traceback, after the run
    directory was made."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    assert preflight_problems(tmp_path, model) == []  # control: whole
    weights.write_bytes(weights.read_bytes()[: size // 2])
    (msg,) = preflight_problems(tmp_path, model)
    assert msg.startswith(f"model.name_or_path: {weights}: {size // 2:,} bytes, but its header describes {size:,}")
    assert "cut short (truncated); copy or download the model again" in msg
    weights.write_bytes(b"\x10\x00")  # shorter than the header itself
    assert "too short for the safetensors header" in preflight_problems(tmp_path, model)[0]


def test_a_model_folder_without_a_tokenizer_is_named_before_launch(tmp_path, tiny_model_dir):
    """On main: launched, a run directory made, then transformers' "Couldn't instantiate the backend tokenizer ...
    You need to have sentencepiece or tiktoken installed"."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    assert preflight_problems(tmp_path, model) == []  # control: with its tokenizer
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    (msg,) = preflight_problems(tmp_path, model)
    assert msg.startswith(f"model.name_or_path: {model}: no tokenizer file (tokenizer.json, "), msg
    assert "model.tokenizer_name_or_path" in msg
    assert preflight_problems(tmp_path, model, f"--model.tokenizer_name_or_path={tiny_model_dir}") == []
    (msg,) = preflight_problems(tmp_path, tiny_model_dir, f"--model.tokenizer_name_or_path={model}")
    assert msg.startswith(f"model.tokenizer_name_or_path: {model}: no tokenizer file"), msg


def test_a_config_without_model_type_is_named_as_such_with_the_type_its_class_has(tmp_path, tiny_model_dir):
    """On main: "model_type None (LlamaForCausalLM) has no causal-LM class in transformers", as if llama were not one."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    del config["model_type"]
    (model / "config.json").write_text(json.dumps(config))
    (msg,) = preflight_problems(tmp_path, model)
    assert msg.startswith(f"model.name_or_path: {model}/config.json: has no model_type, which transformers needs"), msg
    assert 'add "model_type": "llama" (the type of LlamaForCausalLM)' in msg, msg


def test_a_missing_or_cut_shard_of_an_index_is_named(tmp_path, tiny_model_dir):
    from finetune.preflight import model_files

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_files.weights_problem(model) == (
        f"{model / 'model-00002-of-00002.safetensors'}: missing (listed in model.safetensors.index.json); copy or "
        "download the model again (a hub model: `hf download <id>`), or re-save it with save_pretrained"
    )
    shutil.copy(model / "model-00001-of-00002.safetensors", model / "model-00002-of-00002.safetensors")
    assert model_files.weights_problem(model) is None  # control


def test_a_truncated_pytorch_bin_is_named(tmp_path):
    import torch

    from finetune.preflight import model_files

    model = tmp_path / "model"
    model.mkdir()
    torch.save({"w": torch.zeros(1000)}, model / "pytorch_model.bin")
    assert model_files.weights_problem(model) is None
    data = (model / "pytorch_model.bin").read_bytes()
    (model / "pytorch_model.bin").write_bytes(data[: len(data) - 100])
    assert "no zip directory at its end: cut short (truncated)" in model_files.weights_problem(model)


def test_an_embedding_smaller_than_the_tokenizer_is_refused_before_the_model_loads(tmp_path, tokenizer):
    """On main: IndexError ("index out of range in self") at step 1."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from finetune.data.build import build_datasets
    from finetune.preflight import model_files

    small = config_dir(tmp_path, "small-vocab", LlamaConfig(vocab_size=1000, architectures=["LlamaForCausalLM"]))
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "Add 2 and 3.", "output": "5"}\n' * 2)
    data_cfg = SimpleNamespace(path=str(data), format="auto", split="train", max_length=128, eval_fraction=0.0)
    bundle = build_datasets(data_cfg, tokenizer, seed=0)
    model_cfg = SimpleNamespace(
        name_or_path=str(small), revision=None, trust_remote_code=False, tokenizer_name_or_path=None
    )
    with pytest.raises(UserError) as err:
        model_files.check_vocabulary(model_cfg, tokenizer, bundle)
    highest = max(max(ids) for ids in bundle.train["input_ids"])
    assert str(err.value) == (
        f"model.name_or_path: {small}: the model's embedding has 1,000 rows (config.json vocab_size) but the tokenizer "
        f"({small}, {len(tokenizer):,} tokens) gives token id {highest:,} ({tokenizer.convert_ids_to_tokens(highest)!r}) "
        "to this run: training would stop at step 1 with an IndexError. Use the tokenizer that belongs to this model "
        "(model.tokenizer_name_or_path), or resize the model's embeddings to the tokenizer "
        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) and fine-tune that"
    )
    fits = config_dir(tmp_path, "fits", LlamaConfig(vocab_size=len(tokenizer)))
    model_files.check_vocabulary(SimpleNamespace(**{**vars(model_cfg), "name_or_path": str(fits)}), tokenizer, bundle)


# --- model files that would run code: refused in the project's words, before any weights load ---------


def _custom_code_model(tmp_path: Path, tiny_model_dir: Path, model_type: str = "my_arch") -> Path:
    """The tiny model whose config.json asks for its own code (auto_map), and that code, which would
    leave a file behind if it ever ran."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "custom-model")
    values = json.loads((model / "config.json").read_text())
    values["model_type"] = model_type
    values["auto_map"] = {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyLM"}
    (model / "config.json").write_text(json.dumps(values))
    for module in ("configuration_my", "modeling_my"):
        (model / f"{module}.py").write_text(f"open({str(tmp_path / 'code-ran')!r}, 'w').write('{module}')\n")
    return model


def test_a_model_asking_for_its_own_code_without_trust_is_refused_naming_the_file_and_the_setting(
    tmp_path, tiny_model_dir
):
    """Before: not executed, but a transformers ValueError traceback, exit 1, naming neither the setting nor the fix."""
    from finetune.modeling.load import code_problem

    model = _custom_code_model(tmp_path, tiny_model_dir)
    (problem,) = preflight_problems(tmp_path, model)
    assert problem.startswith(f"model.name_or_path: {model / 'config.json'}: its auto_map asks for")
    for part in (
        f"AutoModelForCausalLM -> modeling_my.MyLM ({model / 'modeling_my.py'})",
        "which loading it would run",
        "model_type 'my_arch'",
        "model.trust_remote_code: true (--model.trust_remote_code=true)",
    ):
        assert part in problem, problem
    assert not (tmp_path / "code-ran").exists()
    assert code_problem(model, trust=True) is None  # trusted explicitly: the user's choice
    # a model_type transformers has loads its own class: the folder's code is not needed, nothing runs
    assert code_problem(_custom_code_model(tmp_path / "known", tiny_model_dir, "llama"), trust=False) is None


def test_a_tokenizer_asking_for_its_own_code_is_refused_too(tmp_path, tiny_model_dir):
    tok = shutil.copytree(tiny_model_dir, tmp_path / "tok")
    values = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "config.json").unlink()
    values.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]})
    (tok / "tokenizer_config.json").write_text(json.dumps(values))
    problems = preflight_problems(tmp_path, tiny_model_dir, f"--model.tokenizer_name_or_path={tok}")
    assert any(
        p.startswith(f"model.tokenizer_name_or_path: {tok / 'tokenizer_config.json'}") and "tokenization_my.py" in p
        for p in problems
    ), problems


def _pickled_code(path: Path, *, zip_format: bool) -> Path:
    """A pytorch_model.bin holding the tiny tensors and an object whose unpickling calls os.system."""
    import os
    import pickle

    import torch

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(path.parent / "code-ran"),))

    path.parent.mkdir(parents=True)
    if zip_format:
        torch.save({"w": torch.zeros(4), "x": Payload()}, path)
    else:
        path.write_bytes(pickle.dumps({"w": [0.0] * 4, "x": Payload()}))
    return path


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch.save", "plain pickle"])
def test_pickled_weights_naming_code_are_refused_naming_the_file_and_what_it_would_call(tmp_path, zip_format):
    """Before: weights-only loading refused it, as a library traceback (exit 1) that named no fix."""
    from finetune.preflight import model_files

    weights = _pickled_code(tmp_path / "model" / "pytorch_model.bin", zip_format=zip_format)
    problem = model_files.weights_problem(weights.parent)
    assert problem and problem.startswith(f"{weights}: a pickle that names code outside torch's weights-only")
    assert "(posix.system)" in problem and "model.safetensors" in problem and "weights_only=False" in problem
    assert not (tmp_path / "model" / "code-ran").exists()


def test_finetune_plan_refuses_a_model_folder_that_needs_its_own_code(tmp_path, tiny_model_dir):
    """Before: `finetune plan --model DIR` ended in transformers' ValueError traceback (exit 1)."""
    from finetune.planning.model_source import read_config

    model = _custom_code_model(tmp_path, tiny_model_dir)
    with pytest.raises(UserError, match=r"--model: .*config.json: its auto_map asks for .*`finetune plan` runs no"):
        read_config(str(model))
    assert not (tmp_path / "code-ran").exists()


def test_max_length_above_the_models_positions_is_refused_with_both_numbers(tmp_path):
    """On main: data.max_length past max_position_embeddings trained silently on positions the model
    does not have."""
    from transformers import GPTNeoXConfig

    neox = config_dir(tmp_path, "neox", GPTNeoXConfig(architectures=["GPTNeoXForCausalLM"], max_position_embeddings=64))
    assert preflight_problems(tmp_path, neox, "--data.max_length=128") == [
        f"data.max_length: 128 is more than the 64 positions the model has ({neox / 'config.json'} "
        "max_position_embeddings); set data.max_length to 64 or less, or use a model with a longer context"
    ]
    assert preflight_problems(tmp_path, neox, "--data.max_length=64") == []  # control
    (msg,) = preflight_problems(tmp_path, "bundled:SmolLM2-135M-Instruct", "--data.max_length=9000")
    assert msg.startswith("data.max_length: 9000 is more than the 8192 positions the model has (the bundled model")
