"""A run's memory prediction (run.json `predicted_memory`) and its error against what it measured, and the plan's rows:
the phase model of finetune/planning/memory.py turned into GiB per component, allocated and reserved, and the host
memory of one process, with every assumption and constant stated (docs/planning.md)."""

from __future__ import annotations

import logging
import math

from finetune.config.sections import TRAINING_DEFAULTS
from finetune.data.rows import longest_row
from finetune.modeling import loss_choice
from finetune.planning import memory
from finetune.planning.activations import logits_bytes
from finetune.planning.regimes import Regime, legacy_regime, policy_regime
from finetune.planning.shapes import Shape, Workload, shape_of
from finetune.strategies import by_key, planner_key
from finetune.units import GIB, gib

log = logging.getLogger(__name__)

NOT_MODELLED = (
    "ZeRO-3 parameters kept gathered at world size > 1 (derived from stage3's reuse-distance rule, unmeasured)",
    "FSDP2's unsharded blocks at world size > 1 (derived, unmeasured)",
    "block-backward and checkpoint-recompute temporaries are approximate (CPU check: within 10%)",
    "torch.compile, MoE; Ulysses all-to-all and AutoTP all-reduce buffers (sp/tp: activations, logits and/or the blocks' states split as docs/parallelism.md says)",
    "the model loading peak (host: checkpoint pages; device: DeepSpeed's init)",
)


def regime_for(w: Workload, strategy: str, device_type: str = "cuda") -> Regime:
    if w.precision == "legacy":
        return legacy_regime(w.method, strategy, device_type, w.legacy_model_dtype)
    return policy_regime(w.precision, w.method, strategy)


def constants() -> dict:
    """Every fitted or assumed number, its value and where it comes from."""
    return {
        "cublas_workspace_bytes": {
            "value": memory.CUBLAS_WORKSPACE_SM90,
            "kind": "derived",
            "source": "CublasHandlePool.cpp default CUBLAS_WORKSPACE_CONFIG :4096:8 on sm90 "
            "(8 MiB + 128 KiB elsewhere), x 2 handles (forward thread, autograd thread)",
        },
        "allocator_fragmentation": {
            "value": memory.ALLOCATOR_FRAGMENTATION,
            "kind": "fitted",
            "source": "mean reserved/allocated - 1 of five H200 records (2026-11-22)",
        },
        "cuda_context_gib": {
            "value": memory.CUDA_CONTEXT_GIB,
            "kind": "assumed",
            "source": "typical H100 context, outside torch's counters; not measured",
        },
        "host_cuda_process_base_gib": {
            "value": HOST_CUDA_PROCESS_BASE_GIB,
            "kind": "fitted",
            "source": "median training RSS of the six H200 records (2026-11-22)",
        },
        "host_cpu_process_base_gib": {
            "value": HOST_CPU_PROCESS_BASE_GIB,
            "kind": "measured",
            "source": "psutil RSS after the imports, CPU build",
        },
        "loss_chunk_bytes": {
            "value": loss_choice.CHUNK_LOGITS_BYTES,
            "kind": "derived",
            "source": "the chunk rule, fp32 logits of one chunk (finetune/modeling/loss_choice.py)",
        },
    }


def breakdown(
    shape: Shape,
    w: Workload,
    strategy: str,
    n: int,
    *,
    sm: int | None,
    ds_config: dict | None = None,
    regime: Regime | None = None,
) -> dict:
    """The predicted peak of one device and one host process in bytes, with the regime and kernel."""
    p = regime or regime_for(w, strategy, "cuda" if sm is not None else "cpu")
    r = memory.peak(shape, w, p, strategy, n, sm=sm, ds_config=ds_config)
    components = {**r["persistent"], **{k: v for k, v in r["at_peak"].items() if v}}
    host = host_components(
        r["host_states"],
        strategy,
        on_gpu=sm is not None,
        param_numels=shape.tp_local(w.tp).parameter_numels(),
        n=n,
        sub_group_bytes=r["zero"].sub_group_size * p.master if r["zero"] else None,
    )
    if sm is None:  # a CPU run: the device is the host
        host = {**host, **components}
    return {"regime": p, "peak": r, "components": components, "host": host}


