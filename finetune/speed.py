"""Speed options: which batch layout the trainer gets, and which option combinations are safe.

Batch layouts (docs/speed.md):

* padded (default): each batch right-padded to its longest example, with an attention mask.
* ``data.packing``: examples concatenated into rows of <= max_length at build time
  (finetune/data.py), position_ids restarting per example, no attention mask.
* ``data.padding_free``: each batch's examples concatenated into ONE row with no padding at
  all (transformers' ``DataCollatorWithFlattening``): position_ids restart per example and the
  first label of every example is -100, so no example is scored from its predecessor.

Boundary safety, as read in transformers 5.23 (the claim "no attention crosses an example
boundary" must hold for the attention implementation that runs, else we refuse):

* sdpa, eager: ``masking_utils._preprocess_mask_arguments`` calls
  ``find_packed_sequence_indices(position_ids)`` whenever attention_mask is None and there is
  no KV cache; every position that does not follow its predecessor by +1 starts a new
  sequence and the causal mask becomes block-diagonal, for any batch size (also under
  torch.compile, where the check is not skipped). A new example starts at position 0 after
  one that ended at p >= 0, a step of -p != +1, so every boundary is found.
* flash_attention_2/3: ``modeling_flash_attention_utils._is_packed_sequence`` only looks at
  position_ids when the batch has ONE row; with several packed rows it runs plain causal
  attention over each row and examples leak into each other. Padding-free batches are one
  row (and we also hand FlashAttention the cu_seq_lens directly), so they are safe; packed
  batches are safe only with per_device_train_batch_size 1, and are refused otherwise.
* models with trust_remote_code may build their own masks: refused with packing/padding-free.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from finetune.errors import ConfigError, UserError

_FLASH = ("flash_attention_2", "flash_attention_3")
# Attention implementations whose handling of position_ids without an attention mask was
# read in transformers 5.23 (see the module docstring).
_POSITION_AWARE = ("sdpa", "eager") + _FLASH


def check(cfg) -> None:
    """Refuse option combinations that would silently mix examples or crash deep inside."""
    problems = []
    d, m, args = cfg.data, cfg.model, cfg.training.args
    concat = [k for k in ("packing", "padding_free") if getattr(d, k, False)]
    if len(concat) == 2:
        problems.append("data.packing and data.padding_free: choose one; padding_free already concatenates each "
                        "batch into one row with no padding, packing builds fixed rows of <= max_length tokens")
    if concat:
        what = f"data.{concat[0]}"
        if m.attn_implementation not in _POSITION_AWARE:
            problems.append(f"{what}: model.attn_implementation {m.attn_implementation!r} was not checked to keep "
                            f"examples apart; use one of {', '.join(_POSITION_AWARE)}")
        if m.trust_remote_code:
            problems.append(f"{what}: not allowed with model.trust_remote_code: remote model code may build its own "
                            "attention mask and ignore the position_ids that keep examples apart")
        batch = args.get("per_device_train_batch_size", 1)
        if concat == ["packing"] and m.attn_implementation in _FLASH and batch != 1:
            problems.append(f"data.packing with model.attn_implementation {m.attn_implementation}: transformers' "
                            "FlashAttention path reads position_ids only for a batch of one row, so packed rows "
                            f"would attend across examples at per_device_train_batch_size {batch}; use "
                            "data.padding_free instead, or per_device_train_batch_size: 1")
    if problems:
        raise ConfigError(problems, "speed options")
    if args.get("use_liger_kernel"):
        check_liger()


def check_liger() -> None:
    """Liger's kernels are Triton GPU kernels: say so before Trainer fails inside them."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("training.use_liger_kernel: the liger-kernel package is not installed; "
                        "pip install 'finetune[liger]' (or set use_liger_kernel: false)")
    if not torch.cuda.is_available():
        raise UserError("training.use_liger_kernel: Liger kernels are Triton GPU kernels and need a CUDA device; "
                        "this machine has none (set use_liger_kernel: false)")


def make_collator(data_cfg, model_cfg, pad_token_id: int) -> Callable[[list[dict]], dict]:
    """The batch builder for the configured layout (see the module docstring)."""
    from finetune import data

    if getattr(data_cfg, "padding_free", False):
        from transformers import DataCollatorWithFlattening

        flat = DataCollatorWithFlattening(return_flash_attn_kwargs=model_cfg.attn_implementation in _FLASH)

        def padding_free(features: list[dict]) -> dict:
            if any("position_ids" in f for f in features):  # the collator would renumber them
                raise ValueError("padding-free batches take unpacked examples; data.packing is also set")
            return flat(features)
        return padding_free
    if getattr(data_cfg, "packing", False):
        return lambda features: count_real_tokens(data.collate(features, pad_token_id), features)
    return lambda features: data.collate(features, pad_token_id)


# A packed batch has no attention mask, so the trainer cannot tell the padding at the end of a
# shorter row from real tokens; the collator states the real count under this key and
# FinetuneTrainer takes it out of the batch before the forward pass.
REAL_TOKENS_KEY = "num_real_input_tokens"


def count_real_tokens(batch: dict, features: list[dict]) -> dict:
    if "attention_mask" in batch:  # unpacked (eval) batches: the mask already tells padding apart
        return batch
    batch[REAL_TOKENS_KEY] = torch.tensor(sum(len(f["input_ids"]) for f in features), dtype=torch.long)
    return batch
