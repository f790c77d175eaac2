"""Preflight (finetune/preflight/checks.py): each check on a crafted config, and every problem in one error.

No model is loaded and no process is launched: `check_launch` reads the accelerate config
`finetune train` would launch, `check_before_loading` reads what a launched process sees.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from finetune import preflight
from finetune.cli import dispatch
from finetune.config.recipe import available_recipes
from finetune.errors import ConfigError
from finetune.launch import accelerate as launcher
from finetune.launch import cpu_rehearsal

REPO = Path(__file__).resolve().parents[2]  # the repository root


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    """No accelerate/torchrun variables from the shell or from other tests' `finetune train` calls."""
    for var in (
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "ACCELERATE_USE_DEEPSPEED",
        "ACCELERATE_USE_FSDP",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        "ACCELERATE_MIXED_PRECISION",
        "ACCELERATE_USE_CPU",
        "FINETUNE_ACCELERATE_CONFIG",
        cpu_rehearsal.ENV,
        "FSDP_OFFLOAD_PARAMS",
        "LOCAL_RANK",
    ):
        monkeypatch.setenv(var, "")  # records the original, so teardown also removes what the code sets
        monkeypatch.delenv(var)


def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, (dict, list)):
        content = json.dumps(content) if path.suffix == ".json" else yaml.safe_dump(content)
    path.write_text(content, encoding="utf-8")
    return path


def accelerate_yaml(tmp_path: Path, name: str = "launch.yaml", **values) -> Path:
    base = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": 1,
        "machine_rank": 0,
        "use_cpu": True,
        "distributed_type": "MULTI_CPU",
        "num_processes": 2,
    }
    return write(tmp_path / name, {**base, **values})


def deepspeed_yaml(tmp_path: Path, ds: dict, **values) -> Path:
    ds_file = write(tmp_path / "ds.json", ds)
    return accelerate_yaml(
        tmp_path,
        distributed_type="DEEPSPEED",
        deepspeed_config={"deepspeed_config_file": str(ds_file), "zero3_init_flag": False},
        **values,
    )


def zero(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        **extra,
    }


def problems_of(recipe: str, overrides: list[str], config: Path | None, *, cpu: bool = False) -> list[str]:
    args = ["--config_file", str(config)] if config else []
    args += ["--cpu"] if cpu else []
    try:
        preflight.check_launch([*args, str(launcher.TRAIN_SCRIPT), "--recipe", recipe, *overrides])
    except ConfigError as e:
        assert str(e).startswith(preflight.SOURCE)
        return e.problems
    return []


def one_problem(*args, **kwargs) -> str:
    found = problems_of(*args, **kwargs)
    assert len(found) == 1, found
    return found[0]


# --- the shipped recipes pass; each check fires on its crafted config ---------------------------


