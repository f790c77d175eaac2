"""Who sets up the strategy (finetune/launch/strategy_setup.py) and what started the process
(finetune/launch/launcher.py), on made-up command lines and environments: no process is launched.

The command lines are the ones seen from real ranks (the launches in
tests/training/test_strategies.py, which exercise the real parent-process reading): the
`accelerate` console script, `python -m accelerate.commands.launch` (the tests' form), torchrun's
agent, and a shell.
"""

from __future__ import annotations

import pytest

from finetune import resources
from finetune.launch import launcher
from finetune.launch import strategy_setup as setup
from finetune.launch.launcher import Launcher

SCRIPT = "finetune/train.py"
CWD = "/home/u/finetune"  # the launcher's working directory (a relative --config_file is resolved there)
PY = "/usr/bin/python3"


def parent(
    argv: list[str], *, default_config: str | None = None, env: dict | None = None, script: str = f"{CWD}/{SCRIPT}"
) -> Launcher:
    return launcher.from_parent_argv(
        argv, CWD, script=script, main_module=None, default_config=default_config, env=env or {}
    )


def test_launch_args_of_every_spelling_of_accelerate_launch():
    rest = ["--config_file", "c.yaml", SCRIPT, "--recipe", "zero2"]
    assert launcher.launch_args([PY, "/usr/bin/accelerate", "launch", *rest]) == rest
    assert launcher.launch_args([PY, "/usr/bin/accelerate-launch", *rest]) == rest
    assert launcher.launch_args([PY, "-m", "accelerate.commands.launch", *rest]) == rest
    assert launcher.launch_args([PY, "-m", "accelerate.commands.accelerate_cli", "launch", *rest]) == rest
    # not a launch: another accelerate command, torchrun, a shell
    assert launcher.launch_args([PY, "/usr/bin/accelerate", "config"]) is None
    assert launcher.launch_args([PY, "-m", "accelerate.commands.accelerate_cli", "env"]) is None
    assert launcher.launch_args([PY, "/usr/bin/torchrun", "--nproc_per_node", "2", SCRIPT]) is None
    assert launcher.launch_args(["/bin/bash"]) is None


def test_plain_accelerate_launch_read_no_config():
    got = parent([PY, "/usr/bin/accelerate", "launch", SCRIPT, "--recipe", "zero2"])
    assert got == Launcher("accelerate launch")
    assert got.describe() == "accelerate launch without an accelerate config"


@pytest.mark.parametrize(
    "argv",
    [
        [
            PY,
            "/usr/bin/accelerate",
            "launch",
            "--config_file",
            "accelerate_configs/ddp.yaml",
            SCRIPT,
            "--recipe",
            "zero3",
        ],
        [
            PY,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "accelerate_configs/ddp.yaml",
            SCRIPT,
            "--recipe",
            "zero3",
        ],
    ],
)
def test_config_file_is_read_from_the_parent_and_made_absolute(argv):
    got = parent(argv)
    assert (got.kind, got.config_file, got.config_from) == (
        "accelerate launch",
        f"{CWD}/accelerate_configs/ddp.yaml",
        "--config_file",
    )
    assert "(accelerate launch --config_file)" in got.describe()


def test_default_config_is_read_unless_config_file_or_cpu_is_given():
    """accelerate 1.15 commands/launch.py _validate_launch_command: `args.config_file is not None or
    os.path.isfile(default_config_file) and not args.cpu`."""
    default = "/home/u/.cache/huggingface/accelerate/default_config.yaml"
    plain = [PY, "/usr/bin/accelerate", "launch", SCRIPT, "--recipe", "zero2"]
    got = parent(plain, default_config=default)
    assert (got.config_file, got.config_from) == (default, "default config")
    assert got.describe().startswith(f"your accelerate default config {default}")
    with_cpu = [PY, "/usr/bin/accelerate", "launch", "--cpu", SCRIPT, "--recipe", "zero2"]
    assert parent(with_cpu, default_config=default) == Launcher("accelerate launch", cpu=True)
    explicit = [PY, "/usr/bin/accelerate", "launch", "--config_file", "/x/zero2.yaml", SCRIPT]
    assert parent(explicit, default_config=default).config_from == "--config_file"


def test_num_processes_on_the_parent_command_line_is_kept():
    got = parent([PY, "/usr/bin/accelerate", "launch", "--num_processes", "2", SCRIPT, "--recipe", "zero2"])
    assert got.num_processes == 2 and got.config_file is None


