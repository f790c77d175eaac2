"""The strategy table (finetune/strategies.py) against the files it names: every row's accelerate
config, CPU variant, DeepSpeed JSON and recipe exist and say the same strategy as the row, read
by Accelerate's own config loader and by the launch-facts reader preflight uses; every shipped
file belongs to a row. Expected values come from the shipped files, not from the table."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from finetune import resources, strategies
from finetune.launch.configs import from_config_file

ROWS = list(strategies.STRATEGIES)
SHIPPED = [s for s in ROWS if s.launchable]
ids = [s.key for s in ROWS]


def _accelerate(relative: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(resources.resolve(relative)))


def test_keys_and_recipe_facing_names_are_unique():
    assert len({s.key for s in ROWS}) == len(ROWS)
    pairs = [(s.name, s.offload) for s in SHIPPED]
    assert len(set(pairs)) == len(pairs), pairs


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_planner_flags_follow_the_zero_stage(row):
    """ZeRO paper §5: stage 1 shards optimizer states, 2 also gradients, 3 also parameters;
    FSDP2 shards all three; DDP and one device shard nothing."""
    if row.zero_stage is not None:
        expected = {1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}[row.zero_stage]
    else:
        expected = {"single": (False,) * 3, "ddp": (False,) * 3, "fsdp": (True,) * 3}[row.name]
    assert (row.shards_params, row.shards_grads, row.shards_optimizer) == expected
    assert row.offload == strategies.offload_name(
        "cpu" if row.offload_optimizer else "none", "cpu" if row.offload_params else "none"
    )
    assert (row.distributed_type == "DEEPSPEED") == (row.zero_stage is not None)


@pytest.mark.parametrize("row", SHIPPED, ids=[s.key for s in SHIPPED])
def test_shipped_accelerate_config_and_deepspeed_json_agree_with_the_row(row):
    cfg = _accelerate(row.accelerate_config)
    assert cfg.distributed_type == row.distributed_type
    ds_file = (cfg.deepspeed_config or {}).get("deepspeed_config_file")
    assert ds_file == row.deepspeed_config
    if ds_file:
        ds = json.loads(resources.resolve(ds_file).read_text())
        zero = ds["zero_optimization"]
        assert zero["stage"] == row.zero_stage
        assert (
            strategies.offload_name(
                strategies.offload_device(zero.get("offload_optimizer")),
                strategies.offload_device(zero.get("offload_param")),
            )
            == row.offload
        )
    if row.distributed_type == "FSDP":
        assert cfg.fsdp_config["fsdp_offload_params"] == (row.offload == "optimizer+params")
    # The reader preflight and `finetune train` use gives the row's (name, offload) back.
    facts = from_config_file(resources.resolve(row.accelerate_config), base_dirs=[resources.ROOT])
    assert facts.problems == [] and facts.strategy() == (row.name, row.offload)


@pytest.mark.parametrize("row", SHIPPED, ids=[s.key for s in SHIPPED])
def test_cpu_variant_is_the_same_strategy_over_gloo(row):
    if row.cpu_config is None:  # one process: `--cpu` passes accelerate's own --cpu
        assert _accelerate(row.accelerate_config).num_processes == 1
        assert resources.cpu_variant(resources.resolve(row.accelerate_config)) == resources.resolve(
            row.accelerate_config
        )
        return
    assert resources.cpu_variant(resources.resolve(row.accelerate_config)) == resources.resolve(row.cpu_config)
    gpu, cpu = _accelerate(row.accelerate_config), _accelerate(row.cpu_config)
    assert cpu.use_cpu is True and cpu.num_processes == gpu.num_processes == 2
    assert cpu.distributed_type == row.distributed_type  # torchrun starts them; FINETUNE_CPU_DISTRIBUTED joins gloo
    assert (cpu.deepspeed_config or {}).get("deepspeed_config_file") == row.deepspeed_config
    facts = from_config_file(resources.resolve(row.cpu_config), base_dirs=[resources.ROOT])
    assert facts.problems == [] and facts.strategy() == (row.name, row.offload)


@pytest.mark.parametrize("row", [s for s in ROWS if s.recipe], ids=[s.key for s in ROWS if s.recipe])
def test_strategy_recipe_names_the_row(row):
    run = yaml.safe_load((resources.RECIPES / f"{row.recipe}.yaml").read_text())["run"]
    assert (run["strategy"], run["offload"], run["accelerate_config"]) == (row.name, row.offload, row.accelerate_config)


def test_every_shipped_file_belongs_to_a_row():
    named = {s.accelerate_config for s in SHIPPED} | {s.cpu_config for s in SHIPPED if s.cpu_config}
    shipped = {str(p.relative_to(resources.ROOT)) for p in resources.ACCELERATE_CONFIGS.rglob("*.yaml")}
    # the two-node example launches the zero3 row's recipe on more machines (README, SLURM)
    assert shipped - named == {"accelerate_configs/two_node_zero3.yaml"}, shipped - named
    assert {str(p.relative_to(resources.ROOT)) for p in resources.DS_CONFIGS.glob("*.json")} == {
        s.deepspeed_config for s in SHIPPED if s.deepspeed_config
    }
    # every shipped recipe that names a strategy (other than the demo, which is `single` with
    # the recipe's own method) is a row's recipe; the sweep offers exactly these
    from finetune.compare.sweep import strategy_names

    assert strategy_names() == ["single", *sorted(s.recipe for s in ROWS if s.recipe)]


@pytest.mark.parametrize(
    "dtype, kwargs, name",
    [
        ("DEEPSPEED", {"zero_stage": 3}, "zero3"),
        ("FSDP", {}, "fsdp"),
        ("MULTI_CPU", {}, "ddp"),
        ("NO", {}, "single"),
        ("MULTI_GPU", {"num_processes": 1}, "single"),
        ("MULTI_GPU", {"num_processes": 2}, "ddp"),
        ("NO", {"num_processes": 2}, "no"),
        ("XLA", {}, "xla"),
    ],
)
def test_distributed_type_to_name(dtype, kwargs, name):
    assert strategies.name_of(dtype, **kwargs) == name


@pytest.mark.parametrize(
    "name, offload, key",
    [
        ("zero2", "optimizer", "zero2_offload"),
        ("zero3", "optimizer", "zero3_offload_opt"),
        ("zero3", "params", "zero3_offload"),
        ("fsdp", "optimizer", "fsdp_offload"),
        ("zero1", "optimizer", "zero1"),
        ("single", "none", "single"),
    ],
)
def test_engaged_strategy_to_planner_row(name, offload, key):
    assert strategies.planner_key(name, offload) == key


def test_unknown_strategy_has_no_planner_row():
    with pytest.raises(ValueError, match="no memory model for strategy 'xla'"):
        strategies.planner_key("xla")


def test_launch_line_names_the_shipped_configs():
    line = strategies.launch_line("zero3", "optimizer+params", "r")
    assert "--config_file accelerate_configs/zero3_offload.yaml finetune/train.py --recipe r" in line
    assert "--config_file accelerate_configs/cpu/zero3_offload.yaml" in line
    assert strategies.launch_line("single", "none", "r").count("accelerate launch") == 1
    assert Path(resources.ROOT / "accelerate_configs/zero3_offload.yaml").is_file()


# --- one source of truth: the shipped configs and the in-script route come from the table ---------


def accelerate_config(row: strategies.Strategy, *, cpu: bool) -> dict:
    """The content (comments aside) the row's shipped accelerate config, or its accelerate_configs/cpu/
    variant, must have: the row's engine and files, the FSDP settings in accelerate's names (`fsdp_` first)."""
    if not row.multi_process:
        if cpu:
            raise ValueError("the single-device row has no CPU variant (one process runs on a CPU as it is)")
        return {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": "NO",
            "num_machines": 1,
            "num_processes": 1,
            "machine_rank": 0,
            "mixed_precision": "no",
            "use_cpu": False,
            "gpu_ids": "0",
        }  # one GPU visible: never nn.DataParallel (finetune/preflight/devices.py)
    out: dict = {"compute_environment": "LOCAL_MACHINE", "distributed_type": row.distributed_type}
    if row.zero_stage is not None:  # precision comes from the JSON ("auto" = TrainingArguments bf16/fp16)
        out["deepspeed_config"] = {
            "deepspeed_config_file": row.deepspeed_config,
            "deepspeed_multinode_launcher": "standard",
            # = DeepSpeedPlugin's default in-script (hf_ds_config.is_zero3())
            "zero3_init_flag": row.zero_stage == 3,
        }
    else:
        out["mixed_precision"] = "no"
    if row.fsdp is not None:
        out["fsdp_config"] = {f"fsdp_{k}": v for k, v in asdict(row.fsdp).items()}
    out.update(
        num_machines=1,
        num_processes=strategies.SHIPPED_PROCESSES,
        machine_rank=0,
        main_training_function="main",
        rdzv_backend="static",
        same_network=True,
        use_cpu=cpu,
    )
    if not cpu:
        out["gpu_ids"] = "all"
    return out


@pytest.mark.parametrize(
    "row, cpu",
    [(s, cpu) for s in SHIPPED for cpu in (False, True) if not cpu or s.cpu_config],
    ids=lambda v: v.key if hasattr(v, "key") else ("cpu" if v else "gpu"),
)
def test_shipped_accelerate_config_is_what_the_table_generates(row, cpu):
    """Every value of every shipped accelerate config (comments aside) = accelerate_config above:
    a setting changed in one place only fails here, so the launcher route and the in-script route
    (strategies.trainer_arguments) cannot drift apart."""
    path = row.cpu_config if cpu else row.accelerate_config
    shipped = yaml.safe_load(resources.resolve(path).read_text())
    generated = accelerate_config(row, cpu=cpu)
    assert shipped == generated, {
        k: (shipped.get(k), generated.get(k)) for k in {*shipped, *generated} if shipped.get(k) != generated.get(k)
    }


def test_generated_config_differs_when_a_setting_differs():
    """Control: the comparison above sees a one-setting change."""
    from dataclasses import replace

    row = strategies.by_key("fsdp")
    other = replace(row, fsdp=replace(row.fsdp, reshard_after_forward=False))
    assert yaml.safe_load(resources.resolve(row.accelerate_config).read_text()) != accelerate_config(other, cpu=False)


@pytest.mark.parametrize("row", SHIPPED, ids=[s.key for s in SHIPPED])
def test_in_script_arguments_name_the_rows_files_and_settings(row):
    args = strategies.trainer_arguments(row, resources.ROOT)
    if row.zero_stage is not None:  # the same JSON the accelerate config names, made absolute
        ds_file = yaml.safe_load(resources.resolve(row.accelerate_config).read_text())["deepspeed_config"]
        assert args == {"deepspeed": str(resources.resolve(ds_file["deepspeed_config_file"]))}
        assert ds_file["zero3_init_flag"] == (row.zero_stage == 3)  # = DeepSpeedPlugin's in-script default
    elif row.distributed_type == "FSDP":
        assert args["fsdp"] is True and args["fsdp_config"]["cpu_offload"] == (row.offload == "optimizer+params")
        # In-script, the plugin exists only after from_pretrained, so RAM-efficient loading (which needs
        # ACCELERATE_USE_FSDP + FSDP_CPU_RAM_EFFICIENT_LOADING during the load) would silently not happen.
        assert row.fsdp.cpu_ram_efficient_loading is False
    else:
        assert args == {}
    assert strategies.by_recipe(row.name, row.offload) == row


def _launcher_fsdp_env(config: Path) -> dict:
    """The FSDP_* / ACCELERATE_USE_FSDP variables `accelerate launch --config_file CONFIG` exports to
    its ranks (accelerate 1.15 commands/launch.py + utils/launch.py prepare_multi_gpu_env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config), "x.py"]))
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"}


