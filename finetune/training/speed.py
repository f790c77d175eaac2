"""Speed options: which combinations are safe, what they imply for TrainingArguments, and run.json's `speed` section.
Packing and padding-free are allowed only with attention implementations whose handling of position_ids was read to keep
examples apart (sdpa, eager; FlashAttention with one row per batch), never with remote model code (docs/speed.md).
"""

from __future__ import annotations

import importlib.util

import torch

from finetune.data import pack
from finetune.data.collate import FLASH_ATTENTION
from finetune.errors import ConfigError, UserError
from finetune.modeling import attention
from finetune.modeling.load import model_type

# Attention implementations whose handling of position_ids without an attention mask was
# read in transformers 5.23 (see the module docstring).
_POSITION_AWARE = ("sdpa", "eager") + FLASH_ATTENTION


def check(cfg) -> None:
    """Refuse option combinations that would silently mix examples or crash deep inside."""
    problems = []
    d, m, args = cfg.data, cfg.model, cfg.training.typed
    concat = [k for k in ("packing", "padding_free") if getattr(d, k, False)]
    if len(concat) == 2:
        problems.append(
            "data.packing and data.padding_free: choose one; padding_free already concatenates each "
            "batch into one row with no padding, packing builds fixed rows of <= max_length tokens"
        )
    if concat:
        what = f"data.{concat[0]}"
        if m.attn_implementation not in _POSITION_AWARE:
            problems.append(
                f"{what}: model.attn_implementation {m.attn_implementation!r} was not checked to keep "
                f"examples apart; use one of {', '.join(_POSITION_AWARE)}"
            )
        _, fallback = attention.for_family(model_type(m), m.attn_implementation)
        if fallback:
            problems.append(
                f"{what}: {fallback.split(':')[0]}, and its own attention was not checked to keep examples apart; "
                "turn it off for this model"
            )
        if m.trust_remote_code:
            problems.append(
                f"{what}: not allowed with model.trust_remote_code: remote model code may build its own "
                "attention mask and ignore the position_ids that keep examples apart"
            )
        batch = args.per_device_train_batch_size
        if concat == ["packing"] and m.attn_implementation in FLASH_ATTENTION and batch != 1:
            problems.append(
                f"data.packing with model.attn_implementation {m.attn_implementation}: transformers' "
                "FlashAttention path reads position_ids only for a batch of one row, so packed rows "
                f"would attend across examples at per_device_train_batch_size {batch}; use "
                "data.padding_free instead, or per_device_train_batch_size: 1"
            )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problems += attention.problems(m.sdpa_backends, device)  # a CPU run must keep flash or math
    if problems:
        raise ConfigError(problems, "speed options")
    if args.use_liger_kernel:
        check_liger()
    if cfg.training.loss_impl == "liger":
        check_liger("training.loss_impl: liger", "use loss_impl: chunked")