MESH_RECIPES = ("zero3_sp", "zero2_tp")  # hub models (their heads split in 2); the tiny Llama stands in here


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_shipped_recipe_passes_preflight_with_its_cpu_config(recipe, tiny_model_dir):
    # the tiny Llama has 512 positions (zero3_sp's 4,096 would be refused: data.max_length above them)
    overrides = [f"--model.name_or_path={tiny_model_dir}", "--data.max_length=512"] if recipe in MESH_RECIPES else []
    launch_args = launcher.launch_command(recipe, overrides, None, None, cpu=True)
    preflight.check_launch(launch_args)  # raises on any problem


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA as preflight sees it, on any machine: these tests skipped where a GPU was visible
    (issue 43 item 4). Imports first, as for fake_cuda."""
    problems_of("demo", [], None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_gpu_config_without_a_gpu_points_at_the_cpu_rehearsal(no_cuda):
    msg = one_problem("zero2", [], REPO / "accelerate_configs" / "zero2.yaml")
    assert "no CUDA GPU is visible" in msg and "finetune train --recipe zero2 --cpu" in msg


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine with CUDA as preflight sees it. Imports first: transformers and bitsandbytes probe
    CUDA at import time and must do so for real."""
    problems_of("demo", [], None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # tests that need a T4's answer set it
    return monkeypatch


def test_more_processes_than_visible_gpus(tmp_path, fake_cuda):
    config = accelerate_yaml(tmp_path, distributed_type="MULTI_GPU", use_cpu=False, num_processes=2)
    msg = one_problem("ddp", [], config)
    assert "2 processes per machine but only 1 CUDA device(s)" in msg and "--num_processes 1" in msg


def test_deepspeed_values_that_fight_training_arguments(tmp_path):
    ds = zero(
        2, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=4, train_batch_size=64, gradient_clipping=0.5
    )
    config = deepspeed_yaml(tmp_path, ds)
    found = problems_of("zero2", ["--training.per_device_train_batch_size=4"], config)
    text = "\n".join(found)
    assert len(found) == 4, found
    assert "train_micro_batch_size_per_gpu is 16 but training.per_device_train_batch_size gives 4" in text
    assert "gradient_accumulation_steps is 4 but training.gradient_accumulation_steps gives 1" in text
    assert "train_batch_size is 64 but" in text and "= 4 x 1 x 2" in text  # 4 per device x 1 x 2 processes = 8
    assert "gradient_clipping is 0.5 but training.max_grad_norm gives 1.0" in text
    assert all(str(tmp_path / "ds.json") in p and '"auto"' in p for p in found)


def test_deepspeed_values_that_agree_or_are_auto_pass(tmp_path):
    config = deepspeed_yaml(
        tmp_path, zero(2, train_micro_batch_size_per_gpu=4, train_batch_size=8, gradient_clipping=1.0)
    )
    assert problems_of("zero2", [], config) == []


def test_deepspeed_stage_and_offload_must_match_the_recipe(tmp_path):
    msg = one_problem("zero2", [], deepspeed_yaml(tmp_path, zero(3)))
    assert "meant for strategy 'zero2'" in msg and "sets up 'zero3'" in msg and "ds.json" in msg
    assert "accelerate_configs/cpu/zero2.yaml" in msg
    offloaded = zero(2)
    offloaded["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    msg = one_problem("zero2", [], deepspeed_yaml(tmp_path, offloaded))
    assert "with offload 'none'" in msg and "sets up 'zero2' with offload 'optimizer'" in msg


def test_deepspeed_fields_of_the_accelerate_config_count_too(tmp_path):
    config = accelerate_yaml(
        tmp_path, distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 3, "gradient_accumulation_steps": 2}
    )
    found = problems_of("zero2", [], config)
    assert len(found) == 2, found
    assert any("gradient_accumulation_steps is 2" in p for p in found)
    assert any("sets up 'zero3'" in p for p in found)


def test_deepspeed_and_fsdp_at_once(tmp_path, monkeypatch):
    config = accelerate_yaml(
        tmp_path,
        distributed_type="FSDP",
        fsdp_config={"fsdp_version": 2},
        deepspeed_config={"deepspeed_config_file": "ds_configs/zero2.json"},
    )
    msg = one_problem("fsdp", [], config)
    assert "distributed_type FSDP but the file also has a deepspeed_config section" in msg
    # inside a launched process: both switches in the environment
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "ds_configs" / "zero2.json"))
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(_recipe("demo"), _state())
    assert "ACCELERATE_USE_DEEPSPEED and ACCELERATE_USE_FSDP are both true" in str(err.value)


def test_qlora_storage_must_be_the_float_compute_dtype_under_zero3_and_fsdp(tmp_path):
    for config in (
        deepspeed_yaml(tmp_path, zero(3)),
        accelerate_yaml(tmp_path, distributed_type="FSDP", fsdp_config={"fsdp_version": 2}),
    ):
        msg = one_problem("demo", ["--method.name=qlora", "--method.quant_storage=uint8", "--run.strategy=any"], config)
        assert "method.quant_storage: 'uint8'" in msg and "float32 here" in msg and "quant_storage: auto" in msg
        assert (
            problems_of("demo", ["--method.name=qlora", "--method.quant_storage=auto", "--run.strategy=any"], config)
            == []
        )
    # not sharded: any storage works
    assert (
        problems_of(
            "demo",
            ["--method.name=qlora", "--method.quant_storage=uint8", "--run.strategy=any"],
            accelerate_yaml(tmp_path),
        )
        == []
    )


