"""Model FLOPs from the live model (finetune/telemetry/model_flops.py) against counts made here
from the models' parameters, for a Llama, a GPT-2 (Conv1D, n_head/n_embd), a LoRA-wrapped model,
a mixture of experts, ZeRO-3-partitioned weights, and models whose FLOPs cannot be known."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.telemetry import model_flops


def _independent_n(model, embedding_names=("embed_tokens", "wte", "wpe")) -> int:
    """Every 2-D weight except the input embedding lookups, plus the LM head when tied (the
    forward multiplies by it; named_parameters lists a tied weight once)."""
    n = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and not any(e in name for e in embedding_names)
    )
    if model.config.tie_word_embeddings:
        n += model.get_output_embeddings().weight.numel()
    return n


def test_llama_full_and_lora(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    n = _independent_n(model)
    full, why = model_flops.from_model(model, "full")
    assert why is None and full.matmul_params == n
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert full.attention_coeff == 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    # 2 examples of 30 and 70 tokens: 6N per token + 12LHQ x (30^2 + 70^2), not x 100^2 (the row)
    assert full.flops(100, 30**2 + 70**2) == 6 * n * 100 + full.attention_coeff * (900 + 4900)
    assert "PaLM" in full.convention
    lora_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    lora, _ = model_flops.from_model(lora_model, "lora")
    assert lora.matmul_params == n and lora.weight_factor == 4  # adapters not counted, the frozen base is
    assert "4N" in lora.convention


def test_gpt2_is_counted_from_its_conv1d_modules_and_config_names():
    """Issue 15 item 2: GPT2Config has no intermediate_size; the config arithmetic crashed after
    training. Conv1D weights are (in, out) 2-D parameters; the LM head is tied to wte."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4))
    flops, why = model_flops.from_model(model, "full")
    assert why is None
    assert flops.matmul_params == _independent_n(model)
    assert flops.matmul_params == 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 300 * 32  # per layer + head
    assert flops.attention_coeff == 12 * 2 * 4 * 8


def test_mixture_of_experts_counts_the_experts_a_token_uses():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(cfg)
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    dense = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    assert experts > dense  # the experts are most of the weights: counting all of them would be far off
    flops, why = model_flops.from_model(model, "full")
    assert why is None and flops.matmul_params == dense + experts * 2 // 4
    assert "active experts" in flops.convention
    # a config that does not say how many experts a token uses (a plain object: transformers'
    # config classes refuse to drop the field)
    model.config = SimpleNamespace(**{k: v for k, v in cfg.to_dict().items() if k != "num_experts_per_tok"})
    flops, why = model_flops.from_model(model, "full")
    assert flops is None and "mixture of experts" in why


def test_zero3_partitioned_and_4bit_weights_count_at_their_logical_size(tiny_model_dir):
    """Under zero3_init_flag the weights are empty placeholders (numel 0) with ds_numel/ds_shape;
    4-bit weights are packed. Linear modules keep in/out features, so N does not change."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    want, _ = model_flops.from_model(model, "full")
    for p in model.parameters():
        p.ds_numel, p.ds_shape = p.numel(), tuple(p.shape)
        p.data = torch.empty(0)
    got, why = model_flops.from_model(model, "full")
    assert why is None and got.matmul_params == want.matmul_params > 0


def test_a_model_without_an_attention_shape_gets_a_reason_not_a_crash():
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.config = type("Cfg", (), {"hidden_size": 4})()

    flops, why = model_flops.from_model(Bare(), "full")
    assert flops is None and "attention shape" in why
    flops, why = model_flops.from_model(object(), "full")  # anything else: still no exception
    assert flops is None and why


@pytest.mark.parametrize("method, factor", [("full", 6), ("qlora", 4)])
def test_weight_factor_follows_the_method(tiny_model_dir, method, factor):
    from transformers import AutoModelForCausalLM

    flops, _ = model_flops.from_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), method)
    assert flops.weight_factor == factor
