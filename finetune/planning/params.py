"""Parameter counts from config arithmetic, and the per-device bytes of model states as the ZeRO
paper counts them (Rajbhandari et al. 2020, §3; K = 12 bytes of optimizer state per parameter);
DeepSpeed's own estimators differ deliberately and are called where needed (docs/planning.md).
"""

from __future__ import annotations

from dataclasses import dataclass

ADAM_K = 12  # bytes/parameter of mixed-precision Adam states: fp32 master copy, momentum, variance


@dataclass
class ParamCount:
    total: int
    embedding: int  # input embedding table
    lm_head: int  # 0 when tied to the embedding
    per_layer: int
    layers: int
    largest_layer: int  # the largest single module's parameters (ZeRO-3 gathers one at a time)


def count_parameters(config) -> ParamCount:
    """Parameters of a decoder-only model from its transformers config: Llama/Mistral/Qwen2
    shapes (RMSNorm, gated MLP, optional q/k/v bias, GQA) and GPT-2 (LayerNorm with bias,
    learned positions, 4x MLP with bias). Raises ValueError for other model types."""
    kind = getattr(config, "model_type", "")
    if kind == "gpt2":
        h, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
        inner = config.n_inner or 4 * h
        per_layer = (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (2 * h) + (h * inner + inner) + (inner * h + h)
        embedding = vocab * h
        total = embedding + config.n_positions * h + layers * per_layer + 2 * h  # + final LayerNorm
        lm_head = 0 if getattr(config, "tie_word_embeddings", True) else vocab * h
        return ParamCount(total + lm_head, embedding, lm_head, per_layer, layers, max(embedding, h * inner))
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        inter = config.intermediate_size
        q, k = heads * head_dim, kv * head_dim
        attention = h * q + 2 * h * k + q * h
        if kind == "qwen2" or getattr(config, "attention_bias", False):
            attention += q + 2 * k  # q/k/v biases
        if kind == "qwen3":
            attention += 2 * head_dim  # q_norm, k_norm
        per_layer = attention + 3 * h * inter + 2 * h  # gated MLP + two RMSNorms
        embedding = vocab * h
        lm_head = 0 if getattr(config, "tie_word_embeddings", False) else vocab * h
        total = embedding + lm_head + layers * per_layer + h  # + final norm
        return ParamCount(total, embedding, lm_head, per_layer, layers, max(embedding, h * inter))
    raise ValueError(f"no parameter arithmetic for model_type {kind!r} (supported: llama, mistral, qwen2, qwen3, gpt2)")


def zero_model_states_bytes(psi: int, n: int, stage: int, k: int = ADAM_K, fp32_grads: bool = False) -> float:
    """Per-device bytes of model states for ZeRO stage 0 (DDP) to 3 on N data-parallel devices.

    fp32_grads (stages 2 and 3) counts gradients the way DeepSpeed's estimators do, with a
    4-byte fp32 gradient per parameter the rank's optimizer owns; with it, stage 2
    equals estimate_zero2_model_states_mem_needs exactly, and stage 3 equals
    estimate_zero3_model_states_mem_needs less the largest layer it gathers (4 bytes/param)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:  # DeepSpeed keeps the 16-bit gradient partition and an fp32 copy of it
        return 2 * psi + (2 + (4 if fp32_grads else 0) + k) * psi / n
    if stage == 3:  # DeepSpeed's sharded gradient is the fp32 one (4 bytes instead of 2)
        return (2 + (4 if fp32_grads else 2) + k) * psi / n
    raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