def _forget_fsdp_env(monkeypatch, config: Path) -> None:
    """No FSDP variable from elsewhere, and none left behind: TrainingArguments(fsdp=...) itself
    exports FSDP_CPU_RAM_EFFICIENT_LOADING (transformers 5.23); setenv+delenv records the original
    so monkeypatch's teardown restores it (or removes what the test set)."""
    for key in {*_launcher_fsdp_env(config), "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_USE_FSDP"}:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


PLUGIN_FIELDS = (
    "fsdp_version",
    "reshard_after_forward",
    "auto_wrap_policy",
    "transformer_cls_names_to_wrap",
    "min_num_params",
    "state_dict_type",
    "cpu_offload",
    "cpu_ram_efficient_loading",
    "activation_checkpointing",
    "sync_module_states",
    "use_orig_params",
    "forward_prefetch",
    "backward_prefetch",
    "mixed_precision_policy",
    "ignored_modules",
    "state_dict_config",
    "optim_state_dict_config",
)


def _plugin_view(plugin) -> dict:
    import enum

    out = {}
    for name in PLUGIN_FIELDS:
        v = getattr(plugin, name)
        if isinstance(v, enum.Enum) or isinstance(v, (bool, int, str, list, type(None))):
            out[name] = v
        elif callable(v) and hasattr(v, "__name__"):
            out[name] = v.__name__
        else:
            out[name] = (type(v).__name__, vars(v) if hasattr(v, "__dict__") else repr(v))
    return out


