"""Planner model states against the ZeRO paper and DeepSpeed's own estimators; parameter counts
from config arithmetic against instantiated models."""

from __future__ import annotations

import pytest
import torch

from finetune.planning import shapes

ADAM_K = 12  # bytes/parameter of mixed-precision Adam states: fp32 master copy, momentum, variance


def zero_model_states_bytes(psi: int, n: int, stage: int, k: int = ADAM_K, fp32_grads: bool = False) -> float:
    """Per-device bytes of model states for ZeRO stage 0 (DDP) to 3 on N data-parallel devices (ZeRO
    paper Figure 1; fp32_grads: as DeepSpeed's estimators count gradients, docs/planning.md)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:  # DeepSpeed keeps the 16-bit gradient partition and an fp32 copy of it
        return 2 * psi + (2 + (4 if fp32_grads else 0) + k) * psi / n
    if stage == 3:  # DeepSpeed's sharded gradient is the fp32 one (4 bytes instead of 2)
        return (2 + (4 if fp32_grads else 2) + k) * psi / n
    raise ValueError(f"ZeRO stage must be 0-3, got {stage}")


@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1_for_7_5b_on_64_devices(stage, paper_gb):
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12; the paper's GB are 1e9 bytes.
    assert zero_model_states_bytes(7_500_000_000, 64, stage) / 1e9 == pytest.approx(paper_gb, abs=0.05)


@pytest.mark.parametrize("n", [1, 2, 8, 1024])
def test_zero_formulas_at_other_degrees(n):
    psi = 7_500_000_000
    assert zero_model_states_bytes(psi, n, 0) == 16 * psi
    assert zero_model_states_bytes(psi, n, 1) == pytest.approx(4 * psi + 12 * psi / n)
    assert zero_model_states_bytes(psi, n, 2) == pytest.approx(2 * psi + 14 * psi / n)
    assert zero_model_states_bytes(psi, n, 3) == pytest.approx(16 * psi / n)


@pytest.mark.parametrize("psi", [135_000_000, 1_000_000_000, 8_000_000_000])
@pytest.mark.parametrize("gpus_per_node, nodes", [(1, 1), (2, 1), (8, 2)])
def test_deepspeed_estimators_reproduced(psi, gpus_per_node, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = gpus_per_node * nodes
    largest = psi // 50
    _, ds2 = estimate_zero2_model_states_mem_needs(psi, gpus_per_node, nodes, cpu_offload=False)
    assert int(zero_model_states_bytes(psi, n, 2, fp32_grads=True)) == pytest.approx(ds2, abs=1)
    _, ds3, ds_largest = estimate_zero3_model_states_mem_needs(psi, largest, gpus_per_node, nodes, cpu_offload=False)
    assert ds_largest == 4 * largest
    assert int(zero_model_states_bytes(psi, n, 3, fp32_grads=True)) + 4 * largest == pytest.approx(ds3, abs=1)


def _llama(tie):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tie,
        )
    )


def _qwen2(tie):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tie,
        )
    )


def _gpt2(tie):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=1000, n_embd=64, n_layer=3, n_head=4, n_positions=128, tie_word_embeddings=tie)
    )


@pytest.mark.parametrize("build", [_llama, _qwen2, _gpt2], ids=["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_parameter_count_from_config_equals_the_instantiated_model(build, tie):
    torch.manual_seed(0)
    model = build(tie)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # tied weights counted once
    count = shapes.count_parameters(model.config)
    assert count.total == sum(unique.values())
    assert (count.lm_head == 0) == tie


def test_unknown_architecture_is_refused_not_guessed():
    from transformers import BertConfig

    with pytest.raises(ValueError, match="model_type 'bert'"):
        shapes.count_parameters(BertConfig())