def test_precision_policies_on_cpu(no_cuda):
    # auto is 32-true here; bf16 autocast runs on CPU (the run sets use_cpu itself)
    assert problems_of("demo", [], None) == []
    assert problems_of("demo", ["--training.precision=bf16-mixed"], None) == []
    assert problems_of("demo", ["--training.precision=bf16-true"], None) == []
    msg = one_problem("demo", ["--training.precision=16-mixed"], None)
    assert "training.precision 16-mixed on CPU" in msg and "train in fp32 while reporting fp16" in msg
    assert "--training.precision=bf16-mixed" in msg and "--training.precision=32-true" in msg
    # auto resolves where the device is known: model.dtype must then agree with what it loads
    msg = one_problem("demo", ["--model.dtype=bfloat16"], None)
    assert msg.startswith("model.dtype: 'bfloat16' contradicts training.precision auto (32-true on this machine)"), msg
    assert problems_of("demo", ["--model.dtype=float32"], None) == []


def test_bf16_on_a_gpu_without_bf16(fake_cuda):
    fake_cuda.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    msg = one_problem("demo", ["--training.precision=bf16-mixed"], None)
    assert "training.precision bf16-mixed needs bf16, but Tesla T4 has none" in msg
    assert "--training.precision=16-mixed" in msg
    assert problems_of("demo", [], None) == []  # auto: 16-mixed on this GPU
    assert "float16" in one_problem("demo", ["--model.dtype=bfloat16"], None)  # the LoRA base of 16-mixed


