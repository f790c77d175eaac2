"""`finetune train` builds the accelerate launch line from the recipe (no process is started here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from finetune.errors import ConfigError, UserError
from finetune.launch import cpu_rehearsal
from finetune.launch.accelerate import launch_command, launch_environment

REPO = Path(__file__).resolve().parents[2]  # the repository root


def test_recipe_config_is_used_and_deepspeed_json_made_absolute(monkeypatch):
    monkeypatch.delenv(cpu_rehearsal.ENV, raising=False)
    args = launch_command("zero3", ["--training.max_steps=2"], None, None)
    assert args[:2] == ["--config_file", str(REPO / "accelerate_configs" / "zero3.yaml")]
    assert args[2:4] == ["--deepspeed_config_file", str(REPO / "ds_configs" / "zero3.json")]
    assert args[-4:] == [str(REPO / "finetune" / "train.py"), "--recipe", "zero3", "--training.max_steps=2"]


def test_cpu_flag_swaps_in_the_cpu_variant_and_opts_in_to_gloo(monkeypatch):
    monkeypatch.delenv(cpu_rehearsal.ENV, raising=False)
    args = launch_command("fsdp", [], None, None, cpu=True, overwrite=True)
    assert args[1] == str(REPO / "accelerate_configs" / "cpu" / "fsdp.yaml")
    assert not cpu_rehearsal.requested()  # building the command leaves this process alone ...
    env = launch_environment(args)  # ... the launch sets what the ranks inherit
    assert env[cpu_rehearsal.ENV] == "1" and env["FINETUNE_ACCELERATE_CONFIG"] == args[1]
    assert "--overwrite" in args and "--cpu" not in args


def test_cpu_flag_on_a_single_process_recipe_passes_cpu_to_accelerate(monkeypatch):
    monkeypatch.delenv(cpu_rehearsal.ENV, raising=False)
    args = launch_command("demo", [], None, 1, cpu=True)
    assert cpu_rehearsal.ENV not in launch_environment(args)  # one process: accelerate's own --cpu
    assert args[1] == str(REPO / "accelerate_configs" / "single_gpu.yaml")
    assert "--cpu" in args and args[args.index("--num_processes") + 1] == "1"


def test_bad_override_fails_before_launch():
    with pytest.raises(ConfigError) as info:
        launch_command("demo", ["--training.max_stepz=2"], None, None)
    assert "training.max_stepz" in str(info.value)


def test_missing_config_file_is_named():
    with pytest.raises(UserError) as info:
        launch_command("demo", [], "accelerate_configs/nope.yaml", None)
    assert "nope.yaml" in str(info.value) and "--config_file" in str(info.value)


def test_train_sets_the_ranks_environment_only_for_its_launch(monkeypatch):
    """accelerate launch runs in-process: a second main() (a sweep, a test) must not inherit the
    first launch's CPU opt-in."""
    from finetune.cli import dispatch
    from finetune.launch import accelerate as launcher

    monkeypatch.delenv(cpu_rehearsal.ENV, raising=False)
    monkeypatch.delenv("FINETUNE_ACCELERATE_CONFIG", raising=False)
    monkeypatch.setattr("finetune.preflight.check_launch", lambda launch_args, **checks: None)
    seen = {}
    monkeypatch.setattr(launcher, "run_accelerate_launch", lambda launch_args: seen.update(os.environ) or 0)
    assert dispatch.main(["train", "--recipe", "fsdp", "--cpu"]) == 0
    assert seen[cpu_rehearsal.ENV] == "1"  # the ranks saw the opt-in ...
    assert seen["FINETUNE_ACCELERATE_CONFIG"].endswith("accelerate_configs/cpu/fsdp.yaml")
    assert cpu_rehearsal.ENV not in os.environ and "FINETUNE_ACCELERATE_CONFIG" not in os.environ  # ... we do not
