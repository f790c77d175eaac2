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

STRATEGY_RECIPES = ["ddp", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp", "fsdp_offload", "qlora_baseline"]


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
    # Trainer builds torch's AdamW and the schedule from TrainingArguments (finetune/training/arguments.py,
    # the scaled learning rate included); an optimizer or scheduler section would replace them.
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


ZERO3_JSONS = ["zero3.json", "zero3_offload.json"]
# Llama-3.2-1B (hidden 2048, MLP 8192): the model of the ZeRO-3 measurement behind these values.
LLAMA_1B_HIDDEN, LLAMA_1B_LARGEST_MATRIX = 2048, 2048 * 8192


def _filled_by_trainer(ds_config: dict, tmp_path) -> dict:
    """The zero_optimization section as Trainer fills it (transformers HfTrainerDeepSpeedConfig:
    trainer_config_process from TrainingArguments, trainer_config_finalize from the model's config)."""
    import copy
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=16, report_to="none")
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=LLAMA_1B_HIDDEN))
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(ds_config))  # registers itself globally: unset below
    try:
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, num_training_steps=10)
        return hf.config["zero_optimization"]
    finally:
        unset_hf_deepspeed_config()


@pytest.mark.parametrize("name", ZERO3_JSONS)
def test_zero3_buckets_hold_a_whole_weight_matrix_once_trainer_fills_them(name, tmp_path):
    """Trainer's "auto" bucket sizes (h^2, 0.9 h^2) are smaller than one weight matrix, so ZeRO-3 fetched
    and reduced one parameter at a time (docs/speed.md "DeepSpeed ZeRO-3 settings"); the shipped numbers
    survive Trainer's filling unchanged and hold the largest matrix of a 1B model. Control: the old
    "auto" values, filled the same way, do not."""
    shipped = json.loads((REPO / "ds_configs" / name).read_text())
    z = _filled_by_trainer(shipped, tmp_path)
    assert (
        z["reduce_bucket_size"],
        z["stage3_prefetch_bucket_size"],
        z["stage3_param_persistence_threshold"],
        z["sub_group_size"],
    ) == (2e8, 5e7, 1e5, 1e8)
    assert min(z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"]) >= LLAMA_1B_LARGEST_MATRIX
    old = json.loads(json.dumps(shipped))
    old["zero_optimization"].update(
        reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto"
    )
    z_old = _filled_by_trainer(old, tmp_path)
    assert z_old["reduce_bucket_size"] == LLAMA_1B_HIDDEN**2 < LLAMA_1B_LARGEST_MATRIX


def test_every_zero3_setting_has_its_reason_in_docs_speed():
    """JSON has no comments: docs/speed.md holds one row per key of the shipped ZeRO-3 files."""
    doc = (REPO / "docs" / "speed.md").read_text()
    section = doc.split("## DeepSpeed ZeRO-3 settings", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `")}
    for name in ZERO3_JSONS:
        cfg = json.loads((REPO / "ds_configs" / name).read_text())
        keys = {f"zero_optimization.{k}" for k in cfg["zero_optimization"]} | {"bf16.enabled", "fp16.enabled"}
        assert keys <= rows, sorted(keys - rows)
