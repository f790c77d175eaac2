"""The engaged-strategy decision (finetune/training/strategy_evidence.py) from live evidence, and the refusal
with the launch line, without a launch (the launches: tests/training/test_strategies.py)."""

from __future__ import annotations

import pytest


def _evidence(**kw) -> dict:
    base = {
        "engine_class": "PeftModelForCausalLM",
        "zero_stage": None,
        "offload_optimizer_device": None,
        "offload_param_device": None,
        "fsdp_modules": 0,
        "dtensor_params": 0,
        "params": 48,
        "fsdp_offload_policy": None,
        "world_size": 2,
    }
    return {**base, **kw}


@pytest.mark.parametrize(
    "evidence, expected",
    [
        (_evidence(engine_class="DistributedDataParallel"), ("ddp", "none")),
        (
            _evidence(
                engine_class="DeepSpeedEngine",
                zero_stage=3,
                offload_optimizer_device="cpu",
                offload_param_device="cpu",
                optimizer_offloaded=True,
                params_offloaded=True,
            ),
            ("zero3", "optimizer+params"),
        ),
        # the config says offload but the optimizer did not take it: the optimizer's flag wins
        (
            _evidence(
                engine_class="DeepSpeedEngine", zero_stage=2, offload_optimizer_device="cpu", optimizer_offloaded=False
            ),
            ("zero2", "none"),
        ),
        (
            _evidence(
                engine_class="FSDPPeftModelForCausalLM",
                fsdp_modules=3,
                dtensor_params=48,
                fsdp_offload_policy="CPUOffloadPolicy",
            ),
            ("fsdp", "optimizer+params"),
        ),
        # an FSDP launch Accelerate turned into DDP: no FSDP modules, no DTensors
        (_evidence(engine_class="DistributedDataParallel", fsdp_modules=0), ("ddp", "none")),
        (_evidence(world_size=1), ("single", "none")),
        # one MULTI_CPU process (a DDP run resumed on one process): Accelerate still wraps it in DDP
        (_evidence(engine_class="DistributedDataParallel", world_size=1), ("single", "none")),
        (_evidence(world_size=2), ("PeftModelForCausalLM", "none")),  # two ranks, nothing wrapping: not a strategy
    ],
)
def test_strategy_is_decided_by_the_live_evidence(evidence, expected):
    from finetune.training.strategy_evidence import strategy_from_evidence

    assert strategy_from_evidence(evidence) == expected


def test_offload_mismatch_is_refused_with_the_launch_line():
    from finetune.errors import UserError
    from finetune.training.strategy_evidence import check_expected

    engaged = {
        "name": "zero3",
        "offload": "none",
        "distributed_type": "DEEPSPEED",
        "world_size": 2,
        "evidence": {"engine_class": "DeepSpeedEngine"},
    }
    check_expected("zero3", engaged, "zero3", "none")
    check_expected("any", engaged, "custom", "any")
    with pytest.raises(UserError) as err:
        check_expected("zero3", engaged, "zero3_offload", "optimizer+params")
    msg = str(err.value)
    assert "offload 'optimizer+params'" in msg and "Nothing was trained" in msg
    assert "--config_file accelerate_configs/zero3_offload.yaml finetune/train.py --recipe zero3_offload" in msg
    assert "FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file accelerate_configs/cpu/zero3_offload.yaml" in msg
