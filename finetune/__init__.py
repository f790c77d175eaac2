"""finetune: fine-tune causal LMs (full, LoRA, QLoRA) under single device, DDP, DeepSpeed ZeRO-2/3 and FSDP2.

The launch script is finetune/train.py; the layout is in README.md ("Layout")."""
