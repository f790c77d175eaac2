"""The TRL sides of `finetune bench`: TRL's SFTTrainer as a user would write it, plain (TRL's default
padded batching, torch's SDPA defaults) or tuned (padding-free or TRL's packing, our SDPA policy);
the same model, data, length, batch, precision policy (finetune/bench/plain_side.py load_dtype),
learning rate, steps, seed, LoRA settings and gradient checkpointing as our side (docs/benchmarks.md).
"""

from __future__ import annotations


def build_trainer(spec: dict, dataset, callbacks: list, *, tuned: bool = False):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    from finetune import precision
    from finetune.bench.plain_side import LORA, baseline_args, load_dtype

    policy = precision.get(spec["precision"])
    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    kwargs = {
        "dtype": precision.torch_dtype(load_dtype(policy, spec["method"])),
        "attn_implementation": spec["attn_implementation"],
    }
    if spec["method"] == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=precision.torch_dtype(policy.compute_dtype),
        )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **kwargs)
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
    args = SFTConfig(**baseline_args(spec, cuda, policy), **layout)
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