def test_bf16_true_with_zero_offload_is_refused_before_loading(tmp_path):
    offloaded = zero(2)
    offloaded["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config = deepspeed_yaml(tmp_path, offloaded)
    msg = one_problem("zero2_offload", ["--training.precision=bf16-true"], config)
    assert "training.precision bf16-true with zero2 offload 'optimizer'" in msg
    assert "bf16-mixed with offload" in msg and "without offload" in msg
    assert problems_of("zero2_offload", ["--training.precision=bf16-mixed"], config) == []
    assert problems_of("zero2", ["--training.precision=bf16-true"], deepspeed_yaml(tmp_path, zero(2))) == []


def test_launch_precision_values_that_contradict_the_policy(tmp_path):
    config = accelerate_yaml(tmp_path, mixed_precision="bf16")
    msg = one_problem("ddp", ["--training.precision=32-true"], config)
    assert "mixed_precision 'bf16' contradicts training.precision 32-true" in msg and "remove mixed_precision" in msg
    assert problems_of("ddp", ["--training.precision=bf16-mixed"], config) == []
    assert problems_of("ddp", ["--training.precision=32-true"], accelerate_yaml(tmp_path, mixed_precision="no")) == []
    found = problems_of(
        "zero2",
        ["--training.precision=bf16-mixed"],
        deepspeed_yaml(tmp_path, zero(2, bf16={"enabled": False, "bf16_optimizer_states": True})),
    )
    assert len(found) == 2, found
    assert any("bf16.enabled is False but training.precision bf16-mixed needs True" in p for p in found)
    assert any("bf16.bf16_optimizer_states is True but training.precision bf16-mixed needs False" in p for p in found)
    assert (
        problems_of(
            "zero2",
            ["--training.precision=bf16-mixed"],
            deepspeed_yaml(tmp_path, zero(2, bf16={"enabled": True}, fp16={"enabled": "auto"})),
        )
        == []
    )


def test_dataset_missing_and_wrong_columns(tmp_path):
    msg = one_problem("demo", [f"--data.path={tmp_path / 'nope.jsonl'}", "--eval.exact_match=false"], None)
    assert msg == f"data.path: {tmp_path / 'nope.jsonl'}: file not found"
    data = write(tmp_path / "d.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n')
    msg = one_problem("demo", [f"--data.path={data}", "--eval.exact_match=false"], None)
    assert f"{data} row 2: missing key 'output'" in msg
    # on_bad_rows: skip trains on the good rows, so a bad row among good ones is no preflight problem
    assert (
        problems_of("demo", [f"--data.path={data}", "--data.on_bad_rows=skip", "--eval.exact_match=false"], None) == []
    )
    weird = write(tmp_path / "w.jsonl", '{"question": "a", "answer": "b"}\n')
    assert "cannot detect the data format" in one_problem(
        "demo", [f"--data.path={weird}", "--eval.exact_match=false"], None
    )


def test_existing_run_directory_is_reported_and_untouched(tmp_path):
    run_dir = tmp_path / "mine"  # a run's: run.json and config.yaml (rundir.is_run_dir)
    write(run_dir / "run.json", '{"precious": true}')
    write(run_dir / "config.yaml", "run: {}\n")
    msg = one_problem("demo", [f"--run.output_dir={run_dir}"], None)
    assert f"run directory {run_dir} already exists" in msg and "--overwrite" in msg
    assert f"--run.output_dir={tmp_path / 'mine-2'}" in msg and "--resume" not in msg  # no checkpoint to resume
    assert problems_of("demo", [f"--run.output_dir={run_dir}", "--run.overwrite=true"], None) == []
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "run.json"]
    assert "precious" in (run_dir / "run.json").read_text()


def test_a_run_directory_left_by_a_run_that_failed_before_step_1_is_not_a_problem(tmp_path):
    """Issue 15 item 11: a failed model download left runs/<name> behind and the retry was refused."""
    run_dir = tmp_path / "failed"
    write(run_dir / "run.json", {"summary": {"status": "failed", "steps": 0, "error": "OSError: offline"}, "steps": []})
    write(run_dir / "config.yaml", "model: {}\n")
    assert problems_of("demo", [f"--run.output_dir={run_dir}"], None) == []
    write(run_dir / "checkpoint-2" / "trainer_state.json", "{}")  # it trained: never reused
    msg = one_problem("demo", [f"--run.output_dir={run_dir}"], None)
    assert "--resume" in msg and "checkpoint-2" in msg and f"--run.output_dir={tmp_path / 'failed-2'}" in msg


def test_one_process_with_two_visible_gpus_is_refused_before_dataparallel(tmp_path, fake_cuda):
    """Issue 15 item 5: one process (distributed type NO) on a machine with two visible GPUs:
    Trainer would wrap the model in nn.DataParallel (n_gpu = 2) while the record says single."""
    fake_cuda.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = _recipe("demo", ["--eval.exact_match=false"])
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(cfg, _state())  # in the launched process
    msg = str(err.value)
    assert "2 CUDA devices visible" in msg and "torch.nn.DataParallel" in msg
    assert "CUDA_VISIBLE_DEVICES=0" in msg and "accelerate_configs/ddp.yaml finetune/train.py --recipe demo" in msg
    # before the launch: a one-process config leaving every GPU visible is refused; the shipped one pins GPU 0
    every_gpu = accelerate_yaml(tmp_path, distributed_type="NO", use_cpu=False, num_processes=1, gpu_ids="all")
    assert "torch.nn.DataParallel" in one_problem("demo", [], every_gpu)
    assert problems_of("demo", [], REPO / "accelerate_configs" / "single_gpu.yaml") == []
    assert problems_of("demo", ["--training.use_cpu=true"], every_gpu) == []  # a CPU run has no DataParallel
    fake_cuda.setattr(torch.cuda, "device_count", lambda: 1)  # control: one visible device is fine
    preflight.check_before_loading(cfg, _state())


def test_model_path_that_does_not_exist(tmp_path):
    msg = one_problem("demo", [f"--model.name_or_path={tmp_path / 'no-model'}"], None)
    assert msg.startswith("model.name_or_path:") and "no such local directory" in msg
    msg = one_problem("demo", [f"--model.name_or_path={tmp_path}"], None)
    assert "not a transformers model directory (no config.json)" in msg


def test_uncached_hub_id_offline_is_named_without_network_retries(monkeypatch, tmp_path):
    """The message says where the cache is (the folder looked in, the variables that move it) and the command that
    fetches the model (before: "not in the local Hugging Face cache", no path, no command)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    msg = one_problem("demo", ["--model.name_or_path=someorg/not-cached-model"], None)
    assert (
        f"'someorg/not-cached-model' is not in the Hugging Face cache {tmp_path / 'hub'} (HF_HUB_CACHE, else "
        "HF_HOME/hub), HF_HUB_OFFLINE=1, so the Hub is not tried" in msg
    ), msg
    assert "`hf download someorg/not-cached-model`" in msg and "models--someorg--not-cached-model" in msg, msg
    msg = one_problem("demo", ["--model.name_or_path=someorg/not-cached-model", "--model.revision=v2"], None)
    assert "`hf download someorg/not-cached-model --revision v2`" in msg, msg


def test_world_size_mismatch_in_a_launched_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(_recipe("demo"), _state(num_processes=1))
    assert "the launcher started 2 processes but Accelerate set up 1" in str(err.value)
    assert "FINETUNE_CPU_DISTRIBUTED=1" in str(err.value)


# --- who sets up the strategy (finetune/launch/strategy_setup.py) decides what preflight compares ------------


def _setup(recipe: str, launched=None, env=None):
    from finetune import resources
    from finetune.launch import strategy_setup as setup
    from finetune.launch.launcher import Launcher

    cfg = _recipe(recipe)
    return cfg, setup.decide(
        env or {}, launched or Launcher("accelerate launch"), cfg.run.strategy, cfg.run.offload, root=resources.ROOT
    )


@pytest.mark.parametrize(
    "recipe, dtype", [("zero2", "NO"), ("zero3_offload", "MULTI_CPU"), ("fsdp", "MULTI_GPU"), ("ddp", "MULTI_CPU")]
)
def test_a_plain_launch_passes_when_the_recipe_sets_up_its_strategy(recipe, dtype):
    """The issue's refusal of `accelerate launch finetune/train.py --recipe zero2` is gone: the facts are
    the recipe's row (its DeepSpeed JSON, FSDP settings; DDP in a group of one is DDP)."""
    cfg, setup = _setup(recipe)
    assert setup.set_up_by == "recipe"
    preflight.check_before_loading(cfg, _state(dtype=dtype), setup=setup)  # raises on any problem
    # control: read as a launcher setup (what main did before), the same launch is refused
    with pytest.raises(ConfigError, match=f"meant for strategy '{cfg.run.strategy}'"):
        preflight.check_before_loading(cfg, _state(dtype=dtype))


def test_a_launcher_deepspeed_setup_that_differs_is_refused_naming_the_default_config(monkeypatch):
    from finetune.launch.launcher import Launcher

    default = "/home/u/.cache/huggingface/accelerate/default_config.yaml"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "ds_configs" / "zero3.json"))
    import os

    cfg, setup = _setup("zero2", Launcher("accelerate launch", default, "default config"), dict(os.environ))
    assert setup.set_up_by == "launcher-config"
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(cfg, _state(), setup=setup)
    msg = err.value.problems[0]
    assert "ds_configs/zero3.json sets up 'zero3'" in msg and "--config_file accelerate_configs/zero2.yaml" in msg
    assert f"mv {default} {default}.off" in msg and "accelerate launch finetune/train.py --recipe zero2" in msg


