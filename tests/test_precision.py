"""The precision policy table (finetune/precision.py): resolution of `auto`, what each policy asks of
TrainingArguments, FSDP2 and DeepSpeed, and the bytes per parameter the planner reads. Expected
values come from the sources the table cites (ZeRO paper K = 12; DeepSpeed stage3.py's shared
master partition; Accelerate's autocast), not from the table itself."""

from __future__ import annotations

import pytest

from finetune import precision


@pytest.mark.parametrize(
    "cuda, bf16, want", [(False, False, "32-true"), (True, True, "bf16-mixed"), (True, False, "16-mixed")]
)
def test_auto_resolves_by_device(cuda, bf16, want):
    assert precision.resolve("auto", cuda, bf16).name == want


def test_explicit_names_resolve_to_themselves_and_unknown_names_are_refused():
    for name in precision.POLICY_NAMES:
        assert precision.resolve(name, False, False).name == name
    with pytest.raises(ValueError, match=r"no precision policy 'bf16'.*allowed: auto, bf16-mixed, bf16-true"):
        precision.resolve("bf16", True, True)


def test_training_args_per_family():
    mixed, true = precision.get("bf16-mixed"), precision.get("bf16-true")
    assert mixed.training_args("torch") == mixed.training_args("deepspeed") == {"bf16": True, "fp16": False}
    # bf16-true: no autocast for torch-native strategies, but DeepSpeed's bf16 mode (its module in bf16)
    assert true.training_args("torch") == {"bf16": False, "fp16": False}
    assert true.training_args("deepspeed") == {"bf16": True, "fp16": False}
    assert precision.get("16-mixed").training_args("fsdp2") == {"bf16": False, "fp16": True}
    assert precision.get("32-true").training_args("deepspeed") == {"bf16": False, "fp16": False}
    with pytest.raises(ValueError, match="no precision family 'ddp'"):
        mixed.training_args("ddp")


def test_fsdp2_policy_reduces_in_fp32_and_returns_the_loss_unrounded():
    assert precision.get("bf16-mixed").fsdp_mixed_precision() == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": None,
        "cast_forward_inputs": True,
    }
    assert precision.get("bf16-true").fsdp_mixed_precision() is None
    assert precision.get("32-true").fsdp_mixed_precision() is None


