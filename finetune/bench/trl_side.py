"""The TRL sides of `finetune bench`: TRL's SFTTrainer as a user would write it, plain (TRL's default
padded batching, torch's SDPA defaults) or tuned (padding-free or TRL's packing, our SDPA policy);
the same model, data, length, batch, precision policy (finetune/bench/plain_side.py load_kwargs),
learning rate, steps, seed, LoRA settings and gradient checkpointing as our side (docs/benchmarks.md).
"""

from __future__ import annotations


def build_trainer(spec: dict, dataset, callbacks: list, *, tuned: bool = False):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from finetune import precision
    from finetune.bench.plain_side import LORA, baseline_args, like_ours, load_kwargs

    policy = precision.get(spec["precision"])
    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **load_kwargs(spec, policy))
    peft_config = None
    if spec["method"] in ("lora", "qlora"):
        peft_config = LoraConfig(**LORA, task_type="CAUSAL_LM")
    layout = {"max_length": spec["seq_len"]}
    if tuned:
        layout = (
            {"packing": True, "packing_strategy": "bfd", "max_length": spec["seq_len"]}
            if spec["layout"] == "packing"
            else {"padding_free": True, "max_length": None}
        )
    args = like_ours(SFTConfig(**baseline_args(spec, cuda, policy), **layout), spec)
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
