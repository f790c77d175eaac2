"""Which distributed strategy actually engaged, read from the live Accelerate state.

Accelerate downgrades some launches without a word (a 2-process launch without `use_cpu` on
a machine without a GPU runs two independent single-process jobs; an FSDP launch with
`use_cpu` runs plain DDP), so the run compares what engaged with what the recipe names and
refuses to train on a mismatch.
"""

from __future__ import annotations

import os

from finetune.errors import UserError

# recipe strategy -> the accelerate config that launches it
LAUNCH_CONFIGS = {
    "single": "accelerate_configs/single_gpu.yaml",
    "ddp": "accelerate_configs/ddp.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "fsdp": "accelerate_configs/fsdp.yaml",
}


def check_world_size(state) -> None:
    """The launcher's world size must equal the processes Accelerate set up."""
    launcher = int(os.environ.get("WORLD_SIZE", "1"))
    if launcher != state.num_processes:
        raise UserError(
            f"the launcher started {launcher} processes but Accelerate set up {state.num_processes} "
            f"(distributed type {state.distributed_type.value}); each process would train alone. On a "
            f"machine without a GPU add --cpu (or use_cpu: true in the accelerate config) so the "
            f"processes join over gloo.")


def engaged(state, *, method: str, mixed_precision: str | None = None) -> dict:
    """The `strategy` section of run.json, from Accelerate's state (before the engine exists).
    DeepSpeed's stage and offload come from its plugin config here; issue-level checks against
    the live engine happen once Trainer has wrapped the model."""
    dtype = state.distributed_type.value
    out = {"name": None, "distributed_type": dtype, "zero_stage": None, "offload_optimizer": None,
           "offload_params": None, "fsdp_version": None, "world_size": state.num_processes,
           "mixed_precision": mixed_precision or str(state.mixed_precision), "method": method}
    if dtype == "DEEPSPEED":
        ds = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        stage = int(ds.get("stage", 0))
        out.update(name=f"zero{stage}", zero_stage=stage,
                   offload_optimizer=ds.get("offload_optimizer", {}).get("device", "none"),
                   offload_params=ds.get("offload_param", {}).get("device", "none"))
    elif dtype == "FSDP":
        out.update(name="fsdp", fsdp_version=getattr(state.fsdp_plugin, "fsdp_version", 1))
    elif dtype in ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU"):
        out["name"] = "ddp"
    elif dtype == "NO":
        out["name"] = "single"
    else:
        out["name"] = dtype.lower()
    return out


def check_expected(expected: str, engaged_strategy: dict, recipe: str) -> None:
    """Refuse to run a strategy other than the one the recipe names."""
    if expected == "any" or expected == engaged_strategy["name"]:
        return
    config = LAUNCH_CONFIGS.get(expected, f"accelerate_configs/{expected}.yaml")
    raise UserError(
        f"recipe {recipe!r} is meant for strategy {expected!r} but this launch engaged "
        f"{engaged_strategy['name']!r} (Accelerate distributed type {engaged_strategy['distributed_type']}, "
        f"world size {engaged_strategy['world_size']}). Launch it with:\n"
        f"    accelerate launch --config_file {config} finetune/train.py --recipe {recipe}\n"
        f"or set run.strategy: any to accept whatever the launch gives.")
