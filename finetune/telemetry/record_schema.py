"""The sections of the run record (run.json) as typed structures: the one declaration of its shape. Each top-level key
of run.json is a row of SECTIONS; a section whose value is an object names its fields with a TypedDict (nested objects
and list entries too). finetune/telemetry/record.py refuses a field not declared here; tests hold these declarations,
docs/run_record.md (units, meanings, conventions) and a real run's run.json to each other. A new section: a TypedDict
and a SECTIONS row here, and its rows in docs/run_record.md.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from finetune.data.build import DataStats
from finetune.fingerprints import InputChange, Inputs
from finetune.telemetry.record_planned import Plan, PredictedMemory

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
    set_up_by: str | None  # = strategy.set_up_by, so the evidence says it too


class Setup(TypedDict):
    """Who set the strategy up and how (finetune/launch/strategy_setup.py)."""

    launcher: str  # accelerate launch | torchrun | python | finetune train | unknown
    config_file: str | None  # the accelerate config the launcher read
    config_from: str | None  # --config_file | default config | finetune train
    because: str  # the evidence for set_up_by, one clause
    row: str | None  # the strategy table row engaged in the script (set_up_by recipe)
    trainer_arguments: dict[str, Any] | None  # what the script passed to TrainingArguments for it
    world_of_one: bool  # the script exported RANK=0, WORLD_SIZE=1, ... itself (no launcher process group)
    cpu_gloo: str | None  # why the processes joined gloo as CPU processes; null: they did not


class Parallel(TypedDict, total=False):
    """The live mesh (finetune/training/strategy_evidence.py live_mesh; finetune/mesh.py)."""

    dp_replicate: int  # data-parallel ranks holding whole model states (DDP)
    dp_shard: int  # data-parallel ranks sharding them (ZeRO-1/2/3 states, FSDP2)
    tp: int
    sp: int
    cp: int
    world_size: int
    source: str  # which live groups the sizes were read from
    zero_partition_ranks: int  # DeepSpeed: ranks ZeRO partitions over (its sequence-and-data-parallel group)
    ulysses_attention: bool | None  # DeepSpeed: the attention function is Ulysses' wrapper; null without sp
    tp_layers: int  # AutoTP's split linear layers
    tp_local_weight_fraction: float | None  # their weights' elements this rank holds


class Strategy(TypedDict, total=False):
    name: str | None  # single | ddp | zero1 | zero2 | zero3 | fsdp (finetune/strategies.py)
    distributed_type: str  # Accelerate's DistributedType value
    zero_stage: int | None
    offload_optimizer: str | None
    offload_params: str | None
    offload: str  # none | optimizer | params | optimizer+params
    fsdp_version: int | None
    world_size: int
    method: str  # full | lora | qlora
    cpu_distributed: bool
    set_up_by: str | None  # launcher-config | recipe | launcher-processes
    setup: Setup | None
    evidence: Evidence | None
    parallel: Parallel | None


class MixedPrecisionPolicy(TypedDict):  # torch FSDP2's, as fully_shard got it
    param_dtype: str | None
    reduce_dtype: str | None
    output_dtype: str | None
    cast_forward_inputs: bool


class PrecisionEvidence(TypedDict, total=False):
    engine: str
    optimizer: str  # the class whose states the optimizer_state_dtype is for (DeepSpeed: the basic optimizer)
    accelerate_mixed_precision: str  # Accelerate's raw value: "no" for DeepSpeed bf16 runs too
    loss_scaler: str | None
    autocast: bool  # torch families: Accelerate's autocast wrapper is installed
    autocast_dtype: str | None
    fsdp_modules: int
    param_is_dtensor: bool
    mp_policy: MixedPrecisionPolicy | None
    zero_optimizer: str  # DeepSpeed
    module_param_dtype: str | None
    grad_accum_dtype: str | None
    bf16_enabled: bool
    fp16_enabled: bool
    deepspeed_torch_autocast: bool
    bf16_update_loss_share: float  # bf16-true: share of trainable elements whose half-spacing > lr
    bf16_lr_keeping_updates: float  # bf16-true: the smallest lr at which under 10% lose their updates


class Precision(TypedDict):
    policy: str  # bf16-mixed | bf16-true | 16-mixed | 32-true (finetune/precision.py)
    requested: str  # training.precision as given (auto, ...)
    family: str  # torch | fsdp2 | deepspeed
    load_dtype: str
    param_dtype: str | None  # live, from on_train_begin on
    compute_dtype: str | None
    optimizer_state_dtype: str | None
    master_weights: bool | None
    reduce_dtype: str | None
    observed_compute_dtype: str | None
    warning: str | None
    evidence: PrecisionEvidence | None


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
    host_peak_method: str  # vmhwm | sampled (finetune/telemetry/meter.py)


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
    flops_per_token: float | None
    peak_device: str | None
    mfu_note: str | None
    scope: str  # what the figures cover (finetune/telemetry/meter.py SCOPE)


# The data phase's DataStats, field for field (finetune/data/build.py)
DataSummary = TypedDict("DataSummary", typing.get_type_hints(DataStats))


class Step(TypedDict, total=False):
    step: int
    loss: float | None
    lr: float | None
    grad_norm: float | None
    trained_tokens: int
    input_tokens: int
    examples: int
    window_steps: int
    world_size: int
    step_s: float
    data_loading_s: float
    data_loading_share: float | None
    mfu: float | None
    host_peak_rss_gib: float | None
    device_peak_allocated_gib: float | None


class NonFiniteSkip(TypedDict):
    step: int
    what: str  # loss | gradient norm
    ranks: list[int]


ResumeEntry = TypedDict(
    "ResumeEntry", {"from": str, "step": int, "at": str, "previous_status": str | None, "steps_discarded": int}
)


class Position(TypedDict):
    epoch: int  # epochs completed before the checkpoint
    samples_into_epoch: int  # samples of that epoch trained before it
    samples_per_epoch: int  # train rows


class ConfigChange(TypedDict):
    key: str  # section.key
    was: object  # in the run's saved configuration (null: not set there, the default)
    now: object  # given with --allow-config-change


class Mesh(TypedDict):
    sp: int
    tp: int
    cp: int


# One segment of a run: the first start (step 0) or a resume. The keys up to `mesh` are always
# there; the resume-only keys from `previous_status` on (finetune/checkpointing/resume.py).
Segment = TypedDict(
    "Segment",
    {
        "step": int,
        "from": str | None,
        "at": str | None,
        "world_size": int | None,
        "strategy": str | None,
        "offload": str | None,
        "per_device": int | None,
        "grad_accum": int | None,
        "effective": int | None,
        "mesh": Mesh | None,
        "previous_status": str | None,
        "steps_discarded": int,
        "superseded": list[str],
        "from_world_size": int,
        "reshard": str,
        "rng": str,
        "rng_ranks": list[int],
        "position": Position | None,
        "universal_cache": str,
        "conversion_s": float | None,
        "config_from": str,
        "config_changes": list[ConfigChange],
        "auto_resolved": dict,
        "input_changes": list[InputChange],
        "ended": str,
        "wall_s": float | None,
        "steps_trained": int,
    },
    total=False,
)


class Summary(TypedDict, total=False):
    train_loss: float | None
    eval_loss: float | None
    total_trained_tokens: int | None
    total_input_tokens: int
    steps_counted: int
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
    run_wall_s: float | None  # every segment's wall time (resumes[].wall_s), summed


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
    on_collapse: str
    collapse_windows: int
    save_total_limit: int | None


class Parameters(TypedDict):
    trainable: int
    total: int


class SpeedLayout(TypedDict):
    name: str  # padded | padding_free | packing
    packing_algorithm: str | None  # best_fit_decreasing when packing
    pad_to_multiple_of: int | None  # tokens; data.pad_to_multiple_of


class SpeedLoss(TypedDict):
    requested: str  # training.loss_impl: auto | standard | chunked | liger
    resolved: str  # standard | chunked | liger
    reason: str | None  # why auto fell back to standard
    chunk_tokens: int | None  # tokens per chunk (chunked)
    compact: bool  # only labelled positions go through the head
    logits_materialised: bool  # the full (tokens x vocab) logits are built


class SpeedAttention(TypedDict):
    implementation: str  # the model's live attention implementation
    sdpa_backends_policy: str | list[str]  # model.sdpa_backends
    sdpa_backends_enabled: list[str] | None  # torch's flags after the policy; null when not sdpa
    sdpa_priority: list[str] | None  # the order torch tries them in
    requested: str  # model.attn_implementation
    fallback: str | None  # why the implementation is not the requested one (a family without SDPA)


class SpeedCompile(TypedDict):
    enabled: bool
    mode: str | None
    backend: str | None


class SpeedLiger(TypedDict):
    layer_kernels: bool  # training.use_liger_kernel: Trainer's Liger patch (RMSNorm, RoPE, SwiGLU)
    fused_linear_cross_entropy: bool  # Liger's fused loss (loss_impl liger)
    version: str | None  # liger-kernel, null when not installed


class SpeedDdp(TypedDict):
    find_unused_parameters: bool | None  # what Accelerate gives DDP (its kwargs handler); null when not DDP
    decided_by: str | None  # probe | model config | recipe; null when not DDP
    unused_trainable: list[str] | None  # the probe's trainable parameters without a gradient (first 20)
    reason: str | None


class Speed(TypedDict):
    layout: SpeedLayout
    loss_impl: SpeedLoss
    attention: SpeedAttention
    compile: SpeedCompile
    liger: SpeedLiger
    ddp: SpeedDdp


ABSENT = object()  # a section's initial value when the key appears only once it is first set


# --- `nodes`: the machines a run spans, read from the live process group (finetune/launch/nodes.py)


class RankPlace(TypedDict):
    rank: int
    local_rank: int
    node: str  # SLURMD_NODENAME under SLURM, else the host name
    node_rank: int  # the launch's machine rank (torchrun GROUP_RANK), else SLURM_NODEID, else 0
    hostname: str
    pid: int
    params_local: int | None  # parameter elements this rank holds, read when training begins
    params_full: int | None  # parameter elements of the whole model
    host_peak_rss_gib: float | None  # this rank's host RSS high-water mark, read with the last memory window


class NodeFigures(TypedDict):
    node_rank: int
    node: str
    ranks: list[int]
    params_local: int | None  # summed over the node's ranks
    param_fraction: float | None  # params_local / the model's elements
    host_peak_rss_gib: float | None  # the ranks' high-water marks summed


class SlurmJob(TypedDict):
    job_id: str
    job_nodelist: str | None
    step_nodes: int | None
    restart_count: int


class Nodes(TypedDict):
    """The machines the run spans, from the live process group (finetune/launch/nodes.py)."""

    world_size: int
    num_machines: int
    node_rank_from: str  # GROUP_RANK | SLURM_NODEID | one machine
    slurm: SlurmJob | None
    ranks: list[RankPlace]
    per_node: list[NodeFigures]
    param_partition: str | None  # how the parameters are split, read from the live engine


# --- `export`: the check of the final save and the merged export (finetune/export/live.py, command.py)
class ExportProbe(TypedDict):
    rows: int
    tokens: int
    trained_tokens: int
    source: str


class ExportCheck(TypedDict, total=False):
    kind: str  # reload | stream | off
    why: str
    passed: bool | None
    problems: list[str]
    reference: str  # what the saved model is compared with
    compute_dtype: str  # the tolerance's dtype
    probe: ExportProbe
    reference_loss: float | None
    saved_loss: float | None
    max_logit_diff: float | None
    logit_tolerance: float | None
    loss_tolerance: float | None
    tensors: int
    max_tensor_rel_diff: float
    device: str | None
    seconds: float


class Export(TypedDict, total=False):
    check: ExportCheck
    merged: dict[str, Any]


@dataclass(frozen=True)
class Section:
    name: str
    shape: Any  # the value's type: a TypedDict, list[...], dict[...] (free-form mapping) or a plain type
    initial: Callable[[], Any] | object  # the value of a new record (a factory), or ABSENT
    required: bool  # schema-1 readers (finetune compare) refuse a record without it
    kind: str = "value"  # what `check` enforces on a required section: object | object|null | list | value


FRESH_SUMMARY = dict(
    train_loss=None, eval_loss=None, total_trained_tokens=None, wall_s=None, steps=0, status="running", error=None
)
SECTIONS: tuple[Section, ...] = (
    Section("schema", int, lambda: SCHEMA, True),
    Section("run_name", str, ABSENT, True),  # the run's identity, given when the record is made
    Section("recipe", str, ABSENT, True),
    Section("created", str, ABSENT, False),
    Section("config", dict[str, Any], ABSENT, True, "object"),
    Section("versions", Versions, ABSENT, False),
    Section("hardware", Hardware, ABSENT, True, "object|null"),
    Section("strategy", Strategy | None, lambda: None, True, "object|null"),
    Section("nodes", Nodes, ABSENT, False),
    Section("precision", Precision | None, lambda: None, False),
    Section("batch", Batch | None, lambda: None, True, "object|null"),
    Section("lr", LearningRate | None, lambda: None, True, "object|null"),
    Section("memory", Memory | None, lambda: None, True, "object|null"),
    Section("predicted_memory", PredictedMemory | None, lambda: None, False),
    Section("plan", Plan | None, ABSENT, False),
    Section("throughput", Throughput | None, lambda: None, True, "object|null"),
    Section("data", DataSummary | None, lambda: None, False),
    Section("steps", list[Step], list, True, "list"),
    Section("summary", Summary, lambda: dict(FRESH_SUMMARY), True, "object"),
    Section("eval", Eval, dict, False),
    Section("faults", Faults, ABSENT, False),
    Section("resumes", list[Segment], ABSENT, False),
    Section("parameters", Parameters, ABSENT, False),
    Section("speed", Speed, ABSENT, False),
    Section("inputs", Inputs, ABSENT, False),
    Section("export", Export, ABSENT, False),
)
