"""run.json `predicted_memory`: the planner's prediction for the strategy that engaged, and its error
against the measured peaks (finetune/planning/prediction.py writes it; docs/run_record.md gives the
units). Declared apart from finetune/telemetry/record_schema.py, which lists it as a section."""

from __future__ import annotations

from typing import TypedDict


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
