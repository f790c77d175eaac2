"""finetune: fine-tune causal LMs (full, LoRA, QLoRA) under single device, DDP, DeepSpeed ZeRO-2/3 and FSDP2.

The launch script is finetune/train.py; the layout is in README.md ("Layout")."""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

from finetune import held_back

held_back.install()  # third-party messages held back at their source, each with its reason
