"""The TRL sides of `finetune bench`: TRL's SFTTrainer as a user would write it, plain or tuned.

Both: same model directory, same pre-tokenized data (input_ids + labels, -100 on prompt tokens),
same sequence length, batch, precision, learning rate, steps and seed as our side. Two TRL defaults
are overridden because they would change the workload rather than the batching, and our side gets
the same value: gradient_checkpointing (TRL default True; here the benchmark's
--gradient-checkpointing) and bf16 (TRL default True; here True exactly when the device is CUDA,
as on our side). TRL's loss is its own on both (TRL 1.16's default `loss_type="nll"` already
computes the cross-entropy through its chunked fused LM head, trl/trainer/utils.py
add_fused_lm_head).

* plain: TRL's defaults for batching, SFTConfig(packing=False, padding_free=False), so batches are
  padded to their longest example; torch's default SDPA backends (the worker applies no policy).
* tuned: what a user who read TRL's documentation would set for this data. Our layout
  padding_free or padded: `padding_free=True` (one row per batch, position_ids; TRL requires
  `max_length=None` then, the rows are already clipped to --seq-len). Our layout packing:
  `packing=True, packing_strategy="bfd", max_length=seq_len` (TRL's best-fit decreasing packing,
  itself padding-free). Same SDPA backend policy as ours (the worker applies it).
"""

from __future__ import annotations


def build_trainer(spec: dict, dataset, callbacks: list, *, tuned: bool = False):
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
    layout = {"max_length": spec["seq_len"]}
    if tuned:
        layout = ({"packing": True, "packing_strategy": "bfd", "max_length": spec["seq_len"]}
                  if spec["layout"] == "packing" else {"padding_free": True, "max_length": None})
    args = SFTConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        learning_rate=spec["learning_rate"], bf16=cuda,
        gradient_checkpointing=spec["gradient_checkpointing"], logging_steps=1, save_strategy="no",
        report_to="none", seed=spec["seed"], disable_tqdm=True, use_cpu=not cuda, **layout,
    )
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                      peft_config=peft_config, callbacks=callbacks)
