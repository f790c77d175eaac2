"""The shipped accelerate configs, DeepSpeed JSONs and strategy recipes: each loads with the tool that
reads it and names the others consistently (tests/test_strategies_table.py checks them against
the strategy table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

CONFIGS = sorted((REPO / "accelerate_configs").rglob("*.yaml"))

DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))

STRATEGY_RECIPES = ["ddp", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp", "fsdp_offload",
                    "qlora_baseline"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_accelerate_config_loads_and_opens_with_its_launch_line(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    text = path.read_text()
    assert text.startswith("#") and "accelerate launch --config_file" in text.split("compute_environment")[0]
    assert cfg.num_processes == (4 if cfg.num_machines == 2 else 1 if path.name == "single_gpu.yaml" else 2)
    if cfg.num_processes == 1 and not cfg.use_cpu:  # one process sees one GPU: never nn.DataParallel (issue 15 item 5)
        assert str(cfg.gpu_ids) == "0", cfg.gpu_ids
    ds_file = (cfg.deepspeed_config or {}).get("deepspeed_config_file")
    if ds_file:
        assert (REPO / ds_file).is_file(), ds_file
        assert ("offload" in path.name) == ("offload" in ds_file)
    if cfg.fsdp_config:
        assert cfg.fsdp_config["fsdp_version"] == 2
        assert cfg.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert cfg.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert cfg.fsdp_config["fsdp_offload_params"] == ("offload" in path.name)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_deepspeed_config_offloads_only_when_named_so(path):
    cfg = json.loads(path.read_text())
    zero = cfg["zero_optimization"]
    offloads = [k for k in ("offload_optimizer", "offload_param") if k in zero]
    assert bool(offloads) == ("offload" in path.name), (path.name, offloads)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert cfg[key] == "auto", key  # Trainer fills them; a literal would silently disagree with it
    assert cfg["bf16"]["enabled"] == "auto" and cfg["fp16"]["enabled"] == "auto"
    # Trainer builds torch's AdamW and the schedule from TrainingArguments. An optimizer section with
    # lr "auto" would differ between the routes: in-script, TrainingArguments(deepspeed=...) fills it
    # before finetune/training/run.py applies the LR scaling (finetune/launch/setup.py).
    assert "optimizer" not in cfg and "scheduler" not in cfg, path.name
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("name", STRATEGY_RECIPES)
def test_strategy_recipe_names_its_configs_and_launch_line(name):
    from finetune.config.recipe import load_recipe

    cfg, _ = load_recipe(name, [])
    text = (REPO / "recipes" / f"{name}.yaml").read_text()
    header = text.split("\nmodel:")[0]
    assert cfg.run.accelerate_config and (REPO / cfg.run.accelerate_config).is_file()
    assert f"--config_file {cfg.run.accelerate_config} finetune/train.py --recipe {name}" in header
    assert cfg.method.lora_dropout == 0.0 and cfg.model.name_or_path == "bundled:SmolLM2-135M-Instruct"
    acc = yaml.safe_load((REPO / cfg.run.accelerate_config).read_text())
    want = {"single": "NO", "ddp": "MULTI_GPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "FSDP"}
    assert acc["distributed_type"] == want[cfg.run.strategy]
    assert ("offload" in cfg.run.accelerate_config) == (cfg.run.offload not in ("none", "any"))
    if cfg.run.strategy != "single":
        assert f"accelerate_configs/cpu/{Path(cfg.run.accelerate_config).name}" in header
