"""finetune/doctor/agreement.py on hand-made run records (the fields of docs/run_record.md): what the
live engine must show per strategy row, each mismatch named, and the loss comparison's verdicts."""

from __future__ import annotations

import copy

import pytest

from finetune import strategies
from finetune.doctor import agreement
from tests.doctor.fakes import LOSSES, record


@pytest.mark.parametrize("key", [s.key for s in strategies.STRATEGIES if s.launchable])
def test_a_record_that_shows_its_row_passes(key):
    world = 1 if key == "single" else 2
    wrong, text = agreement.engaged(record(key, world), strategies.by_key(key), world, "32-true")
    assert wrong == [] and text


@pytest.mark.parametrize(
    "key, evidence, expected",
    [
        ("zero2", {"zero_stage": 3}, "strategy.evidence.zero_stage is 3, expected 2"),
        (
            "zero2_offload",
            {"basic_optimizer_class": "AdamW"},
            "strategy.evidence.basic_optimizer_class is 'AdamW', expected 'DeepSpeedCPUAdam'",
        ),
        (
            "zero3",
            {"local_param_fraction": 1.0},
            "strategy.evidence.local_param_fraction is 1.0: each of 2 rank(s) should",
        ),
        ("fsdp", {"dtensor_params": 0}, "strategy.evidence: 0 of 48 parameters are DTensors"),
        ("fsdp", {"fsdp_modules": 1}, "strategy.evidence.fsdp_modules is 1, expected >= 3"),
        ("fsdp_offload", {"fsdp_offload_policy": "OffloadPolicy"}, "expected 'CPUOffloadPolicy'"),
        ("ddp", {"engine_class": "PeftModelForCausalLM"}, "strategy.evidence.engine_class is 'PeftModelForCausalLM'"),
        ("ddp", {"world_size": 1}, "strategy.evidence.world_size is 1 (torch.distributed), expected 2"),
    ],
)
def test_each_evidence_mismatch_is_named(key, evidence, expected):
    wrong, _ = agreement.engaged(record(key, 2, **evidence), strategies.by_key(key), 2, "32-true")
    assert any(expected in w for w in wrong), wrong


def test_record_level_mismatches_name_and_precision():
    rec = record("zero3", 2)
    rec["strategy"]["name"] = "zero2"
    rec["precision"]["observed_compute_dtype"] = "bfloat16"
    wrong, _ = agreement.engaged(rec, strategies.by_key("zero3"), 2, "32-true")
    assert "strategy.name is 'zero2', expected 'zero3'" in wrong
    assert "precision.observed_compute_dtype is 'bfloat16' in step 1, expected 'float32'" in wrong
    wrong, _ = agreement.engaged(record("ddp", 2, policy="bf16-mixed"), strategies.by_key("ddp"), 2, "32-true")
    assert wrong == ["precision.policy is 'bf16-mixed', expected '32-true'"]


def test_equal_losses_agree_and_the_figures_are_recounted():
    ref = record("single", 1)
    nudged = [x * (1 + 3e-6) if i == 4 else x for i, x in enumerate(LOSSES)]
    cmp = agreement.compare(ref, record("zero2", 2, losses=nudged), 10)
    assert cmp["worst_step"] == 5 and cmp["max_loss_rel"] == pytest.approx(3e-6, rel=1e-6)
    line = agreement.agreement_line("zero2", cmp, "32-true", ("a", "b"))
    assert line.status == "ok" and line.detail.startswith(
        "within 1e-05 of single at every step (largest 3.0e-06 at step 5)"
    )


