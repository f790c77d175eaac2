"""A tiny random Llama with a real tokenizer: the architecture's own code paths (GQA attention, RoPE,
the LoRA targets, one FSDP unit per decoder layer) at a size that trains in seconds on a CPU.
`finetune doctor` trains it under every strategy (finetune/doctor/runs.py); the tests do too
(tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(
    path: Path,
    tokenizer,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    tie: bool = True,
) -> Path:
    """Save a randomly initialised LlamaForCausalLM (weights from torch's generator seeded with
    `seed`) and `tokenizer` into `path`: a plain local model directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)
