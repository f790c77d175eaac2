"""The sections of the run record (run.json) as typed structures: the one declaration of its shape.

Each top-level key of run.json is a row of SECTIONS; a section whose value is an object names
its fields with a TypedDict (nested objects and list entries too). finetune/telemetry/record.py
refuses to write a field that is not declared here, and tests check these declarations, the
contract in docs/run_record.md (units and meanings) and a real run's run.json against each
other. Adding a section (precision, speed, resumes, ...): a TypedDict and a SECTIONS row here,
and its rows in docs/run_record.md.

Conventions: GiB = 2^30 bytes; seconds of wall time; token counts are summed over ranks unless
a field says per rank; null where a value does not apply (device memory on a CPU run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypedDict

SCHEMA = 1  # run.json's "schema"; a reader refuses any other (finetune/telemetry/record.py check)


class Versions(TypedDict):
    python: str
    torch: str | None
    transformers: str | None
    accelerate: str | None
    deepspeed: str | None
    peft: str | None
    bitsandbytes: str | None
    datasets: str | None
    finetune: str | None


class Interconnect(TypedDict, total=False):
    peer_access: dict[str, bool]  # "i-j" -> CUDA peer access between devices i < j
    nvlink_active_links: dict[str, int] | None  # device index -> active NVLink links (NVML), None without NVML
    nvml_error: str  # why NVML gave no answer


class Hardware(TypedDict, total=False):
    device_type: str  # cuda | cpu
    device_name: str
    devices: int
    device_memory_gib: float | None
    host_memory_gib: float
    interconnect: Interconnect | None
    cpu_count: int  # CPU runs


class Evidence(TypedDict, total=False):
    engine_class: str
    zero_stage: int | None
    zero_optimizer_class: str | None
    basic_optimizer_class: str | None
    offload_optimizer_device: str | None
    offload_param_device: str | None
    gradient_clipping: float | None
    fsdp_modules: int
    dtensor_params: int
    params: int
    local_param_fraction: float | None
    fsdp_offload_policy: str | None
    world_size: int
    optimizer_offloaded: bool  # DeepSpeed
    params_offloaded: bool  # DeepSpeed
    placements: str  # FSDP2: the DTensor placements of the first parameter


class Strategy(TypedDict, total=False):
    name: str | None  # single | ddp | zero1 | zero2 | zero3 | fsdp (finetune/strategies.py)
    distributed_type: str  # Accelerate's DistributedType value
    zero_stage: int | None
    offload_optimizer: str | None
    offload_params: str | None
    offload: str  # none | optimizer | params | optimizer+params
    fsdp_version: int | None
    world_size: int
    mixed_precision: str
    method: str  # full | lora | qlora
    cpu_distributed: bool
    evidence: Evidence | None


class Batch(TypedDict):
    per_device: int
    grad_accum: int
    data_parallel_size: int
    effective: int
    input_tokens_per_step: float | None
    trained_tokens_per_step: float | None


class LearningRate(TypedDict):
    base: float
    rule: str  # none | linear | sqrt
    reference_batch: int
    factor: float
    applied: float


class MemoryPeaks(TypedDict):
    device_peak_allocated_gib: float | None
    device_peak_reserved_gib: float | None
    device_peak_active_gib: float | None
    host_peak_rss_gib: float | None
    alloc_retries: int | None
    ooms: int | None


class RankMemory(MemoryPeaks):
    rank: int


class LoadingMemory(TypedDict):
    per_rank: list[RankMemory]
    max: MemoryPeaks


class Memory(TypedDict):
    per_rank: list[RankMemory]
    max: MemoryPeaks
    loading: LoadingMemory


class PredictedSide(TypedDict):
    components_gib: dict[str, float]
    total_gib: float


class Assumptions(TypedDict):
    weight_bytes: int
    optimizer: str
    activation_formula: str
    logits: str
    nf4_bits_per_param: float
    allowance: str
    micro_batch: int
    seq_len: int
    gradient_checkpointing: bool
    seq_len_source: str
    host_scope: str
    device_scope: str


class PredictionError(TypedDict):
    predicted_gib: float
    measured_gib: float
    relative_error: float


class PredictionErrors(TypedDict):
    device: PredictionError | None
    host: PredictionError | None
    host_lifetime_peak_rank0: PredictionError | None


class PredictedMemory(TypedDict):
    strategy: str
    method: str
    world_size: int
    device: PredictedSide | None
    host: PredictedSide
    assumptions: Assumptions
    error: PredictionErrors | None


class Throughput(TypedDict, total=False):
    trained_tokens_per_s: float | None
    trained_tokens_per_s_per_device: float | None
    input_tokens_per_s: float | None
    samples_per_s: float | None
    median_step_s: float | None
    mfu: float | None
    warmup_steps_excluded: int
    steps_measured: int
    flops_convention: str | None
    flops_per_token: float
    peak_device: str | None
    mfu_note: str | None


class DataSummary(TypedDict):
    format: str
    rows_read: int
    rows_skipped: list[list]  # [row number, reason], the first 50
    train_examples: int
    eval_examples: int
    truncated: int
    packed: bool
    train_input_tokens: int
    train_trained_tokens: int
    dropped_no_labels: int


class Step(TypedDict, total=False):
    step: int
    loss: float | None
    lr: float | None
    grad_norm: float | None
    trained_tokens: int
    input_tokens: int
    step_s: float
    host_peak_rss_gib: float | None
    device_peak_allocated_gib: float | None


class NonFiniteSkip(TypedDict):
    step: int
    what: str  # loss | gradient norm
    ranks: list[int]


ResumeEntry = TypedDict("ResumeEntry", {"from": str, "step": int, "at": str, "previous_status": str | None,
                                        "steps_discarded": int})


class Position(TypedDict):
    epoch: int  # epochs completed before the checkpoint
    samples_into_epoch: int  # samples of that epoch trained before it
    samples_per_epoch: int  # train rows


# One segment of a run: the first start (step 0) or a resume. The first seven keys are always
# there; the resume-only keys from `previous_status` on (finetune/training/resume.py).
Segment = TypedDict("Segment", {
    "step": int, "from": str | None, "at": str | None, "world_size": int | None, "strategy": str | None,
    "offload": str | None, "per_device": int | None, "grad_accum": int | None, "effective": int | None,
    "previous_status": str | None, "steps_discarded": int, "superseded": list[str], "from_world_size": int,
    "reshard": str, "rng": str, "rng_ranks": list[int], "position": Position | None, "universal_cache": str,
    "conversion_s": float | None}, total=False)


class Summary(TypedDict, total=False):
    train_loss: float | None
    eval_loss: float | None
    total_trained_tokens: int | None
    total_input_tokens: int
    wall_s: float | None
    train_s: float
    steps: int
    status: str  # running | completed | interrupted | failed
    error: str | None
    nonfinite_skipped: list[NonFiniteSkip]
    checkpoint: str  # preempted runs: the complete checkpoint to resume from
    resumed_from: str
    resumed_at_step: int
    resumes: int
    resume_history: list[ResumeEntry]


class EvalExample(TypedDict):
    prompt: str
    expected: str
    generated: str
    correct: bool


class ExactMatch(TypedDict):
    exact_match: float
    correct: int
    total: int
    per_task: dict[str, float]
    examples: list[EvalExample]


class Eval(TypedDict, total=False):
    metric: str
    heldout_path: str
    exact_match_before: float
    exact_match_after: float
    details: dict[str, ExactMatch]  # "before" / "after"


class Faults(TypedDict):
    collective_timeout_s: float
    on_nonfinite: str
    max_nonfinite_skips: int
    save_total_limit: int | None


class Parameters(TypedDict):
    trainable: int
    total: int


ABSENT = object()  # a section's initial value when the key appears only once it is first set


@dataclass(frozen=True)
class Section:
    name: str
    shape: Any  # the value's type: a TypedDict, list[...], dict[...] (free-form mapping) or a plain type
    initial: Callable[[], Any] | object  # the value of a new record (a factory), or ABSENT
    required: bool  # schema-1 readers (finetune compare) refuse a record without it
    kind: str = "value"  # what `check` enforces on a required section: object | object|null | list | value


SECTIONS: tuple[Section, ...] = (
    Section("schema", int, lambda: SCHEMA, True),
    Section("run_name", str, ABSENT, True),  # the run's identity, given when the record is made
    Section("recipe", str, ABSENT, True),
    Section("created", str, ABSENT, False),
    Section("config", dict[str, Any], ABSENT, True, "object"),
    Section("versions", Versions, ABSENT, False),
    Section("hardware", Hardware, ABSENT, True, "object|null"),
    Section("strategy", Strategy | None, lambda: None, True, "object|null"),
    Section("batch", Batch | None, lambda: None, True, "object|null"),
    Section("lr", LearningRate | None, lambda: None, True, "object|null"),
    Section("memory", Memory | None, lambda: None, True, "object|null"),
    Section("predicted_memory", PredictedMemory | None, lambda: None, False),
    Section("throughput", Throughput | None, lambda: None, True, "object|null"),
    Section("data", DataSummary | None, lambda: None, False),
    Section("steps", list[Step], list, True, "list"),
    Section("summary", Summary, lambda: {"train_loss": None, "eval_loss": None, "total_trained_tokens": None,
                                         "wall_s": None, "steps": 0, "status": "running", "error": None},
            True, "object"),
    Section("eval", Eval, dict, False),
    Section("faults", Faults, ABSENT, False),
    Section("resumes", list[Segment], ABSENT, False),
    Section("parameters", Parameters, ABSENT, False),
)
BY_NAME = {s.name: s for s in SECTIONS}