def test_torchrun_python_and_unknown_parents():
    assert parent([PY, "/usr/bin/torchrun", "--nproc_per_node", "2", SCRIPT]).kind == "torchrun"
    assert (
        parent([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT]).kind == "torchrun"
    )
    shell = parent(["/bin/bash"])
    assert shell.kind == "python" and shell.note == "no launcher, started by bash"
    # rank variables set by a launcher we cannot read (the deepspeed launcher, a wrapper): said, not guessed
    other = parent([PY, "-m", "deepspeed.launcher.launch", SCRIPT], env={"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert other.kind == "unknown" and "rank variables" in other.note


def test_a_parent_that_launched_another_script_is_not_trusted():
    got = parent([PY, "/usr/bin/accelerate", "launch", "--config_file", "c.yaml", "wrapper.py"])
    assert got.kind == "unknown" and got.config_file is None and "wrapper.py" in got.note


def test_finetune_train_is_known_by_its_variable():
    got = launcher.detect({"FINETUNE_ACCELERATE_CONFIG": "/r/accelerate_configs/zero2.yaml"})
    assert got == Launcher("finetune train", "/r/accelerate_configs/zero2.yaml", "finetune train")


# --- the decision ------------------------------------------------------------------------------

PLAIN = Launcher("accelerate launch")
ROOT = resources.ROOT


@pytest.mark.parametrize(
    "env, who",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "launcher-config"),
        ({"ACCELERATE_USE_FSDP": "true"}, "launcher-config"),
        ({"ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_USE_FSDP": "false"}, "recipe"),
        ({}, "recipe"),
    ],
)
def test_deepspeed_or_fsdp_in_the_environment_means_the_launcher_set_it_up(env, who):
    got = setup.decide(env, PLAIN, "zero2", "none", root=ROOT)
    assert got.set_up_by == who
    if who == "launcher-config":
        assert "=true" in got.because and got.trainer_arguments == {} and got.row is None


@pytest.mark.parametrize(
    "launched",
    [
        Launcher("accelerate launch", "/r/ddp.yaml", "--config_file"),
        Launcher("accelerate launch", "/h/default_config.yaml", "default config"),
        Launcher("finetune train", "/r/ddp.yaml", "finetune train"),
    ],
)
def test_a_config_file_read_by_the_launcher_sets_the_strategy_even_without_deepspeed_or_fsdp(launched):
    """A DDP or one-device config exports nothing of its own: only the parent's command line shows it."""
    got = setup.decide({}, launched, "zero3", "none", root=ROOT)
    assert got.set_up_by == "launcher-config" and got.row is None and got.trainer_arguments == {}
    assert "/ddp.yaml" in got.because or "default_config.yaml" in got.because


@pytest.mark.parametrize(
    "strategy, offload, key, arguments",
    [
        ("zero2", "none", "zero2", {"deepspeed": str(ROOT / "ds_configs/zero2.json")}),
        ("zero2", "any", "zero2", {"deepspeed": str(ROOT / "ds_configs/zero2.json")}),
        ("zero3", "optimizer+params", "zero3_offload", {"deepspeed": str(ROOT / "ds_configs/zero3_offload.json")}),
        ("ddp", "none", "ddp", {}),
        ("single", "none", "single", {}),
    ],
)
def test_without_a_launcher_config_the_recipe_row_is_engaged(strategy, offload, key, arguments):
    got = setup.decide({}, PLAIN, strategy, offload, root=ROOT)
    assert got.set_up_by == "recipe" and got.row.key == key and got.trainer_arguments == arguments
    assert got.needs_group == (strategy != "single")


def test_fsdp_rows_give_transformers_names_with_the_offload_key_it_reads():
    got = setup.decide({}, PLAIN, "fsdp", "optimizer+params", root=ROOT)
    args = got.trainer_arguments
    assert args["fsdp"] is True and args["fsdp_config"]["cpu_offload"] is True
    assert (
        args["fsdp_config"]["state_dict_type"] == "SHARDED_STATE_DICT" and "offload_params" not in args["fsdp_config"]
    )
    assert setup.decide({}, PLAIN, "fsdp", "none", root=ROOT).trainer_arguments["fsdp_config"]["cpu_offload"] is False