def test_a_launcher_ddp_config_that_differs_is_refused_naming_the_file(monkeypatch):
    from finetune.launch.launcher import Launcher

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, setup = _setup("zero3", Launcher("accelerate launch", "/r/ddp.yaml", "--config_file"))
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(cfg, _state(num_processes=2, dtype="MULTI_CPU"), setup=setup)
    msg = err.value.problems[0]
    assert "the accelerate config /r/ddp.yaml (accelerate launch --config_file) sets up 'ddp'" in msg
    assert "mv " not in msg  # only a default config is moved aside


def test_a_one_device_recipe_under_two_launcher_processes_is_refused(monkeypatch):
    from finetune.launch.launcher import Launcher

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, setup = _setup("demo", Launcher("torchrun"))
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(cfg, _state(num_processes=2, dtype="MULTI_GPU"), setup=setup)
    assert "meant for strategy 'single'" in str(err.value) and "the processes of torchrun" in str(err.value)
    assert "sets up 'ddp'" in str(err.value)


def test_lone_processes_under_a_recipe_setup_get_the_torchrun_line(monkeypatch):
    from finetune.launch.launcher import Launcher

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, setup = _setup("zero2", Launcher("torchrun"))
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(cfg, _state(num_processes=1), setup=setup)
    assert "FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node 2 finetune/train.py --recipe zero2" in str(err.value)