@pytest.mark.parametrize(
    "config", [s.accelerate_config for s in SHIPPED if s.fsdp] + [s.cpu_config for s in SHIPPED if s.fsdp]
)
def test_fsdp_plugin_in_script_equals_the_launchers(config, monkeypatch):
    """The plugin Accelerate builds in a launched rank from the launcher's FSDP_* variables equals,
    field by field, the one Trainer builds from TrainingArguments(fsdp=True, fsdp_config=<the row's
    settings>): fails if accelerate or transformers rename a key or change a default."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    row = next(s for s in SHIPPED if config in (s.accelerate_config, s.cpu_config))
    _forget_fsdp_env(monkeypatch, resources.resolve(config))
    args = TrainingArguments(output_dir="unused", report_to="none", **strategies.trainer_arguments(row, resources.ROOT))
    in_script = _plugin_view(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
    for key, value in _launcher_fsdp_env(resources.resolve(config)).items():
        monkeypatch.setenv(key, value)
    launched = _plugin_view(FullyShardedDataParallelPlugin())
    assert in_script == launched, {k: (launched[k], in_script[k]) for k in PLUGIN_FIELDS if launched[k] != in_script[k]}
    assert (launched["cpu_offload"][0] == "CPUOffloadPolicy") == (row.offload == "optimizer+params")


def test_fsdp_plugin_comparison_sees_a_renamed_key(monkeypatch):
    """Control: the accelerate-config name `offload_params` is silently ignored by TrainingArguments
    (it reads `cpu_offload`), and the comparison above catches the lost offload."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    row = strategies.by_key("fsdp_offload")
    _forget_fsdp_env(monkeypatch, resources.resolve(row.accelerate_config))
    wrong = {**row.fsdp.trainer_config(), "offload_params": True}
    del wrong["cpu_offload"]
    args = TrainingArguments(output_dir="unused", report_to="none", fsdp=True, fsdp_config=wrong)
    in_script = _plugin_view(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
    for key, value in _launcher_fsdp_env(resources.resolve(row.accelerate_config)).items():
        monkeypatch.setenv(key, value)
    assert in_script["cpu_offload"] != _plugin_view(FullyShardedDataParallelPlugin())["cpu_offload"]
