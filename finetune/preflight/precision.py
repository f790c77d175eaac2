"""Preflight's check of the precision policy against the launch: combinations it cannot honour,
each with the alternative. The policy itself is resolved with the launch (finetune/launch/plan.py);
what engaged is proven later from the live objects (finetune/training/precision_evidence.py).
"""

from __future__ import annotations

from finetune import precision
from finetune.launch.configs import DeclaredLaunch
from finetune.launch.plan import LaunchPlan


def policy_problems(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """Combinations the policy cannot honour, each with the alternative (docs/bad_inputs.md)."""
    import torch

    facts, policy, fam, cuda = launch.facts, launch.policy, launch.family, launch.cuda
    label = precision.policy_label(policy, cfg.training.precision)
    problems = []
    if cfg.training.precision == "auto":  # explicit policies were checked with the config
        problems += precision.config_problems(
            policy,
            model_dtype=cfg.model.dtype,
            method=cfg.method.name,
            compute_dtype=cfg.method.compute_dtype,
            requested="auto",
        )
    if policy.needs_cuda and not cuda:
        problems.append(
            f"training.precision {label} on CPU: Accelerate skips fp16 autocast and loss scaling on "
            f"CPU and would train in fp32 while reporting fp16 (accelerate/accelerator.py), and "
            f"DeepSpeed refuses fp16 there; use --training.precision=bf16-mixed (bf16 autocast runs "
            f"on CPU) or --training.precision=32-true"
        )
    if cuda and "bfloat16" in (policy.compute_dtype, policy.master_dtype) and not torch.cuda.is_bf16_supported():
        problems.append(
            f"training.precision {label} needs bf16, but {torch.cuda.get_device_name(0)} has none "
            f"(compute capability 8.0+, Ampere or newer); use --training.precision=16-mixed "
            f"(or auto, which picks it on this GPU)"
        )
    strategy, offload = launch.strategy, launch.offload
    if fam == "deepspeed" and offload != "none" and not policy.deepspeed_offload_ok:
        problems.append(
            f"training.precision {label} with {strategy} offload {offload!r} ({facts.deepspeed_source}): "
            f"DeepSpeed's offloaded optimizer (DeepSpeedCPUAdam, built by Accelerate) keeps fp32 states "
            f"and asserts on bf16 ones; use --training.precision=bf16-mixed with offload, or "
            f"bf16-true with the {strategy} config without offload"
        )
    want = policy.training_args(fam)
    want_mp = "bf16" if want["bf16"] else "fp16" if want["fp16"] else "no"
    if facts.mixed_precision in ("bf16", "fp16") and facts.mixed_precision != want_mp and fam != "deepspeed":
        problems.append(
            f"{facts.source}: mixed_precision {facts.mixed_precision!r} contradicts training.precision "
            f"{label} (which needs Accelerate's mixed precision {want_mp!r}); remove mixed_precision from "
            f"the accelerate config (the policy sets it) or choose the matching training.precision"
        )
    if fam == "deepspeed" and facts.deepspeed:
        problems += _deepspeed_keys(policy, label, facts)
    return problems


def _deepspeed_keys(policy: precision.Policy, label: str, facts: DeclaredLaunch) -> list[str]:
    """Explicit DeepSpeed precision values must be the policy's; "auto" or absent: the policy fills
    them in (TrainingArguments for bf16/fp16.enabled, finetune/training/build.py apply_precision for the rest)."""
    low = policy.deepspeed_low_precision_master
    wanted = {
        ("bf16", "enabled"): policy.deepspeed_bf16,
        ("fp16", "enabled"): policy.deepspeed_fp16,
        ("bf16", "bf16_master_weights_and_grads"): low,
        ("bf16", "bf16_optimizer_states"): low,
    }
    problems = []
    for (section, key), want in wanted.items():
        have = (facts.deepspeed.get(section) or {}).get(key)
        if have in (None, "auto") or bool(have) == want:
            continue
        problems.append(
            f"{facts.deepspeed_source}: {section}.{key} is {have!r} but training.precision {label} "
            f'needs {want!r}; set it to "auto" (or remove it): the policy fills it in'
        )
    return problems