def test_a_loss_beyond_the_tolerance_is_a_disagreement_naming_the_differing_settings():
    ref, rec = record("single", 1), record("ddp", 2, losses=[x * (1 + 2e-5) for x in LOSSES])
    rec["lr"]["applied"] = 2e-3
    line = agreement.agreement_line(
        "ddp",
        agreement.compare(ref, rec, 10),
        "32-true",
        ("runs/s", "runs/d"),
        overrides=["--training.learning_rate=2e-3"],
    )
    assert line.status == "problem"
    assert "loss differs from single by 2.0e-05 relative (tolerance 1e-05, 32-true)" in line.detail
    assert "the records differ in lr.applied 0.002 != 0.001" in line.detail
    assert "(misconfigured on purpose by --override: --training.learning_rate=2e-3)" in line.detail
    assert line.fix.startswith(
        "ddp trained differently from one process on the same data: finetune compare runs/s runs/d"
    )


def test_other_data_and_other_clipping_are_named_as_finetune_compare_names_differences():
    ref, rec = record("single", 1), record("zero2", 2)
    assert agreement.differences(ref, rec) == []
    rec["config"]["training"]["max_grad_norm"] = 0.5
    rec["config"]["data"] = {"path": "other.jsonl"}
    assert agreement.differences(ref, rec) == [
        "data.path 'other.jsonl' != None",
        "config.training.max_grad_norm 0.5 != 1.0",
    ]


def test_bf16_mixed_uses_its_own_tolerance_and_other_policies_are_not_judged():
    ref, rec = (
        record("single", 1, policy="bf16-mixed"),
        record("zero3", 2, policy="bf16-mixed", losses=[x * (1 + 5e-5) for x in LOSSES]),
    )
    assert agreement.agreement_line("zero3", agreement.compare(ref, rec, 10), "bf16-mixed", ("a", "b")).status == "ok"
    assert agreement.agreement_line("zero3", agreement.compare(ref, rec, 10), "32-true", ("a", "b")).status == "problem"
    line = agreement.agreement_line("zero3", agreement.compare(ref, rec, 10), "16-mixed", ("a", "b"))
    assert line.status == "skipped" and line.detail.startswith("no tolerance derived for 16-mixed")


def test_other_tokens_or_missing_steps_are_problems():
    ref, rec = record("single", 1), record("fsdp", 2)
    rec["steps"][3]["trained_tokens"] += 1
    line = agreement.agreement_line("fsdp", agreement.compare(ref, rec, 10), "32-true", ("a", "b"))
    assert line.status == "problem" and "other tokens trained at step(s) [4] (not the same rows)" in line.detail
    short = copy.deepcopy(ref)
    short["steps"] = short["steps"][:9]
    line = agreement.agreement_line("fsdp", agreement.compare(ref, short, 10), "32-true", ("a", "b"))
    assert line.status == "problem" and "do not both log steps 1..N" in line.detail


def test_a_non_finite_loss_never_agrees():
    ref, rec = record("single", 1), record("zero2", 2, losses=[*LOSSES[:2], float("nan"), *LOSSES[3:]])
    line = agreement.agreement_line("zero2", agreement.compare(ref, rec, 10), "32-true", ("a", "b"))
    assert line.status == "problem" and line.detail.startswith("step 3 loss differs from single by inf relative")


def test_grad_norms_are_compared_too():
    ref, rec = record("single", 1), record("zero2", 2)
    rec["steps"][2]["grad_norm"] = 1.2 * (1 + 2e-4)
    line = agreement.agreement_line("zero2", agreement.compare(ref, rec, 10), "32-true", ("a", "b"))
    assert line.status == "problem" and line.detail == "grad norm by 2.0e-04 (tolerance 0.0001)"


def test_the_predicted_peak_beside_the_measured_one():
    m = agreement.memory(record("single", 1))
    assert agreement.memory_text(m) == "host RSS 1.49 / 0.70 GiB (+113%)"
    gpu = record("single", 1)
    gpu["predicted_memory"]["error"]["device_allocated"] = {
        "predicted_gib": 9.5,
        "measured_gib": 10.0,
        "relative_error": -0.05,
    }
    assert agreement.memory_text(agreement.memory(gpu)) == "device allocated 9.50 / 10.00 GiB (-5%)"
    assert agreement.memory_text(agreement.memory({})) == "n/a (no prediction in run.json)"