def assumptions(shape: Shape, w: Workload, p: Regime, r: dict, *, seq_len_source: str) -> dict:
    return {
        "micro_batch": w.micro_batch,
        "seq_len": w.seq_len,
        "seq_len_source": seq_len_source,
        "grad_accum": w.grad_accum,
        "gradient_checkpointing": w.gradient_checkpointing,
        "layout": w.layout + (" with padding (attention mask)" if w.masked and w.layout == "padded" else ""),
        "attention_kernel": r["attn_kind"],
        "loss_impl": memory.loss_text(w, shape),
        "logits_bytes": logits_bytes(w, p),
        "optimizer": f"AdamW ({w.optimizer})",
        "nf4_bits_per_param": memory.NF4_BITS[w.double_quant],
        "constants": constants(),
        "not_modelled": list(NOT_MODELLED),
        "device_scope": "one device; allocated is compared with memory.max.device_peak_allocated_gib, reserved with "
        "device_peak_reserved_gib; total adds the CUDA context (what must fit)",
        "host_scope": "one process (rank); compared with memory.max.host_peak_rss_gib (training peak)",
    }


def predicted_memory(
    shape: Shape,
    w: Workload,
    strategy: str,
    n: int,
    *,
    sm: int | None,
    seq_len_source: str,
    ds_config: dict | None = None,
    regime: Regime | None = None,
) -> dict:
    """run.json `predicted_memory` (docs/run_record.md)."""
    b = breakdown(shape, w, strategy, n, sm=sm, ds_config=ds_config, regime=regime)
    p, r = b["regime"], b["peak"]
    on_gpu = sm is not None
    device = None
    if on_gpu:
        allowance = r["reserved"] - r["allocated"] - r["late_unfit"]
        device = {
            "components_gib": {k: gib(v) for k, v in b["components"].items()},
            "allocated_gib": gib(r["allocated"]),
            "allocator_allowance_gib": gib(allowance),
            "late_unfit_gib": gib(r["late_unfit"]),
            "reserved_gib": gib(r["reserved"]),
            "cuda_context_gib": memory.CUDA_CONTEXT_GIB,
            "total_gib": gib(memory.fits_total(r["reserved"])),
        }
    return {
        "strategy": strategy,
        "method": w.method,
        "world_size": n,
        "precision": {
            "policy": p.policy,
            "note": p.note,
            "param_bytes": p.param,
            "frozen_bytes": p.frozen,
            "grad_bytes": p.grad,
            "state_bytes": p.state,
            "master_bytes": p.master,
            "autocast": p.autocast,
            "compute_bytes": p.compute,
        },
        "phase": r["phase"],
        "phases_gib": {k: gib(v) for k, v in r["phases"].items()},
        "device": device,
        "host": {
            "components_gib": {k: gib(v) for k, v in b["host"].items()},
            "total_gib": gib(sum(b["host"].values())),
        },
        "assumptions": assumptions(shape, w, p, r, seq_len_source=seq_len_source),
        "error": None,
    }


def _err(pred, measured):
    if pred is None or not measured:
        return None
    return {
        "predicted_gib": round(pred, 4),
        "measured_gib": measured,
        "relative_error": round((pred - measured) / measured, 4),
    }


def add_error(predicted: dict, memory_section: dict | None, *, lifetime_peak_gib: float | None = None) -> dict:
    """Fill predicted['error'] from run.json `memory` (training peaks): (predicted - measured) / measured,
    for device allocated, device reserved and host; and against rank 0's lifetime peak RSS, which does
    not miss in-step memory but includes model loading."""
    peaks = (memory_section or {}).get("max") or {}
    dev = predicted.get("device")
    predicted["error"] = {
        "device_allocated": _err(dev and dev["allocated_gib"], peaks.get("device_peak_allocated_gib")),
        "device_reserved": _err(dev and dev["reserved_gib"], peaks.get("device_peak_reserved_gib")),
        "host": _err(predicted["host"]["total_gib"], peaks.get("host_peak_rss_gib")),
        "host_lifetime_peak_rank0": _err(predicted["host"]["total_gib"], lifetime_peak_gib),
    }
    return predicted


