"""The baseline sides of `finetune bench` (plain Trainer, TRL plain and tuned), each with the same
workload, precision policy and settings as our side (docs/benchmarks.md).
"""

from __future__ import annotations

from finetune import precision

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}  # every side's


def load_dtype(policy: precision.Policy, method: str) -> str:
    """The dtype a side that follows `policy` by hand loads the checkpoint in: the master dtype of a
    full fine-tune (fp32 under bf16-mixed: the master copy), the frozen base's dtype otherwise."""
    return policy.master_dtype if method == "full" else policy.frozen_dtype


def load_kwargs(spec: dict, policy: precision.Policy) -> dict:
    """from_pretrained's arguments every baseline side shares: the policy's load dtype, 4-bit for QLoRA."""
    from transformers import BitsAndBytesConfig

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
    return kwargs


def baseline_args(spec: dict, cuda: bool, policy: precision.Policy) -> dict:
    """The TrainingArguments every baseline side shares: the spec's workload, no saving or logging out."""
    return dict(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        learning_rate=spec["learning_rate"],
        gradient_checkpointing=spec["gradient_checkpointing"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec["seed"],
        disable_tqdm=True,
        use_cpu=not cuda,
        **policy.training_args("torch"),
    )


def like_ours(args, spec: dict):
    """`--baseline-like-ours`: this side's TrainingArguments with every setting that differs from our
    side's live ones (`spec["ours_args"]`) set to ours, each run's own output and name aside."""
    import dataclasses
    import json

    from finetune.bench.report import PER_RUN, differing

    if "ours_args" not in spec:
        return args
    theirs = json.loads(args.to_json_string())
    changes = {k: ours for k, (ours, _) in differing(spec["ours_args"], theirs).items() if k not in PER_RUN}
    return dataclasses.replace(args, **changes)


def plain_trainer(spec: dict, dataset, callbacks: list):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, set_seed

    from finetune.training import arguments

    policy = precision.get(spec["precision"])
    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "right"
    set_seed(spec["seed"])  # the LoRA initialisation the other sides draw
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **load_kwargs(spec, policy))
    if spec["method"] == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["gradient_checkpointing"])
    if spec["method"] in ("lora", "qlora"):
        model = get_peft_model(
            model,
            LoraConfig(**LORA, task_type="CAUSAL_LM"),
            autocast_adapter_dtype=policy.adapters_fp32,  # fp32 adapters under a mixed policy
        )
    args = like_ours(arguments.build(**baseline_args(spec, cuda, policy)), spec)
    return Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def trl_trainer(spec: dict, dataset, callbacks: list, *, tuned: bool = False):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

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
