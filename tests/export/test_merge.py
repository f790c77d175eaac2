"""The shard-by-shard merge (finetune/export/merge.py) against peft's own merge_and_unload of the whole model, in fp32:
plain LoRA with rank and alpha patterns, rsLoRA, GPT-2's fan_in_fan_out layers; the shards and their index load with
transformers; QLoRA's 4-bit round trip equals the weights a 4-bit base holds; what it cannot fold is refused.
Controls: a merge with another scaling convention, and a requantization with another quant type, differ."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.errors import UserError
from finetune.export import merge


def _lora_model(base_dir, config):
    """The base with a LoRA whose B is random (peft initialises it to zero: a merge of zeros proves nothing)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.05)
    return model


def _merged_both_ways(tmp_path, base_dir, config) -> tuple[dict, dict]:
    """(ours: name -> tensor, peft merge_and_unload's state dict), the adapter saved as a run saves it."""
    from safetensors.torch import load_file

    model = _lora_model(base_dir, config)
    model.save_pretrained(tmp_path / "adapter")
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    saved_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    ours = dict(merge.merged_tensors(base_dir, adapter, merge.lora_config(saved_config)))
    return ours, model.merge_and_unload().state_dict()


def _sharded_base(tmp_path, tiny_model_dir):
    """The tiny model saved in several shards, as a large base is."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded-base"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).save_pretrained(
        folder, max_shard_size="200KB"
    )
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) >= 3
    return folder


@pytest.mark.parametrize(
    "options",
    [
        {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 64}},
        {"use_rslora": True},
    ],
    ids=["rank-and-alpha-patterns", "rslora"],
)
def test_merge_equals_peft_merge_and_unload(tmp_path, tiny_model_dir, options):
    from peft import LoraConfig

    base = _sharded_base(tmp_path, tiny_model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM", **options)
    ours, reference = _merged_both_ways(tmp_path, base, config)
    assert set(reference) - set(ours) <= {"lm_head.weight"}  # tied: saved once, as the embedding
    merged = [k for k in ours if k.endswith("proj.weight")]
    assert len(merged) == 14  # 7 linear layers x 2 decoder layers
    worst = max((ours[k] - reference[k]).abs().max().item() for k in ours)
    assert worst == 0.0, worst  # peft's own layer does the arithmetic: bit for bit
    # control: the alpha-over-r convention matters; alpha alone (a common mistake) moves the weights
    from safetensors.torch import load_file

    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    a = adapter["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    from safetensors import safe_open

    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(base / index[key]), "pt") as f:
        wrong = f.get_tensor(key) + 16 * (b @ a)
    assert (wrong - reference[key]).abs().max().item() > 1e-2


def test_fan_in_fan_out_layers_merge_as_peft_does(tmp_path):
    """GPT-2's Conv1D keeps its weight as [in, out]: peft transposes the LoRA delta (fan_in_fan_out)."""
    from peft import LoraConfig
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    ours, reference = _merged_both_ways(tmp_path, tmp_path / "gpt2", config)
    worst = max((ours[k] - reference[k]).abs().max().item() for k in ours if k in reference)
    assert worst == 0.0 and any(k.endswith("c_attn.weight") for k in ours)


def test_what_it_cannot_fold_is_refused_by_name():
    with pytest.raises(UserError, match="use_dora.*plain LoRA"):
        merge.lora_config({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True})
    with pytest.raises(UserError, match="init_lora_weights='pissa'"):
        merge.lora_config({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "init_lora_weights": "pissa"})
    from finetune.export import sources

    with pytest.raises(UserError, match="not LoRA A/B pairs.*lora_magnitude_vector"):
        sources.adapter_modules(["base_model.model.m.lora_A.weight", "base_model.model.m.lora_magnitude_vector"])


def test_shards_stay_under_the_limit_and_load_with_transformers(tmp_path, tiny_model_dir):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    limit = 1_000_000
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    layout = [(k, list(v.shape), "float32") for k, v in state.items()]
    writer = merge.ShardWriter(tmp_path, limit, torch.bfloat16, layout)
    for name, tensor in state.items():
        writer.add(name, tensor)
    files = writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files[-1] == "model.safetensors.index.json" and set(index["weight_map"]) == set(state)
    for name in files[:-1]:
        with safe_open(str(tmp_path / name), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 2 for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1, (name, sizes)  # a larger tensor alone in its file
    AutoConfig.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], state[k].to(torch.bfloat16).float()) for k in state)


def test_qlora_requantization_is_the_4bit_base_the_run_trained_on(tiny_model_dir):
    """Every weight transformers quantizes, dequantized from a real 4-bit load, equals the round trip the merge
    computes; the output head (kept in full precision by transformers) is left alone."""
    import bitsandbytes.functional as bnb
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, quantization_config=quant)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    round_trip = merge.requantizer(tiny_model_dir, quant.to_dict(), "float32")
    checked = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit":
            held = bnb.dequantize_4bit(weight.data, weight.quant_state).float()
            assert torch.equal(round_trip(f"{name}.weight", base[f"{name}.weight"]), held), name
            checked += 1
    assert checked == 14
    embed = base["model.embed_tokens.weight"]
    assert torch.equal(round_trip("model.embed_tokens.weight", embed), embed)
    # control: another quant type gives other weights
    fp4 = merge.requantizer(tiny_model_dir, quant.to_dict() | {"bnb_4bit_quant_type": "fp4"}, "float32")
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(fp4(key, base[key]), round_trip(key, base[key]))
