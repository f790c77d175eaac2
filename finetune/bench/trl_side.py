"""The other side of `finetune bench`: a plain TRL SFTTrainer script, as a user would write it.

Same model directory, same pre-tokenized data (input_ids + labels, -100 on prompt tokens),
same sequence length, batch, precision, learning rate, steps and seed as our side. TRL's own
defaults are kept for everything about batching: SFTConfig(packing=False, padding_free=False),
so batches are padded to their longest example. Two TRL defaults are overridden because they
would change the workload rather than the batching, and our side gets the same value:
gradient_checkpointing (TRL default True; here the benchmark's --gradient-checkpointing) and
bf16 (TRL default True; here True exactly when the device is CUDA, as on our side).
"""

from __future__ import annotations


def build_trainer(spec: dict, dataset, callbacks: list):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    kwargs = {"dtype": dtype, "attn_implementation": spec["attn_implementation"]}
    if spec["method"] == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **kwargs)
    peft_config = None
    if spec["method"] in ("lora", "qlora"):
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    args = SFTConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        max_length=spec["seq_len"], learning_rate=spec["learning_rate"], bf16=cuda,
        gradient_checkpointing=spec["gradient_checkpointing"], logging_steps=1, save_strategy="no",
        report_to="none", seed=spec["seed"], disable_tqdm=True, use_cpu=not cuda,
    )
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                      peft_config=peft_config, callbacks=callbacks)