def test_accelerate_launch_num_processes_that_started_one_process_is_refused():
    from finetune.launch.launcher import Launcher

    cfg, setup = _setup("zero2", Launcher("accelerate launch", num_processes=2))
    with pytest.raises(ConfigError) as err:
        preflight.check_before_loading(cfg, _state(), setup=setup)
    assert "accelerate launch --num_processes 2 started 1 process(es)" in str(err.value)
    assert "torchrun --nproc_per_node 2" in str(err.value)
    cfg, setup = _setup("zero2", Launcher("accelerate launch", num_processes=1))
    preflight.check_before_loading(cfg, _state(), setup=setup)  # control: what was asked for


def test_every_problem_is_reported_together_and_nothing_is_launched(tmp_path, monkeypatch, capsys):
    """One `finetune train` with eight independent mistakes (seven where CUDA runs 16-mixed): one error
    (exit 2) lists them all, and `accelerate launch` is never called."""
    run_dir = write(tmp_path / "old-run" / "run.json", "{}").parent
    ds = zero(3, train_micro_batch_size_per_gpu=16, gradient_clipping=0.5)
    config = deepspeed_yaml(tmp_path, ds)
    launched = []
    monkeypatch.setattr(launcher, "run_accelerate_launch", lambda args: launched.append(args) or 0)
    with pytest.raises(SystemExit) as exit_info:
        dispatch.main(
            [
                "train",
                "--recipe",
                "zero2",
                "--config_file",
                str(config),
                f"--data.path={tmp_path / 'missing.jsonl'}",
                "--eval.exact_match=false",
                f"--run.output_dir={run_dir}",
                "--training.precision=16-mixed",
                "--method.name=qlora",
                "--method.quant_storage=uint8",
                f"--model.name_or_path={tmp_path / 'no-model'}",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and launched == []
    on_cpu = not torch.cuda.is_available()
    assert f"preflight (nothing was started, loaded or written): {8 if on_cpu else 7} problems:" in err, err
    for part in (
        "train_micro_batch_size_per_gpu is 16",
        "gradient_clipping is 0.5",
        "meant for strategy 'zero2'",
        "method.quant_storage: 'uint8' under zero3",
        "missing.jsonl: file not found",
        "already exists",
        "no such local directory",
        "training.precision 16-mixed on CPU" if on_cpu else "uint8",
    ):
        assert part in err, part
    assert "Traceback" not in err and [p.name for p in run_dir.iterdir()] == ["run.json"]


def test_train_main_runs_preflight_before_the_run_directory(tmp_path, capsys):
    """In-process finetune.train.main: the problems come back together and nothing is created."""
    from finetune.training import run

    run_dir = tmp_path / "new-run"
    with pytest.raises(SystemExit) as exit_info:
        run.main(
            [
                "--recipe",
                "demo",
                f"--data.path={tmp_path / 'missing.jsonl'}",
                "--eval.exact_match=false",
                f"--run.output_dir={run_dir}",
                f"--model.name_or_path={tmp_path / 'no-model'}",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "2 problems" in err and "missing.jsonl" in err and "no-model" in err, err
    assert not run_dir.exists()


# --- helpers -------------------------------------------------------------------------------------


def _recipe(name: str, overrides: list[str] = ()):
    from finetune.config.recipe import load_recipe

    return load_recipe(name, list(overrides))[0]


def _state(num_processes: int = 1, dtype: str = "NO"):
    from accelerate.utils import DistributedType

    return SimpleNamespace(num_processes=num_processes, distributed_type=DistributedType(dtype), is_main_process=True)


# --- issue 27 item 1: lone processes refused before any process group, with the same strategy's CPU line ----


def test_lone_processes_are_refused_before_the_group_with_the_cpu_variant_of_the_same_config(monkeypatch):
    """`accelerate launch --config_file accelerate_configs/zero3.yaml finetune/train.py --recipe zero3` on a
    machine without a GPU: the fix names accelerate_configs/cpu/zero3.yaml and recipe zero3 (not a
    hard-coded DDP example); rank 0 raises the message, the other ranks exit 2 silently."""
    from finetune.errors import ReportedElsewhere
    from finetune.launch.launcher import Launcher
    from finetune.preflight import devices

    env = {"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_USE_DEEPSPEED": "true"}
    config = str(REPO / "accelerate_configs" / "zero3.yaml")
    cfg, setup = _setup("zero3", Launcher("accelerate launch", config, "--config_file"), env)
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        preflight.check_before_processes(cfg, setup, env)
    msg = str(err.value)
    assert (
        "FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file accelerate_configs/cpu/zero3.yaml "
        "finetune/train.py --recipe zero3" in msg
    )
    assert "cpu/ddp.yaml" not in msg and "--recipe ddp" not in msg
    with pytest.raises(ReportedElsewhere):  # after waiting for the launcher (not here: wait_s=0)
        preflight.check_before_processes(cfg, setup, {**env, "RANK": "1"}, wait_s=0)
    polls = []  # the launcher's SIGTERM, recorded by the rank's handler on the third poll: the wait ends there

    def stopped():
        polls.append(1)
        return len(polls) == 3

    with pytest.raises(ReportedElsewhere):
        preflight.check_before_processes(cfg, setup, {**env, "RANK": "1"}, wait_s=300, stopped=stopped)
    assert len(polls) == 3
    # controls: a GPU machine, the CPU opt-in, one process
    assert devices.lone_processes_problem(cfg, setup, env, cuda=True) is None
    assert devices.lone_processes_problem(cfg, setup, {**env, "WORLD_SIZE": "1"}, cuda=False) is None
    setup.cpu_gloo = "opt-in FINETUNE_CPU_DISTRIBUTED=1"
    assert devices.lone_processes_problem(cfg, setup, env, cuda=False) is None


def test_a_user_config_without_a_cpu_variant_gets_the_recipe_strategys_cpu_config(monkeypatch, tmp_path):
    from finetune.launch.launcher import Launcher
    from finetune.preflight import devices

    env = {"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}
    cfg, setup = _setup(
        "fsdp_offload", Launcher("accelerate launch", str(tmp_path / "mine.yaml"), "--config_file"), env
    )
    monkeypatch.chdir(REPO)
    msg = devices.lone_processes_problem(cfg, setup, env, cuda=False)
    assert "--config_file accelerate_configs/cpu/fsdp_offload.yaml finetune/train.py --recipe fsdp_offload" in msg


@pytest.mark.integration
def test_accelerate_launch_of_zero3_on_cpu_answers_once_with_its_cpu_line():
    """The issue's command, as a user types it from the repository root, CUDA hidden: rank 0's message
    once, the zero3 CPU line, no DeepSpeed op built (refused before any process group), rank 0 exit 2.
    What accelerate launch itself exits with is torch elastic's: 1 after a ChildFailedError report
    naming exitcode 2 (its own process: no rank can change that; `finetune train` passes the 2 on)."""
    from tests.conftest import run_process_group

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FINETUNE_", "ACCELERATE_"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml"]
    code, out, _ = run_process_group(
        [*cmd, "finetune/train.py", "--recipe", "zero3"], cwd=REPO, env=env, timeout=300, merge_stderr=True
    )
    assert out.count("processes were launched on a machine without a CUDA GPU") == 1, out[-4000:]
    assert "--config_file accelerate_configs/cpu/zero3.yaml finetune/train.py --recipe zero3" in out
    assert "shm_comm" not in out and "built successfully" not in out  # stopped before DeepSpeed's op build
    # rank 0 exits first, with 2; rank 1, waiting for the launcher to stop it, ends on its SIGTERM with
    # the same refusal (2), or dies of it before our handler exists (-15). Before, it slept on through
    # the SIGTERM it recorded until torchrun killed it 30 s later ("Unable to shutdown ... exiting via 9").
    root = out.split("Root Cause (first observed failure):")[-1]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 2 ", root), out[-3000:]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: (2|-15) ", out), out[-3000:]
    assert "forcefully exiting via 9" not in out, out[-3000:]
    assert code == 1  # accelerate launch's own exit after torch elastic's ChildFailedError