def check_liger(key: str = "training.use_liger_kernel", instead: str = "set use_liger_kernel: false") -> None:
    """Liger's kernels are Triton GPU kernels: say so before Trainer fails inside them."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError(
            f"{key}: the liger-kernel package is not installed; pip install 'finetune[liger]' (or {instead})"
        )
    if not torch.cuda.is_available():
        raise UserError(
            f"{key}: Liger kernels are Triton GPU kernels and need a CUDA device; this machine has none ({instead})"
        )


def trainer_overrides(targs: dict) -> dict:
    """TrainingArguments values the speed options imply. With use_liger_kernel, Trainer applies Liger's patches to the
    model after we load it; its fused linear cross-entropy would replace the causal LM's forward, and with it the loss
    of training.loss_impl (and read the head's weight directly, a shard under ZeRO-3). Liger's fused loss is ours to
    install (loss_impl: liger), so Trainer's patch keeps only the layer kernels (RMSNorm, RoPE, SwiGLU)."""
    if targs.get("use_liger_kernel"):
        config = dict(targs.get("liger_kernel_config") or {})
        config["fused_linear_cross_entropy"] = False
        targs = {**targs, "liger_kernel_config": config}
    return targs


# Config keys of mixture-of-experts models: which experts a token reaches depends on the data.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def unused_trainable(model, input_ids: list[int]) -> list[str]:
    """Names of the trainable parameters outside the autograd graph of one forward's loss, found as
    DDP finds them: walking the graph from the loss to its AccumulateGrad leaves. In eval mode (no
    dropout, no activation checkpointing) with the RNG streams restored: training is unchanged."""
    device = next(p.device for p in model.parameters())
    ids = torch.tensor([input_ids], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = model(input_ids=ids, labels=ids, use_cache=False)
    finally:
        model.train(was_training)
    reached, seen, stack = set(), set(), [out.loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf that receives a gradient
            reached.add(id(fn.variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in reached]


def ddp_unused_parameters(cfg, launch, model, input_ids: list[int], device) -> dict:
    """Whether DDP must look for unused parameters after every forward (`find_unused_parameters`),
    decided from the model before Trainer wraps it (docs/speed.md "DDP: unused parameters"): False
    where every trainable parameter gets a gradient in one probe forward (`unused_trainable`), True
    where one does not or for a mixture of experts; the recipe's own value wins. None: not DDP."""
    if not (launch.distributed_type.startswith("MULTI_") and launch.world_size > 1):
        return _decision(None, None, "not DDP")
    given = cfg.training.typed.ddp_find_unused_parameters
    if given is not None:
        return _decision(bool(given), "recipe", "training.ddp_find_unused_parameters")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = next((k for k in _EXPERT_KEYS if (getattr(text, k, None) or 0) > 1), None)
    if experts:
        why = f"config.{experts}={getattr(text, experts)}: the router decides per batch which experts train"
        return _decision(True, "model config", why)
    if not getattr(model, "is_loaded_in_4bit", False):  # a 4-bit base is placed by its loader already
        model.to(device)  # where Trainer puts it for DDP anyway: the probe runs at the device's speed
    unused = unused_trainable(model, input_ids)
    why = f"{len(unused)} trainable parameter(s) get no gradient" if unused else None
    return _decision(bool(unused), "probe", why, unused[:20])


def _decision(find: bool | None, decided_by: str | None, reason: str | None, unused: list | None = None) -> dict:
    return {"find_unused_parameters": find, "decided_by": decided_by, "unused_trainable": unused, "reason": reason}


def section(cfg, model, trainer, *, attention_record: dict, loss_record: dict, ddp_record: dict) -> dict:
    """run.json `speed`, from the live objects: the collator's layout, the installed loss, torch's
    SDPA flags after the policy was applied, Trainer's compile and Liger settings, the DDP wrapper's
    find_unused_parameters as Accelerate will pass it (`ddp_record`: how it was decided)."""
    from finetune.telemetry.record import installed_version

    d, args = cfg.data, trainer.args
    name = "packing" if d.packing else "padding_free" if d.padding_free else "padded"
    return {
        "layout": {
            "name": name,
            "packing_algorithm": pack.ALGORITHM if d.packing else None,
            "pad_to_multiple_of": d.pad_to_multiple_of,
        },
        # compact skips unlabelled positions with a data-dependent shape, which torch.compile does not trace
        "loss_impl": loss_record | {"compact": loss_record["compact"] and not args.torch_compile},
        "attention": attention_section(cfg, model, attention_record),
        "compile": {
            "enabled": bool(args.torch_compile),
            "mode": args.torch_compile_mode if args.torch_compile else None,
            "backend": args.torch_compile_backend if args.torch_compile else None,
        },
        "liger": {
            "layer_kernels": bool(args.use_liger_kernel),
            "fused_linear_cross_entropy": loss_record["resolved"] == "liger",
            "version": installed_version("liger-kernel"),
        },
        "ddp": ddp_record | {"find_unused_parameters": _live_find_unused(trainer, ddp_record)},
    }


def attention_section(cfg, model, attention_record: dict) -> dict:
    """run.json `speed.attention`: the implementation the model runs (live), the one asked for, and why they differ
    (a family without SDPA: finetune/modeling/attention.py for_family); SDPA's backends only where SDPA runs."""
    live = model.config._attn_implementation
    requested = cfg.model.attn_implementation
    _, fallback = attention.for_family(getattr(model.config, "model_type", None), requested)
    out = attention_record | {"implementation": live, "requested": requested, "fallback": fallback}
    if live != "sdpa":
        out.update(sdpa_backends_enabled=None, sdpa_priority=None)
    return out


def _live_find_unused(trainer, decided: dict) -> bool | None:
    """DistributedDataParallelKwargs as Trainer built them (what Accelerate gives DDP), checked against the decision."""
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    live = handler.find_unused_parameters if handler is not None and decided["decided_by"] else None
    if live != decided["find_unused_parameters"]:
        raise RuntimeError(f"DDP find_unused_parameters is {live}, decided {decided['find_unused_parameters']}")
    return live
