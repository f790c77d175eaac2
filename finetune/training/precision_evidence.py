"""The precision a run trains in, read from the live objects before step 1 (run.json `precision`, docs/precision.md):
the declared section, the live one (`live_section`), the bf16-true rule, and the Linear whose first forward shows the
compute dtype. finetune/training/hooks.py reads them at on_train_begin (DeepSpeed steps inside backward) and checks them
against the policy (finetune/precision.py mismatches).
"""

from __future__ import annotations

import torch

from finetune import precision
from finetune.precision import dtype_name

# --- reading the live objects ------------------------------------------------------------------


def optimizer_state_dtype(optimizer, param_dtype):
    """The dtype Adam-family states will have, before they exist: torch Adam/AdamW/SGD create them
    with zeros_like(param) (torch/optim/adam.py Adam._init_group); DeepSpeedCPUAdam in fp32 unless
    built with fp32_optimizer_states=False (deepspeed/ops/adam/cpu_adam.py); bitsandbytes 8-bit
    optimizers keep uint8 block-quantized states. None: unknown (not guessed)."""
    name = type(optimizer).__name__
    if name in ("DeepSpeedCPUAdam", "ZenFlowCPUAdam"):
        return torch.float32 if getattr(optimizer, "fp32_optimizer_states", True) else param_dtype
    if "8bit" in name:
        return torch.uint8
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
        return param_dtype
    return None


def _deepspeed(eng) -> dict:
    zopt, basic = eng.optimizer, eng.basic_optimizer
    trainable = next((p for p in eng.module.parameters() if p.requires_grad), None)
    module = None
    if trainable is not None:  # ZeRO-3: the partition this rank holds (ds_tensor), not the empty placeholder
        module = trainable.ds_tensor.dtype if hasattr(trainable, "ds_tensor") else trainable.dtype
    # The tensors the basic optimizer steps: ZeRO-1/2 single_partition_of_fp32_groups, ZeRO-3
    # fp32_partitioned_groups_flat, BF16_Optimizer fp32_groups_flat_partition ("fp32" in the names,
    # bf16 under bf16_master_weights_and_grads). ZeRO-3 empties the basic optimizer's own groups
    # between steps (stage3.py _set_fp32_optimizer_param_groups), so they are not read.
    master = module
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        groups = getattr(zopt, attr, None)
        if groups:
            master = groups[0].dtype
            break
    autocast = bool(eng.torch_autocast_enabled())
    return {
        "param_dtype": master,
        "compute_dtype": eng.torch_autocast_dtype() if autocast else module,
        "optimizer_state_dtype": optimizer_state_dtype(basic, master),
        "reduce_dtype": eng.communication_data_type,  # config, else fp16/bf16 when enabled, else fp32
        "evidence": {
            "engine": type(eng).__name__,
            "optimizer": type(basic).__name__,
            "zero_optimizer": type(zopt).__name__,
            "module_param_dtype": dtype_name(module),
            "grad_accum_dtype": dtype_name(eng.get_data_types()[1]),
            "bf16_enabled": bool(eng.bfloat16_enabled()),
            "fp16_enabled": bool(eng.fp16_enabled()),
            "deepspeed_torch_autocast": autocast,
            "loss_scaler": type(getattr(zopt, "loss_scaler", None)).__name__ if eng.fp16_enabled() else None,
        },
    }


