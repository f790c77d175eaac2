"""The planner's answer for this run (finetune/planning/search.py): `training.per_device_train_batch_size: auto` and
`training.gradient_checkpointing: auto` resolved for the device at hand, the sequences per device per optimizer step
kept by accumulation, and run.json `plan`: what was given and planned, the memory it was planned against, every
option tried, and the predicted optimizer-step time beside the measured one (docs/run_record.md `plan`).

The memory is read live on rank 0 and its decision is every rank's (run_on_main): on a GPU, the free device memory
(torch.cuda.mem_get_info) plus this process's CUDA context, which the plan counts; on a CPU run, where the planner's
device is the host, the available host memory (psutil) shared by the processes of this machine."""

from __future__ import annotations

import logging

from finetune.errors import UserError
from finetune.launch.peers import run_on_main
from finetune.planning import model_source, search
from finetune.planning.memory import CUDA_CONTEXT_GIB
from finetune.planning.prediction import AUTO, workload_from_config
from finetune.planning.shapes import shape_of
from finetune.strategies import planner_key
from finetune.units import GIB

log = logging.getLogger(__name__)
LEVERS = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing")


def resolve(cfg, launch, state):
    """(the configuration with every `auto` replaced by the planner's choice, run.json `plan` or None). A recipe
    without `auto` keeps its numbers and still gets its plan section (None, said in the log, where the model's
    architecture has no arithmetic); with `auto`, no plan is a UserError on every rank."""
    given = {k: getattr(cfg.training.typed, k) for k in LEVERS}
    auto = [k for k, v in given.items() if v == AUTO]
    section = run_on_main(state, lambda: plan_section(cfg, launch, given, auto))
    if not auto:
        return cfg, section
    args = {**cfg.training.args, **{k: section["levers"][k]["planned"] for k in LEVERS}}
    return cfg.replaced("training", args=args), section


def plan_section(cfg, launch, given: dict, auto: list[str]) -> dict | None:
    try:
        shape = shape_of(model_source.read_config(cfg.model.name_or_path, cfg.model.revision))
        shape.check_block_mechanism()  # the activation arithmetic covers this architecture
    except (UserError, ValueError) as e:
        if auto:
            raise UserError(f"training.{' and training.'.join(auto)}: auto needs the planner: {e}") from None
        log.warning("no plan in run.json: %s", e)
        return None
    w = workload_from_config(cfg, precision=launch.policy.name)
    strategy = planner_key(launch.strategy, launch.offload)
    sequences, _ = search.sequences_per_step(cfg)
    limit, basis, sm = memory_limit(launch)
    result = search.resolve_levers(
        shape,
        w,
        strategy,
        launch.world_size,
        limit_bytes=limit,
        sm=sm,
        sequences=sequences,
        micro_batch="per_device_train_batch_size" in auto,
        checkpointing="gradient_checkpointing" in auto,
    )
    chosen = result["chosen"] or (None if auto else result["tried"][0])
    if chosen is None:
        least = min(result["tried"], key=lambda t: t["predicted_gib"])
        raise UserError(
            f"training.{' and training.'.join(auto)}: auto: nothing fits {search.MARGIN:.0%} of {limit / GIB:.1f} GiB "
            f"({basis}) under {strategy}: the least is micro-batch {least['micro_batch']}"
            f"{' with checkpointing' if least['gradient_checkpointing'] else ''} at {least['predicted_gib']:.1f} GiB; "
            f"use a shorter data.max_length, offload, more processes, or `finetune plan` for the options"
        )
    planned = {
        "per_device_train_batch_size": chosen["micro_batch"],
        "gradient_accumulation_steps": chosen["grad_accum"],
        "gradient_checkpointing": chosen["gradient_checkpointing"],
    }
    return {
        "levers": {k: {"given": given[k], "planned": planned[k]} for k in LEVERS},
        "auto": auto,
        "sequences_per_device_step": sequences,
        "memory_basis": basis,
        "limit_gib": round(limit / GIB, 4),
        "predicted_gib": chosen["predicted_gib"],
        "fraction": chosen["fraction"],
        "tried": [{k: v for k, v in t.items() if k not in ("strategy", "step_time")} for t in result["tried"]],
        **predicted_step(shape, w, planned, launch),
    }


def memory_limit(launch) -> tuple[float, str, int | None]:
    """(bytes one process may plan for, what they are, the GPU's compute capability major or None on CPU)."""
    if launch.cuda:
        import torch

        free, total = torch.cuda.mem_get_info()
        sm = torch.cuda.get_device_capability()[0]
        basis = (
            f"GPU {torch.cuda.current_device()}: {free / GIB:.2f} of {total / GIB:.2f} GiB free "
            f"(torch.cuda.mem_get_info) + this process's CUDA context ({CUDA_CONTEXT_GIB} GiB, in the plan)"
        )
        return free + CUDA_CONTEXT_GIB * GIB, basis, sm
    import psutil

    available, per = psutil.virtual_memory().available, max(1, launch.machines.processes_per_machine)
    basis = f"CPU run: {available / GIB:.2f} GiB of host memory available (psutil) / {per} process(es) on this machine"
    return available / per, basis, None


def predicted_step(shape, w, planned: dict, launch) -> dict:
    """The optimizer step's time as the plan estimates it for this device: the step's FLOPs at the assumed MFU of
    the device's peak (finetune/telemetry/formulas.py), communication not counted (no bandwidth is known here)."""
    from dataclasses import replace

    from finetune.telemetry import formulas

    out = {"step_s_predicted": None, "step_s_measured": None, "step_s_relative_error": None}
    peak = formulas.device_peak() if launch.cuda else None
    if peak is None:
        reason = "the GPU is not in the peak-FLOPS table (finetune/telemetry/formulas.py), or is a MIG slice"
        return {**out, "step_s_basis": f"not predicted: {'a CPU has no peak FLOP/s' if not launch.cuda else reason}"}
    label, flops = peak
    lever = replace(
        w,
        micro_batch=planned["per_device_train_batch_size"],
        grad_accum=planned["gradient_accumulation_steps"],
        gradient_checkpointing=planned["gradient_checkpointing"],
    )
    out["step_s_predicted"] = round(search.flops_per_step(shape, lever) / (flops * search.MFU), 4)
    out["step_s_basis"] = (
        f"{label} peak {flops / 1e12:.1f} TFLOP/s x an assumed {search.MFU:.0%} MFU, rows of {w.seq_len} tokens "
        f"(data.max_length); communication not counted"
    )
    return out


def with_measured(section: dict | None, throughput: dict | None) -> dict | None:
    """run.json `plan` once training ends: the measured median optimizer-step time beside the prediction."""
    if section is None:
        return None
    measured, predicted = (throughput or {}).get("median_step_s"), section["step_s_predicted"]
    error = round((predicted - measured) / measured, 4) if measured and predicted else None
    return {**section, "step_s_measured": measured, "step_s_relative_error": error}