def test_deepspeed_keys():
    assert precision.get("bf16-mixed").deepspeed_keys() == {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    assert precision.get("bf16-true").deepspeed_keys()["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert not precision.get("bf16-true").deepspeed_offload_ok and precision.get("bf16-mixed").deepspeed_offload_ok


def test_load_dtype_per_method():
    assert precision.get("bf16-mixed").load_dtype("full") == "bfloat16"  # the master starts where DeepSpeed's does
    assert precision.get("16-mixed").load_dtype("full") == "float32"
    assert precision.get("16-mixed").load_dtype("lora") == "float16"
    assert precision.get("32-true").load_dtype("qlora") == "float32"


def test_family_of_every_strategy():
    assert [precision.family_of(k) for k in ("single", "ddp", "fsdp", "fsdp_offload", "zero2", "zero3_offload")] == [
        "torch",
        "torch",
        "fsdp2",
        "fsdp2",
        "deepspeed",
        "deepspeed",
    ]
    with pytest.raises(ValueError, match="no strategy 'hsdp'"):
        precision.family_of("hsdp")


def test_mixed_precision_adam_under_zero_is_the_papers_k_12():
    b = precision.trainable_bytes("bf16-mixed", "zero2")
    # ZeRO paper §3: 2 bytes of 16-bit parameters, 2 of 16-bit gradients, K = 12 (fp32 master, m, v)
    assert (b.params, b.grads, b.k) == (2, 2, 12)
    assert precision.trainable_bytes("bf16-mixed", "zero3").k == 12


def test_torch_native_bf16_mixed_holds_fp32_params_grads_states_and_a_bf16_working_copy():
    for key in ("single", "ddp"):
        b = precision.trainable_bytes("bf16-mixed", key)
        assert (b.params, b.grads, b.master, b.optimizer_states, b.working_params, b.reduce) == (4, 4, 0, 8, 2, 4)
    f = precision.trainable_bytes("bf16-mixed", "fsdp")
    assert (f.params, f.grads, f.optimizer_states, f.working_params, f.working_grads, f.reduce) == (4, 4, 8, 2, 2, 4)


def test_bf16_true_and_32_true_bytes():
    t = precision.trainable_bytes("bf16-true", "ddp")
    assert t.params + t.grads + t.master + t.optimizer_states == 8 and t.working_params == 0
    # DeepSpeed bf16-true: ZeRO-2 and ZeRO-3 both clone a bf16 master partition
    assert precision.trainable_bytes("bf16-true", "zero2").master == 2
    assert precision.trainable_bytes("bf16-true", "zero3").master == 2
    assert precision.trainable_bytes("32-true", "zero2").master == 4  # stage_1_and_2.py clones even in fp32
    # stage3.py would share an fp32 module partition, but compares a torch.device with a string
    # (never equal): the copy exists (issue 13: the H200 ZeRO-3 record needs it to add up)
    import torch

    assert torch.device("cpu") != "cpu"
    assert precision.trainable_bytes("32-true", "zero3").master == 4
    assert precision.trainable_bytes("32-true", "zero3_offload").master == 4  # converted copy on the host
    assert precision.trainable_bytes("32-true", "single").k == 8


def test_frozen_bytes():
    assert [precision.frozen_bytes(n) for n in precision.POLICY_NAMES] == [2, 2, 2, 4]


def test_expected_live_and_reduce_dtypes():
    assert precision.get("bf16-mixed").expected_live("fsdp2") == {
        "param_dtype": "float32",
        "compute_dtype": "bfloat16",
        "optimizer_state_dtype": "float32",
        "master_weights": True,
    }
    assert precision.get("bf16-mixed").allowed_reduce_dtypes("deepspeed") == ("bfloat16", "float32")
    assert precision.get("bf16-mixed").allowed_reduce_dtypes("torch") == ("float32",)
    assert precision.get("32-true").allowed_reduce_dtypes("deepspeed") == ("float32",)


LIVE_MIXED = {
    "param_dtype": "float32",
    "compute_dtype": "bfloat16",
    "optimizer_state_dtype": "float32",
    "master_weights": True,
    "reduce_dtype": "float32",
}


def test_mismatches_name_each_field_that_differs():
    mixed = precision.get("bf16-mixed")
    assert precision.mismatches(mixed, "fsdp2", LIVE_MIXED) == []
    assert precision.mismatches(mixed, "deepspeed", {**LIVE_MIXED, "reduce_dtype": "bfloat16"}) == []
    # what the GPU runs had under single/FSDP2: bf16 parameters and states, no master
    pure_bf16 = {**LIVE_MIXED, "param_dtype": "bfloat16", "optimizer_state_dtype": "bfloat16", "master_weights": False}
    assert precision.mismatches(mixed, "torch", pure_bf16) == [
        "param_dtype: the policy needs float32, the live run has bfloat16",
        "optimizer_state_dtype: the policy needs float32, the live run has bfloat16",
        "master_weights: the policy needs True, the live run has False",
    ]
    # Accelerate's default FSDP2 policy reduces in bf16
    assert precision.mismatches(mixed, "fsdp2", {**LIVE_MIXED, "reduce_dtype": "bfloat16"}) == [
        "reduce_dtype: the policy reduces gradients in float32 under fsdp2, the live run in bfloat16"
    ]
    # an optimizer whose state dtype is unknown before step 1, and one process (nothing reduced): not compared
    assert (
        precision.mismatches(mixed, "torch", {**LIVE_MIXED, "optimizer_state_dtype": None, "reduce_dtype": None}) == []
    )
    assert precision.mismatches(precision.get("32-true"), "torch", LIVE_MIXED) == [
        "compute_dtype: the policy needs float32, the live run has bfloat16",
        "master_weights: the policy needs False, the live run has True",
    ]


def test_config_problems_name_both_keys_and_the_fix():
    mixed = precision.get("bf16-mixed")
    assert precision.config_problems(mixed, model_dtype="auto", method="full") == []
    assert precision.config_problems(mixed, model_dtype="bfloat16", method="lora") == []
    (msg,) = precision.config_problems(mixed, model_dtype="float32", method="full")
    assert msg.startswith("model.dtype: 'float32' contradicts training.precision bf16-mixed, which loads full")
    assert "model.dtype: auto (or bfloat16)" in msg
    (msg,) = precision.config_problems(
        precision.get("32-true"), model_dtype="auto", method="qlora", compute_dtype="bfloat16", requested="auto"
    )
    assert msg.startswith("method.compute_dtype: 'bfloat16' contradicts training.precision auto (32-true on this")
    assert precision.config_problems(mixed, model_dtype="auto", method="lora", compute_dtype="bfloat16") == []


def test_precision_flags_of_training_arguments_are_refused_with_the_policy_to_use():
    from finetune.config.validate import build_config
    from finetune.errors import ConfigError

    for key, value, suggested in (
        ("bf16", True, "bf16-mixed"),
        ("fp16", True, "16-mixed"),
        ("bf16", False, "32-true"),
        ("bf16_full_eval", True, "bf16-mixed"),
    ):
        with pytest.raises(ConfigError) as e:
            build_config({"training": {key: value}})
        (msg,) = e.value.problems
        assert (
            msg.startswith(f"training.{key}: set by training.precision") and f"--training.precision={suggested}" in msg
        )
    assert build_config({"training": {"precision": "bf16-true"}}).training.precision == "bf16-true"
    assert build_config({}).training.precision == "auto"
    with pytest.raises(ConfigError, match=r"training.precision: got 'bf16'; allowed: auto, bf16-mixed"):
        build_config({"training": {"precision": "bf16"}})
    with pytest.raises(ConfigError, match=r"model.dtype: 'float32' contradicts training.precision bf16-true"):
        build_config({"training": {"precision": "bf16-true"}, "model": {"dtype": "float32"}})


def test_the_bytes_table_in_docs_precision_md_is_the_code():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "precision.md").read_text(encoding="utf-8")
    rows = [
        line.strip("|").split("|")
        for line in doc.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip() in precision.POLICY_NAMES
    ]
    assert len(rows) == 4 * 8, len(rows)
    for policy, strategy, *numbers in ([c.strip() for c in r] for r in rows):
        b = precision.trainable_bytes(policy, strategy)
        assert [int(n) for n in numbers] == [
            b.params,
            b.grads,
            b.master,
            b.optimizer_states,
            b.working_params,
            b.working_grads,
            b.reduce,
        ], (policy, strategy)
