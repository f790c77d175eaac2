"""DeepSpeed's buffer sizes as a run configures them: the shipped ds_configs/*.json with the values
HF Trainer fills in for "auto" (transformers/integrations/deepspeed.py
HfTrainerDeepSpeedConfig.trainer_config_finalize), and ZeRO-3's rule for which gathered
parameters stay on the device between forward and backward."""

from __future__ import annotations

import json
from dataclasses import dataclass

from finetune.planning.shapes import Shape
from finetune.strategies import by_key

# DeepSpeed's own defaults where a config leaves a key out (deepspeed/runtime/zero/config.py
# DeepSpeedZeroConfig: reduce_bucket_size 5e8, sub_group_size 1e9, stage3_max_live_parameters
# 1e9, stage3_max_reuse_distance 1e9, stage3_param_persistence_threshold 1e5,
# stage3_prefetch_bucket_size 5e7).
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 5e8,
    "sub_group_size": 1e9,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_prefetch_bucket_size": 5e7,
    "overlap_comm": False,
}


@dataclass
class ZeroValues:
    """Numbers of elements (not bytes) as the engine is configured."""

    reduce_bucket_size: float
    sub_group_size: float
    max_live_parameters: float
    max_reuse_distance: float
    persistence_threshold: float
    prefetch_bucket_size: float
    overlap_comm: bool
    source: str


def fill_auto(zero: dict, hidden: int) -> dict:
    """Trainer's "auto" values (integrations/deepspeed.py trainer_config_finalize): reduce_bucket_size
    = h^2, stage3_prefetch_bucket_size = int(0.9 h^2), stage3_param_persistence_threshold = 10 h."""
    auto = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    out = dict(DEEPSPEED_DEFAULTS)
    for key, value in zero.items():
        out[key] = auto.get(key, value) if value == "auto" else value
    return out


def zero_values(strategy: str, shape: Shape, ds_config: dict | None = None) -> ZeroValues | None:
    """The ZeRO values of a strategy: `ds_config` (a DeepSpeed JSON as a dict) when given, else the
    shipped ds_configs file of the strategy's row in finetune/strategies.py; None for strategies
    that are not DeepSpeed."""
    row = by_key(strategy)
    if row.zero_stage is None:
        return None
    source = "given DeepSpeed config"
    if ds_config is None:
        if row.deepspeed_config is None:  # planner-only rows (zero1, zero3_offload_opt): DeepSpeed's defaults
            ds_config, source = {}, "DeepSpeed defaults (no shipped config for this row)"
        else:
            from finetune.resources import resolve

            path = resolve(row.deepspeed_config)
            ds_config = json.loads(path.read_text(encoding="utf-8"))
            source = row.deepspeed_config
    z = fill_auto(ds_config.get("zero_optimization") or {}, shape.hidden)
    return ZeroValues(
        float(z["reduce_bucket_size"]),
        float(z["sub_group_size"]),
        float(z["stage3_max_live_parameters"]),
        float(z["stage3_max_reuse_distance"]),
        float(z["stage3_param_persistence_threshold"]),
        float(z["stage3_prefetch_bucket_size"]),
        bool(z["overlap_comm"]),
        source + " (auto filled as HF Trainer does)",
    )


def zero3_gathered(
    shape: Shape, z: ZeroValues, n: int, param_bytes: int, frozen_bytes: int, method: str, offload_params: bool = False
) -> float:
    """ZeRO-3, N > 1: bytes of gathered parameters still on the device when backward starts.
    After a module's forward, PartitionedParameterCoordinator.release_sub_module keeps its
    parameters when their next use (the same module in backward) comes within
    stage3_max_reuse_distance fetched elements, and at most stage3_max_live_parameters are live
    (deepspeed/runtime/zero/partitioned_param_coordinator.py). The last layers of the forward are
    the first of the backward: layer l is reused after 2 (L-1-l) layers + the outside parameters.
    At N = 1 nothing is gathered (NoGatherHandle: `param.data = ds_tensor.to(device)` aliases the
    partition), unless the partition lives on the host (offload_param), when it is a device copy.
    Derived from the code; not measured (needs 2 GPUs)."""
    if n == 1 and not offload_params:
        return 0.0
    per_layer = shape.params.per_layer
    kept = shape.outside_layers
    for layer in range(shape.layers):
        distance = 2 * (shape.layers - 1 - layer) * per_layer + shape.outside_layers
        if distance < z.max_reuse_distance:
            kept += per_layer
    kept = min(kept, z.max_live_parameters)
    return kept * (param_bytes if method == "full" else frozen_bytes)