def test_a_recipe_that_accepts_any_strategy_takes_the_processes():
    got = setup.decide({}, Launcher("torchrun"), "any", "any", root=ROOT)
    assert got.set_up_by == "launcher-processes" and got.row is None and got.trainer_arguments == {}


# --- what the recipe route prepares ------------------------------------------------------------


@pytest.fixture
def detect(monkeypatch):
    """setup.detect with a given launcher and environment (the real parent is pytest's)."""
    from finetune.config.recipe import load_recipe

    def run(recipe: str, env: dict, launched: Launcher = PLAIN, cuda: bool = False):
        import torch

        monkeypatch.setattr(launcher, "detect", lambda env=None: launched)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.delenv("FINETUNE_CPU_DISTRIBUTED", raising=False)
        if "FINETUNE_CPU_DISTRIBUTED" in env:
            monkeypatch.setenv("FINETUNE_CPU_DISTRIBUTED", env["FINETUNE_CPU_DISTRIBUTED"])
        return setup.detect(load_recipe(recipe, [])[0], env)

    return run


def test_one_process_without_a_launcher_group_gets_a_world_of_one_and_gloo_on_cpu(detect):
    got = detect("zero2", {})
    assert got.world_of_one and got.cpu_gloo == "one process on a machine without CUDA"
    env = {"ACCELERATE_MIXED_PRECISION": "no"}
    setup.prepare(got, env)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 0 < int(env["MASTER_PORT"]) < 65536
    # a GPU: the same world of one, over NCCL (no gloo)
    on_gpu = detect("zero2", {}, cuda=True)
    assert on_gpu.world_of_one and on_gpu.cpu_gloo is None


def test_launcher_processes_are_kept_and_cpu_needs_the_opt_in_for_more_than_one(detect):
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    got = detect("zero3", torchrun, Launcher("torchrun"))
    assert not got.world_of_one and got.cpu_gloo is None  # preflight refuses: two lone processes
    opted = detect("zero3", {**torchrun, "FINETUNE_CPU_DISTRIBUTED": "1"}, Launcher("torchrun"))
    assert opted.cpu_gloo == "opt-in FINETUNE_CPU_DISTRIBUTED=1" and not opted.world_of_one


def test_accelerate_launch_cpu_drops_its_variable_and_takes_gloo(detect):
    """ACCELERATE_USE_CPU=True makes AcceleratorState skip DeepSpeed (`... and not cpu`): dropped here."""
    env = {"ACCELERATE_USE_CPU": "True"}
    got = detect("zero2", env, Launcher("accelerate launch", cpu=True), cuda=True)
    assert got.cpu_gloo == "accelerate launch --cpu" and got.world_of_one
    setup.prepare(got, env)
    assert "ACCELERATE_USE_CPU" not in env and env["WORLD_SIZE"] == "1"


def test_one_device_and_launcher_configs_change_nothing(detect):
    single = detect("demo", {})
    assert single.set_up_by == "recipe" and not single.world_of_one and single.cpu_gloo is None
    env = {}
    setup.prepare(single, env)
    assert env == {}
    config = detect("zero2", {}, Launcher("accelerate launch", "/r/ddp.yaml", "--config_file"))
    assert config.set_up_by == "launcher-config" and not config.world_of_one and config.cpu_gloo is None


def test_console_line_and_record_say_who_set_it_up():
    got = setup.decide({}, PLAIN, "zero3", "none", root=ROOT)
    got.cpu_gloo = "one process on a machine without CUDA"
    assert got.describe() == (
        f"strategy zero3 (offload none) set up by the recipe: TrainingArguments(deepspeed="
        f"{ROOT / 'ds_configs/zero3.json'}), gloo on CPU (one process on a machine without "
        f"CUDA); accelerate launch without an accelerate config set up no strategy"
    )
    rec = got.record()
    assert rec["row"] == "zero3" and rec["launcher"] == "accelerate launch" and rec["config_file"] is None
    cfg = setup.decide({}, Launcher("accelerate launch", "/r/zero2.yaml", "--config_file"), "zero2", "none", root=ROOT)
    assert cfg.describe() == (
        "strategy set up by the launcher: the accelerate config /r/zero2.yaml (accelerate launch --config_file)"
    )
    assert cfg.record()["trainer_arguments"] is None and cfg.record()["config_from"] == "--config_file"