def _fsdp2_policy(wrapped):
    """The MixedPrecisionPolicy fully_shard was given: the private FSDPState._mp_policy (torch 2.13;
    the root state exists even when the root holds no parameters, as in Accelerate's full wrap)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None, 0
    try:
        return modules[0]._get_fsdp_state()._mp_policy, len(modules)
    except AttributeError:  # private API moved: evidence only, compute falls back to the shard dtype
        return None, len(modules)


def _torch(trainer) -> dict:
    wrapped, acc = trainer.model_wrapped, trainer.accelerator
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # AcceleratedOptimizer -> torch optimizer
    param = next(p for g in inner.param_groups for p in g["params"])  # FSDP2: the sharded DTensor
    mp, fsdp_modules = _fsdp2_policy(wrapped)
    unwrapped = acc.unwrap_model(wrapped)
    # Accelerate wraps forward in autocast for native AMP (Accelerator.prepare_model), but not under
    # FSDP2 (_prepare_fsdp2 never calls prepare_model): look for the wrapper itself.
    autocast = bool(acc.native_amp) and getattr(unwrapped, "_original_forward", None) is not None
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(acc.mixed_precision) if autocast else None
    if mp is not None:
        compute = mp.param_dtype or param.dtype
        reduce = mp.reduce_dtype or mp.param_dtype or param.dtype  # MixedPrecisionPolicy: None = param_dtype
    else:
        linear = next(
            (m for m in unwrapped.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad), None
        )
        compute = autocast_dtype or (linear.weight.dtype if linear is not None else param.dtype)
        # DDP all-reduces param.grad, which autograd produces in the parameter's dtype; one process reduces nothing
        reduce = param.dtype if type(wrapped).__name__ == "DistributedDataParallel" else None
    scaler = getattr(acc, "scaler", None)
    return {
        "param_dtype": param.dtype,
        "compute_dtype": compute,
        "optimizer_state_dtype": optimizer_state_dtype(inner, param.dtype),
        "reduce_dtype": reduce,
        "evidence": {
            "engine": type(wrapped).__name__,
            "optimizer": type(inner).__name__,
            "autocast": autocast,
            "autocast_dtype": dtype_name(autocast_dtype),
            "fsdp_modules": fsdp_modules,
            "param_is_dtensor": type(param).__name__ == "DTensor",
            "loss_scaler": type(scaler).__name__ if scaler is not None else None,
            "mp_policy": None
            if mp is None
            else {
                "param_dtype": dtype_name(mp.param_dtype),
                "reduce_dtype": dtype_name(mp.reduce_dtype),
                "output_dtype": dtype_name(mp.output_dtype),
                "cast_forward_inputs": bool(mp.cast_forward_inputs),
            },
        },
    }


def read_live(trainer) -> dict:
    """The live `precision` fields (dtype names) of a Trainer whose model is wrapped and whose
    optimizer exists (on_train_begin)."""
    wrapped = trainer.model_wrapped
    out = (
        _deepspeed(wrapped) if any(c.__name__ == "DeepSpeedEngine" for c in type(wrapped).__mro__) else _torch(trainer)
    )
    out["master_weights"] = out["param_dtype"] == torch.float32 and out["compute_dtype"] in (
        torch.bfloat16,
        torch.float16,
    )
    out["evidence"]["accelerate_mixed_precision"] = str(trainer.accelerator.mixed_precision)
    return {k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in out.items()}


# --- the bf16-true rule -------------------------------------------------------------------------


def vanishing_share(model, lr: float) -> tuple[float, float, int]:
    """(share of trainable elements whose bf16 half-spacing exceeds lr, the smallest learning rate at
    which that share is below precision.VANISHING_WARN_SHARE, elements counted); the derivation:
    docs/precision.md "bf16-true: the warning". Half-spacing at w = 2^(e - 9) with frexp's exponent e;
    zeros (LoRA B) can always move. Sharded parameters are counted where they live and the exponent
    histogram is summed over ranks, so the figure is exact for the whole model."""
    bins = torch.zeros(300, dtype=torch.float64)  # frexp exponents of bf16 (-133..128) shifted by +150
    zeros = 0.0
    sharded = False
    for p in model.parameters():
        if not p.requires_grad:
            continue
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p
        if type(t).__name__ == "DTensor":
            t = t.to_local()
        sharded = sharded or hasattr(p, "ds_tensor") or t is not p
        for chunk in t.detach().reshape(-1).split(1 << 24):
            c = chunk.float()
            nz = c[c != 0]
            zeros += float(c.numel() - nz.numel())
            _, e = torch.frexp(nz)
            bins += torch.bincount((e.to(torch.int64) + 150).cpu(), minlength=300).to(torch.float64)
    counts = torch.cat([bins, torch.tensor([zeros], dtype=torch.float64)])
    if sharded and torch.distributed.is_initialized():
        counts = counts.to(_collective_device())
        torch.distributed.all_reduce(counts)
        counts = counts.cpu()
    bins, zeros = counts[:-1], float(counts[-1])
    total = float(bins.sum()) + zeros
    if total == 0:
        return 0.0, 0.0, 0
    half = torch.exp2(torch.arange(300, dtype=torch.float64) - 150 - 9)
    lost = float(bins[half > lr].sum())
    # lost(h) = elements with half-spacing > h: the smallest bin value h at which lost(h) < the warn share
    above = bins.flip(0).cumsum(0).flip(0) - bins  # elements in bins strictly above each bin
    ok = (above < precision.VANISHING_WARN_SHARE * total) & (bins > 0)
    needed = float(half[ok.nonzero()[0, 0]]) if bool(ok.any()) else 0.0
    return lost / total, needed, int(total)


def _collective_device():
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
        else torch.device("cpu")
    )


def bf16_true_warning(share: float, needed: float, lr: float, *, policy: str, method: str) -> str | None:
    """The warning text when bf16-true full fine-tuning loses most updates (docs/precision.md)."""
    if policy != "bf16-true" or method != "full" or share < precision.VANISHING_WARN_SHARE:
        return None
    return (
        f"bf16-true: {share:.0%} of the trainable weights have a bf16 half-spacing larger than the learning "
        f"rate {lr:g}, so Adam's first updates to them (about the learning rate each) are rounded away and "
        f"those weights do not train. Use training.precision: bf16-mixed (fp32 master weights), or a "
        f"learning rate of at least {needed:g} (below {precision.VANISHING_WARN_SHARE:.0%} lost)"
    )


# --- the sections ------------------------------------------------------------------------------------


def declared(policy: precision.Policy, *, requested: str, family: str, load_dtype: str) -> dict:
    """run.json `precision` as the policy declares it; `live_section` fills the live fields."""
    return {
        "policy": policy.name,
        "requested": requested,
        "family": family,
        "load_dtype": load_dtype,
        **dict.fromkeys(("param_dtype", "compute_dtype", "optimizer_state_dtype", "master_weights", "reduce_dtype")),
        **dict.fromkeys(("observed_compute_dtype", "warning", "evidence")),
    }


def live_section(
    trainer,
    policy: precision.Policy,
    *,
    requested: str,
    family: str,
    method: str,
    load_dtype: str,
    learning_rate: float,
) -> dict:
    """run.json `precision` once the model is wrapped and the optimizer exists (on_train_begin): the
    declared section with what the live objects show, and under bf16-true the share of updates lost
    (summed over ranks: every rank must call it) with its warning."""
    live = read_live(trainer)
    section = {
        **declared(policy, requested=requested, family=family, load_dtype=load_dtype),
        **{
            k: live[k]
            for k in ("param_dtype", "compute_dtype", "optimizer_state_dtype", "master_weights", "reduce_dtype")
        },
        "evidence": live["evidence"],
    }
    if policy.name == "bf16-true":
        share, needed, _ = vanishing_share(trainer.model_wrapped, learning_rate)
        section["evidence"].update(bf16_update_loss_share=round(share, 4), bf16_lr_keeping_updates=needed)
        section["warning"] = bf16_true_warning(share, needed, learning_rate, policy=policy.name, method=method)
    return section


def first_observable_linear(model):
    """The first Linear with a trainable weight, whose output dtype in step 1's first forward is the compute dtype (not
    a frozen bitsandbytes Linear4bit: it casts its output back to the input dtype). GPT-2's Conv1D counts as one, and so
    do DeepSpeed AutoTP's split linears; an output head whose forward is the chunked loss does not (it returns the loss
    sum and count, finetune/modeling/loss.py). None: nothing to observe."""

    def observable(m) -> bool:
        # transformers.pytorch_utils Conv1D; deepspeed/module_inject/layers.py LinearLayer, LinearAllreduce
        linear = isinstance(m, torch.nn.Linear) or type(m).__name__ in ("Conv1D", "LinearLayer", "LinearAllreduce")
        return linear and m.weight.requires_grad and not hasattr(m, "finetune_loss_kernel")

    return next((m for m in model.modules() if observable(m)), None)
