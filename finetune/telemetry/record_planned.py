"""The run record's sections the planner fills (finetune/planning/, finetune/training/planned.py): `predicted_memory`,
its prediction for the strategy that engaged and the prediction's error, and `plan`, `auto` resolved for the run.
Declared as typed structures as finetune/telemetry/record_schema.py declares the others, whose SECTIONS name them.
"""

from __future__ import annotations

from typing import Any, TypedDict

# --- `predicted_memory`: the planner's prediction for the strategy that engaged and its error
# against the measured peaks (finetune/planning/prediction.py)


class PredictedDevice(TypedDict):
    components_gib: dict[str, float]  # at the predicted peak: they add up to allocated_gib
    allocated_gib: float
    allocator_allowance_gib: float
    late_unfit_gib: float
    reserved_gib: float
    cuda_context_gib: float
    total_gib: float  # reserved + CUDA context: what the device must hold


class PredictedHost(TypedDict):
    components_gib: dict[str, float]
    total_gib: float


class PredictedPrecision(TypedDict):
    policy: str
    note: str
    param_bytes: int
    frozen_bytes: int
    grad_bytes: int
    state_bytes: int
    master_bytes: int
    autocast: bool
    compute_bytes: int | None


class PlannerConstant(TypedDict):
    value: float
    kind: str  # derived | fitted | assumed | measured
    source: str


class Assumptions(TypedDict):
    micro_batch: int
    seq_len: int
    seq_len_source: str
    grad_accum: int
    gradient_checkpointing: bool
    layout: str
    attention_kernel: str
    loss_impl: str
    logits_bytes: int
    optimizer: str
    nf4_bits_per_param: float
    constants: dict[str, PlannerConstant]
    not_modelled: list[str]
    device_scope: str
    host_scope: str


class PredictionError(TypedDict):
    predicted_gib: float
    measured_gib: float
    relative_error: float


class PredictionErrors(TypedDict):
    device_allocated: PredictionError | None
    device_reserved: PredictionError | None
    host: PredictionError | None
    host_lifetime_peak_rank0: PredictionError | None


class PredictedMemory(TypedDict):
    strategy: str
    method: str
    world_size: int
    precision: PredictedPrecision
    phase: str  # the moment of the step that holds the predicted peak
    phases_gib: dict[str, float]
    device: PredictedDevice | None
    host: PredictedHost
    assumptions: Assumptions
    error: PredictionErrors | None


# --- `plan`: the planner's answer for this run, `auto` resolved (finetune/training/planned.py)


class PlannedLever(TypedDict):
    given: Any  # the configuration's value: a number, true/false, or "auto"
    planned: Any  # what the run trains with


class PlanTried(TypedDict):
    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    predicted_gib: float
    fraction: float
    fits: bool


class Plan(TypedDict):
    levers: dict[str, PlannedLever]  # per_device_train_batch_size, gradient_accumulation_steps, gradient_checkpointing
    auto: list[str]
    sequences_per_device_step: int  # kept: micro-batch x accumulation
    memory_basis: str
    limit_gib: float
    predicted_gib: float
    fraction: float
    tried: list[PlanTried]
    step_s_predicted: float | None
    step_s_basis: str  # what the prediction rests on, or why there is none
    step_s_measured: float | None
    step_s_relative_error: float | None
