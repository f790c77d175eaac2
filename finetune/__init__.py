"""finetune: fine-tune causal LMs (full, LoRA, QLoRA) under single device, DDP, DeepSpeed ZeRO-2/3 and FSDP2.

The launch script is finetune/train.py; the layout is in README.md ("Layout")."""

import logging

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)


class Cpu4bitKernelNotice(logging.Filter):
    """bitsandbytes is imported by peft whenever peft is imported (peft 0.21 peft/helpers.py imports
    it unconditionally), and transformers imports peft with TrainingArguments whenever peft is
    installed (transformers 5.23 trainer_utils.py), so every command that validates a recipe imports
    it, 4-bit or not; none of the three has a switch to turn that off. On import, bitsandbytes'
    CPU backend (bitsandbytes/backends/cpu/ops.py) warns that the optional `kernels` package for
    its 4-bit CPU matmul is missing, on any CPU with AVX512-BF16. That one record is held back
    here (it is noise for every run without 4-bit weights) and kept in `held`, so a QLoRA run on
    CPU, where it does apply, shows it (finetune/modeling/load.py)."""

    PREFIX = "Failed to load CPU gemm_4bit_forward"

    def __init__(self):
        super().__init__()
        self.held: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.PREFIX):
            self.held.append(record.getMessage())
            return False
        return True


CPU_4BIT_NOTICE = Cpu4bitKernelNotice()
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(CPU_4BIT_NOTICE)