AUTO = "auto"  # training.per_device_train_batch_size / gradient_checkpointing: the planner decides
# `per_device_train_batch_size: auto` keeps the sequences per device per optimizer step the default micro-batch would
# train (Trainer's 8) times gradient_accumulation_steps (finetune/planning/search.py).
DEFAULT_MICRO_BATCH = TRAINING_DEFAULTS["per_device_train_batch_size"]


def micro_batch_of(cfg) -> int:
    """The recipe's per-device micro-batch (rows): Trainer's default where the recipe has none, and the default
    `auto` keeps the sequences of where it says auto."""
    b = cfg.training.typed.per_device_train_batch_size
    return DEFAULT_MICRO_BATCH if b == AUTO else int(b)


def length_stats(lengths: list[int]) -> dict:
    """{rows, p50, p95, max, min} of token lengths (nearest rank: the smallest length at least that share of the
    rows has)."""
    ordered = sorted(lengths)

    def rank(share: float) -> int:
        return ordered[max(0, math.ceil(share * len(ordered)) - 1)]

    return {"rows": len(ordered), "p50": rank(0.5), "p95": rank(0.95), "max": ordered[-1], "min": ordered[0]}


def workload_from_config(
    cfg,
    *,
    precision: str,
    gradient_checkpointing: bool | None = None,
    seq_len: int | None = None,
    masked: bool = False,
    loss_impl: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> Workload:
    """The workload of a recipe. `loss_impl`: the resolved loss (a run's speed record); else the
    recipe's training.loss_impl; "auto" is resolved per method and shape as the run resolves it
    (finetune/modeling/loss_choice.py; a head that needs the logits is recorded by the run)."""
    targs = cfg.training.typed
    if gradient_checkpointing is None:  # `auto` here: off, the recipe's lever the search tries both ways
        gradient_checkpointing = targs.gradient_checkpointing is True or bool(targs.activation_checkpointing)
    m, d, t = cfg.method, cfg.data, cfg.training
    micro_batch = micro_batch_of(cfg)
    # the longest row a batch can have: data.pad_to_multiple_of rounds it up (finetune/data/rows.py)
    seq_len = longest_row(micro_batch, seq_len or d.max_length, d)
    if loss_impl is None:
        loss_impl = getattr(t, "loss_impl", "standard")  # "auto": resolved per method (memory.resolve_loss)
    layout = "padding_free" if getattr(d, "padding_free", False) else ("packed" if d.packing else "padded")
    optim = str(targs.optim)
    return Workload(
        method=m.name,
        micro_batch=micro_batch,
        seq_len=seq_len,
        grad_accum=int(targs.gradient_accumulation_steps),
        gradient_checkpointing=gradient_checkpointing,
        precision=precision,
        lora_r=m.lora_r,
        lora_targets=m.target_modules,
        lora_dropout=m.lora_dropout,
        double_quant=m.double_quant,
        attn_implementation=cfg.model.attn_implementation,
        layout=layout,
        masked=masked,
        loss_impl=loss_impl,
        loss_chunk_tokens=loss_chunk_tokens or getattr(t, "loss_chunk_tokens", None),
        optimizer="foreach" if optim in ("adamw_torch", "adamw_hf") else "fused",
        legacy_model_dtype=cfg.model.dtype,
        sp=cfg.parallel.sp_size,
        tp=cfg.parallel.tp_size,
        cp=cfg.parallel.cp_size,
    )


def run_prediction(
    view, model_config, cfg, *, gradient_checkpointing: bool, precision: str, train_dataset=None
) -> dict | None:
    """run.json `predicted_memory` for the strategy in the record's `strategy` (`view`), under the resolved
    precision policy; null with a logged reason when the architecture has no arithmetic here (training
    goes on: a plan is not a precondition). The sequence length is the longest training example when
    the dataset is given (batches are padded to their longest), and padding is assumed when some
    example is shorter; the loss implementation is the one the run resolved (its `speed` record)."""
    engaged = view.get("strategy", default={})
    seq_len, masked, source = None, False, "data.max_length"
    if train_dataset is not None and "input_ids" in train_dataset.column_names and len(train_dataset):
        lengths = [len(ids) for ids in train_dataset["input_ids"]]
        seq_len = min(max(lengths), cfg.data.max_length)
        masked = min(lengths) < longest_row(micro_batch_of(cfg), seq_len, cfg.data)  # bucketing pads equal lengths too
        source = "longest tokenized training example (data.max_length caps it)"
    speed = (view.data.get("speed") or {}).get("loss_impl") or {}  # the run's `speed` section, when present
    on_gpu = view.get("hardware", "device_type") == "cuda" and not engaged.get("cpu_distributed")
    sm = None
    if on_gpu:
        import torch

        sm = torch.cuda.get_device_capability()[0]
    try:
        shape = shape_of(model_config)
        w = workload_from_config(
            cfg,
            precision=precision,
            gradient_checkpointing=gradient_checkpointing,
            seq_len=seq_len,
            masked=masked,
            loss_impl=speed.get("resolved"),
            loss_chunk_tokens=speed.get("chunk_tokens"),
        )
        strategy = planner_key(engaged.get("name"), engaged.get("offload", "none"))
        return predicted_memory(shape, w, strategy, engaged.get("world_size") or 1, sm=sm, seq_len_source=source)
    except ValueError as e:
        log.warning("no memory prediction in run.json: %s", e)
        return None


def prediction_with_error(view, host_lifetime_gib: float | None = None) -> dict | None:
    """Once training ends: the relative errors of the prediction against the measured training peaks.
    host_lifetime_gib: rank 0's lifetime peak RSS as the meter kept it (its high-water-mark resets
    also reset what getrusage reports, finetune/telemetry/meter.py); getrusage without it."""
    predicted = view.get("predicted_memory")
    if predicted is None:
        return None
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    lifetime = round(
        host_lifetime_gib
        if host_lifetime_gib is not None
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB,
        4,
    )
    return add_error(predicted, view.get("memory"), lifetime_peak_gib=lifetime)


def mesh_runs_under(w: Workload, strategy: str) -> bool:
    """Whether the workload's mesh can run under a planner strategy row (finetune/mesh.py)."""
    row = by_key(strategy)
    return all(size == 1 or row.runs(dim) for dim, size in (("sp", w.sp), ("tp", w.tp), ("cp", w.cp)))


def plan_rows(shape: Shape, w: Workload, n: int, *, methods=memory.METHODS, strategies=None) -> list[dict]:
    """One row per (method, strategy) for `finetune plan`: the breakdown on one device and one host process."""
    from finetune.strategies import STRATEGIES

    rows = []
    for method in methods:
        wm = Workload(**{**w.__dict__, "method": method})
        if wm.tp > 1 and method != "full":
            continue  # tensor parallelism trains full fine-tuning only (finetune/config/validate.py)
        for strategy in strategies or [s.key for s in STRATEGIES]:
            if n == 1 and by_key(strategy).multi_process and not by_key(strategy).offload_optimizer:
                continue  # on one device only the offload variants differ from `single`
            if not mesh_runs_under(wm, strategy):
                continue
            b = breakdown(shape, wm, strategy, n, sm=9)
            r = b["peak"]
            rows.append(
                {
                    "method": method,
                    "strategy": strategy,
                    "regime": b["regime"],
                    "phase": r["phase"],
                    "device": b["components"],
                    "allocated": r["allocated"],
                    "reserved": r["reserved"],
                    "device_total": memory.fits_total(r["reserved"]),
                    "host": b["host"],
                    "host_total": sum(b["host"].values()),
                    "attn_kind": r["attn_kind"],
                    "phases": r["phases"],
                }
            )
    return rows


# ---- Host memory (resident set) of one training process (docs/planning.md "Host memory"). Pinned
# buffers are rounded up to a power of two (aten/src/ATen/core/CachingHostAllocator.h allocate:
# c10::llvm::PowerOf2Ceil), so a 4.6 GiB pinned fp32 master costs 8 GiB.

# FITTED: the median training-peak RSS of rank 0 in the six H200 records of 2026-11-22 (memory.max.host_peak_rss_gib:
# 1.81 2.16 2.19 2.20 2.46 2.50 GiB; psutil RSS sampled after every micro-step). One constant for every GPU run; its
# parts are not measured separately (the GPU check in docs/planning.md decomposes it).
HOST_CUDA_PROCESS_BASE_GIB = 2.2
# MEASURED here: psutil RSS of a Python process after importing torch (CPU build), transformers,
# accelerate, peft and deepspeed (0.53 GiB, torch 2.13, transformers 5.23).
HOST_CPU_PROCESS_BASE_GIB = 0.55
# DeepSpeed offload buffers pinned when `pin_memory: true` (the shipped offload configs): ZeRO-1/2's buffers
# (stage_1_and_2.py initialize_optimizer_states; stage3.py _unpin_offload_buffers lists ZeRO-3's); CPU-Adam's states and
# ZeRO-3's master are pageable. FSDP2 CPUOffloadPolicy(pin_memory=True) pins each parameter shard and gradient.
PINNED_KEYS = set(
    "master_weights fp32_grad_partition bit16_partition_buffer offload_grad_staging grad_partition_buffer weights "
    "lora_adapters frozen_weights nf4_weights unquantized_weights gradients".split()
)


def pinned(key: str, strategy: str) -> bool:
    """Whether an offload run pins the host component `key` of `strategy` (the shipped pin_memory)."""
    return key in PINNED_KEYS and not (key == "master_weights" and by_key(strategy).zero_stage == 3)


def pinned_size(nbytes: float) -> float:
    """What CachingHostAllocator takes for one pinned buffer of `nbytes`."""
    if nbytes <= 0:
        return 0.0
    return float(2 ** math.ceil(math.log2(nbytes)))


def host_components(
    host_states: dict,
    strategy: str,
    *,
    on_gpu: bool,
    param_numels: list[int],
    n: int,
    sub_group_bytes: float | None = None,
) -> dict:
    """Bytes per component of one process's host memory, the process base included.
    `param_numels`: the model's parameter tensors (FSDP2 pins each shard separately);
    `sub_group_bytes`: ZeRO-3's sub_group_size in bytes of the fp32 gradient (one pinned buffer each)."""
    st = by_key(strategy)
    out = {"process_base": (HOST_CUDA_PROCESS_BASE_GIB if on_gpu else HOST_CPU_PROCESS_BASE_GIB) * GIB}
    for key, value in host_states.items():
        if not value:
            continue
        if not on_gpu or not pinned(key, strategy):  # CPU runs pin nothing (cpu rehearsal configs)
            out[key] = value
        elif st.zero_stage == 3 and key == "fp32_grad_partition" and sub_group_bytes:
            # sub-groups end at parameter boundaries past sub_group_size: taken as equal chunks
            full, rest = divmod(value, sub_group_bytes)
            out[key] = full * pinned_size(sub_group_bytes) + pinned_size(rest)
        elif st.zero_stage is not None:
            out[key] = pinned_size(value)  # one flat buffer per parameter group; the main group dominates
        else:  # FSDP2: every parameter's shard is its own pinned tensor
            per_element = value / (sum(param_numels) / n)
            out[key] = sum(pinned_size(numel / n * per_element) for numel in param_numels)
    return out
