"""Device memory of one training step, per device, for every strategy and method, from the config:
the largest live set over the moments of a step that can hold it ("phases"), not a sum of
everything ever allocated. Units: bytes. Derivations and the GPU comparison: docs/planning.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import NamedTuple

from finetune import precision
from finetune.modeling import loss_choice
from finetune.planning.activations import activations, loss_buffers
from finetune.planning.regimes import B16, F32, Regime
from finetune.planning.shapes import Shape, Workload
from finetune.strategies import by_key
from finetune.units import GIB

# ---- constants: one per quantity, each with its source --------------------------------------------
# cuBLAS workspace per (handle, stream), allocated through torch's caching allocator
# (aten/src/ATen/cuda/CublasHandlePool.cpp getChosenWorkspaceSize: CUBLAS_WORKSPACE_CONFIG default
# ":4096:8" = 32 MiB on sm90, ":4096:2:16:8" = 8 MiB + 128 KiB elsewhere; cuBLASLt shares it).
CUBLAS_WORKSPACE_SM90 = 4096 * 1024 * 8
CUBLAS_WORKSPACE_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8
# Handles are per thread: the forward runs on the Python thread, the backward on autograd's device thread, so a training
# step has two (derived; the six H200 records each leave 0.2-2.3 MiB unexplained after counting these 64 MiB).
CUBLAS_HANDLES = 2
# Caching-allocator fragmentation: reserved / allocated - 1 of the steady state. FITTED: the mean
# over the five H200 records of 2026-11-22 whose step allocates no buffer larger than a block freed
# before it (single 4.4%, FSDP2 11.7%, ZeRO-3 3.7%, LoRA 7.5%, QLoRA 1.0%).
ALLOCATOR_FRAGMENTATION = 0.057
# CUDA context + module images, outside torch's counters (nvidia-smi sees it, memory_stats does not): ASSUMED, a typical
# H100 figure, not in the records. Counts toward "fits", not toward the allocated/reserved predictions.
CUDA_CONTEXT_GIB = 0.5
NF4_BITS = {True: 4 + 8 / 64 + 32 / (64 * 256), False: 4 + 32 / 64}  # QLoRA paper §3; tests: bitsandbytes

METHODS = ("full", "lora", "qlora")


def chunk_tokens(w: Workload, vocab: int) -> int:
    return w.loss_chunk_tokens or loss_choice.chunk_tokens(vocab)


def resolve_loss(sh: Shape, w: Workload) -> Workload:
    """The workload with `auto` replaced by what the run installs (finetune/modeling/loss_choice.py)."""
    if w.loss_impl != "auto":
        return w
    impl, _ = loss_choice.auto_choice(
        tokens=w.tokens, vocab=sh.vocab, hidden=sh.hidden, head_trains=w.method == "full", chunk=w.loss_chunk_tokens
    )
    return replace(w, loss_impl=impl)


def loss_text(w: Workload, sh: Shape) -> str:
    """The loss as the plan shows it: `auto` with what it resolves to for this workload's method."""
    r = resolve_loss(sh, w)
    text = r.loss_impl + (f" ({chunk_tokens(r, sh.vocab)} tokens per chunk)" if r.loss_impl == "chunked" else "")
    return f"auto: {text}" if w.loss_impl == "auto" else text


def cublas_bytes(sm: int | None) -> int:
    """Both cuBLAS workspaces on a GPU of compute capability major `sm`; 0 off a GPU (sm None)."""
    if sm is None:
        return 0
    return CUBLAS_HANDLES * (CUBLAS_WORKSPACE_SM90 if sm == 9 else CUBLAS_WORKSPACE_OTHER)


def batch_bytes(w: Workload) -> int:
    """The micro-batch on the device while it trains: int64 input_ids and labels, plus the attention mask (padded
    layout) or position_ids (packed, padding-free) (finetune/data/collate.py); the embedding saves input_ids itself."""
    return 8 * w.tokens * 3


def trainable_params(sh: Shape, w: Workload) -> int:
    return sh.params.total if w.method == "full" else sh.lora_params(w.lora_r, w.lora_targets)


def largest_trainable(sh: Shape, w: Workload) -> int:
    """Elements of the largest trainable parameter tensor (a LoRA A is r x in, B out x r)."""
    if w.method == "full":
        return max(sh.parameter_numels())
    return max(w.lora_r * max(i, o) for _, i, o in sh.targeted(w.lora_targets))


def states(sh: Shape, w: Workload, p: Regime, strategy: str, n: int, z: ZeroValues | None) -> tuple[dict, dict]:
    """(device, host) bytes that persist across steps: weights, master copy, optimizer states,
    persistent gradient buffers, per device / per process."""
    st = by_key(strategy)
    fam = precision.family_of(strategy)
    P = trainable_params(sh, w)
    dev: dict[str, float] = {}
    host: dict[str, float] = {}
    shard_p = n if st.shards_params else 1  # FSDP2 and ZeRO-3 shard frozen parameters too
    if w.method == "qlora":
        quant = sh.block_linear_params
        dev["nf4_weights"] = quant * NF4_BITS[w.double_quant] / 8 / shard_p
        dev["unquantized_weights"] = (sh.params.total - quant) * p.frozen / shard_p
    elif w.method == "lora":
        dev["frozen_weights"] = sh.params.total * p.frozen / shard_p
    dev["weights" if w.method == "full" else "lora_adapters"] = P * p.param / shard_p
    if fam == "deepspeed":
        # a separate master partition, always (why: finetune/precision.py trainable_bytes)
        dev["master_weights"] = P * p.master / n
        dev["optimizer_states"] = 2 * P * p.state / n
        if st.zero_stage == 3:
            dev["grad_partition_buffer"] = P * p.grad / n  # stage3 grad_partitions_flat_buffer (zeros at init)
            dev["ipg_bucket"] = z.reduce_bucket_size * p.grad  # stage3 ipg bucket, allocated at init
        if st.offload_optimizer:
            for key in ("master_weights", "optimizer_states") + (
                ("grad_partition_buffer",) if st.zero_stage == 3 else ()
            ):
                host[key] = dev.pop(key)
            # the fp32 gradient partition, persistent on the host: ZeRO-1/2's
            # single_partition_of_fp32_groups[i].grad; ZeRO-3's one buffer per sub-group
            # (stage3.py initialize_optimizer_states, fp32_partitioned_groups_flat[i].grad), which
            # _release_sub_group frees only when the optimizer is not offloaded
            host["fp32_grad_partition"] = P * p.master / n
            if st.zero_stage != 3:
                # stage_1_and_2.py __init__: param_buffer_of_bit16_for_cpu_offload_groups (the updated
                # partition in the module dtype, for the copy back) and temp_grad_buffer_for_{cpu,gpu}_offload
                # (the largest trainable parameter's elements, one on each side)
                host["bit16_partition_buffer"] = P * p.param / n
                host["offload_grad_staging"] = dev["offload_grad_staging"] = largest_trainable(sh, w) * p.param
        if st.offload_params:
            key = "weights" if w.method == "full" else "lora_adapters"
            host[key] = dev.pop(key)
            for frozen_key in ("frozen_weights", "nf4_weights", "unquantized_weights"):
                if frozen_key in dev:
                    host[frozen_key] = dev.pop(frozen_key)
    else:
        dev["optimizer_states"] = 2 * P * p.state / (n if fam == "fsdp2" else 1)
        if st.replicates:
            dev["ddp_grad_buckets"] = P * p.grad  # DDP's flat buckets (gradient_as_bucket_view=False)
        if st.offload_params:  # FSDP2 CPUOffloadPolicy: sharded params, their gradients and states on the host
            for key in [k for k in dev if k != "ddp_grad_buckets"]:
                host[key] = dev.pop(key)
            host["gradients"] = P * p.grad / n
    return dev, host


def phases(
    sh: Shape, w: Workload, p: Regime, strategy: str, n: int, z: ZeroValues | None, *, cpu: bool = False
) -> dict:
    """{phase: {component: bytes}} of what exists beyond the persistent states at each moment, in
    the order they happen (the first of equal totals is taken as the peak)."""
    A = activations(sh, w, p, cpu=cpu)
    grads = device_gradients(sh, w, p, strategy, n)
    common = block_backward_common(sh, w, p, strategy, n, z, A, grads.head, cpu=cpu)
    out = forward_phases(sh, w, p, A)
    out.update(backward_phases(sh, w, A, grads, common))
    out.update(step_phases(sh, w, p, strategy, n, z, grads))
    return out


class DeviceGradients(NamedTuple):
    shard: int  # ranks they are sharded over
    kept: bool  # whether gradients stay on the device through the backward
    head: float  # bytes of the head's (the embedding's) gradient
    per_layer: float


def device_gradients(sh: Shape, w: Workload, p: Regime, strategy: str, n: int) -> DeviceGradients:
    """Gradients kept on the device through the backward: torch-native full fine-tuning (FSDP2 with
    CPUOffloadPolicy moves each reduced shard to the host; DeepSpeed copies them into its buckets)."""
    st, fam = by_key(strategy), precision.family_of(strategy)
    shard = n if st.shards_grads and fam != "deepspeed" else 1
    kept = w.method == "full" and fam != "deepspeed" and not (fam == "fsdp2" and st.offload_params)
    head = sh.embedding * p.grad / shard if kept else 0
    return DeviceGradients(shard, kept, head, sh.params.per_layer * p.grad / shard if kept else 0)


def forward_phases(sh: Shape, w: Workload, p: Regime, A: dict) -> dict:
    """The end of the forward and the start of the backward (the loss's buffers at each), and the
    inside of the last block's forward."""
    L = loss_buffers(sh, w, p, chunk_tokens(w, sh.vocab))
    act = A["blocks"] + A["final"] + A["rotary"] + A["indices"]  # = A["total"] less the weight casts
    casts = A["weight_casts"]
    if w.loss_impl != "standard":
        # the chunked/fused loss keeps the head's input itself (in its buffers) and casts the head's weight
        # with autocast off (finetune/modeling/loss.py): no lm_head input or autocast copy is saved
        act -= A["head_input"]
        casts -= A["weight_casts_head"]
    base = {"activations": act}
    if casts:
        base["autocast_weight_copies"] = casts
    out = {
        "forward_end": {**base, "loss_buffers": L["forward"]},
        "backward_start": {**base, "loss_buffers": L["backward"]},
    }
    if not w.gradient_checkpointing:
        # inside the last block's forward: everything before the final norm + the adapters' temporaries
        fwd = {
            "activations": A["blocks"] + A["rotary"] + A["indices"],
            "forward_temporaries": A["forward_temporaries"]["forward"],
        }
        if A["weight_casts"]:
            fwd["autocast_weight_copies"] = (sh.layers - 1) * A["weight_casts_layer"] + A["weight_casts_first"]
        out["last_block_forward"] = fwd
    return out


def backward_phases(sh: Shape, w: Workload, A: dict, grads: DeviceGradients, common: dict) -> dict:
    """The final norm's backward, then the blocks' from the last to the first. At block l: the saved tensors of blocks
    0..l (with checkpointing: their inputs, plus block l recomputed), the gradients of the blocks above (full
    fine-tuning), the head's gradient, the gradient flowing in, and the block's own backward temporaries (`common`). The
    live set is linear in l, so its maximum is at one end: the last block (first to run) or the first block."""
    T, h = w.tokens, sh.hidden
    block_casts = (sh.layers - 1) * A["weight_casts_layer"] + A["weight_casts_first"]
    # the final norm's backward, before any block's, at its pow's backward: every block's saved tensors,
    # the final norm's fp32 input (its weight's xn and its output's grad are freed by then), the head's
    # gradient, and RMSNorm's backward temporaries: 5 fp32 T x h (measured on one RMSNorm alone: 20 bytes
    # x T x h new at the peak, 16-bit or fp32, trained weight or not)
    norm_bwd = {
        "activations": A["blocks"] + F32 * T * h,
        "head_grad": grads.head,
        "norm_backward_temporaries": 5 * F32 * T * h,
        "rotary_and_targets": A["rotary"] + A["indices"],
    }
    if A["weight_casts"]:
        norm_bwd["autocast_weight_copies"] = block_casts
    out = {"final_norm_backward": norm_bwd}
    # (the final norm's and the head's saved tensors were freed by their own backward already)
    top = {"activations": A["blocks"], **common}
    if A["weight_casts"]:
        top["autocast_weight_copies"] = block_casts
    out["last_block_backward"] = top
    if sh.layers > 1:
        upper = (sh.layers - 1) * grads.per_layer
        bottom = {"activations": A["first_layer"], "upper_block_gradients": upper, **common}
        if A["weight_casts"]:
            bottom["autocast_weight_copies"] = A["weight_casts_first"]
        out["first_block_backward"] = bottom
    return out


def block_backward_common(
    sh: Shape, w: Workload, p: Regime, strategy: str, n: int, z: ZeroValues | None, A: dict, head: float, *, cpu: bool
) -> dict:
    """What every block's backward holds besides the saved tensors: the head's gradient; the MLP's
    backward temporaries (the grads of the product, act and up while gate/act/up are still saved, +2
    T x i: the product's saved tensor is freed first; with cast adapter inputs their input grads in
    the adapter dtype too); the gradient flowing in (stream dtype); the strategy's own buffers."""
    st, fam = by_key(strategy), precision.family_of(strategy)
    T, h, i = w.tokens, sh.hidden, sh.intermediate
    g = A["lin_out"]
    transient = 2 * g * T * i + A["stream"] * T * h
    if w.method != "full" and A["parts"]["mlp"] > 4 * g * T * i:  # the adapters' inputs were cast copies
        transient += p.param_compute * T * i
    if w.gradient_checkpointing:  # the block is re-run forward inside the backward: its forward temporaries
        transient = max(transient, A["forward_temporaries"]["recompute"] + A["stream"] * T * h)
    common = {
        "head_grad": head,
        "block_backward_temporaries": transient,
        "rotary_and_targets": A["rotary"] + A["indices"],
    }
    if w.gradient_checkpointing:
        common["recomputed_block"] = A["per_layer"]
    if fam == "deepspeed" and st.zero_stage in (1, 2):
        # stage_1_and_2 setup_buckets, first gradient hook: torch.empty(reduce_bucket_size). A GPU's
        # caching allocator hands over the whole block. On CPU glibc maps it (mmap, far above its
        # threshold) without touching it: only the pages the gradients are copied into are resident,
        # at most the trainable parameters' elements (contiguous_gradients copies each gradient once).
        elements = min(z.reduce_bucket_size, trainable_params(sh, w)) if cpu else z.reduce_bucket_size
        common["ipg_bucket"] = elements * p.param
    if fam == "fsdp2" and n > 1:
        # the block's unsharded parameters (and the prefetched next), and its unsharded gradients
        # before the reduce-scatter (derived from FSDP2's FSDPParamGroup; not measured)
        layer_b = sh.params.per_layer * (p.param_compute if w.method == "full" else p.frozen_compute)
        common["fsdp_unsharded_blocks"] = 2 * layer_b + (
            sh.params.per_layer * p.param_compute if w.method == "full" else 0
        )
    return common


def step_phases(
    sh: Shape, w: Workload, p: Regime, strategy: str, n: int, z: ZeroValues | None, grads: DeviceGradients
) -> dict:
    """The end of the backward (the gradients kept on the device) and the optimizer step."""
    st, fam = by_key(strategy), precision.family_of(strategy)
    P = trainable_params(sh, w)
    out = {}
    if grads.kept:
        end = {"gradients": P * p.grad / grads.shard}
        if sh.tied:
            # the head's V x h contribution waits in the embedding's input buffer until
            # embedding_dense_backward adds its own: a third tensor, unless the head's part is a fresh
            # fp32 cast from an autocast weight copy, accumulated in place
            parts = 1 if (p.autocast and p.param != B16) else 2
            end["tied_embedding_grad_parts"] = parts * sh.embedding * p.grad / grads.shard
        out["backward_end"] = end
        if w.optimizer == "foreach":  # _multi_tensor_adamw: exp_avg_sq.sqrt() for every parameter at once
            out["optimizer_step"] = {
                "gradients": P * p.grad / grads.shard,
                "foreach_temporaries": P * p.state / grads.shard,
            }
    if fam == "deepspeed" and not st.offload_optimizer:
        if st.zero_stage in (1, 2):
            compact = p.grad == F32 and p.param != F32  # fp32 gradient accumulation of a 16-bit module
            step = {"fp32_grad_partition": P * F32 / n}
            if not compact:
                step["grads_in_partition"] = P * p.grad / n  # the 16-bit partition, flattened to fp32 at the step
            out["optimizer_step"] = step
        else:
            sub = min(z.sub_group_size, P / n)  # stage3 step: one sub-group's fp32 gradient at a time
            out["optimizer_step"] = {"fp32_subgroup_grad": sub * F32}
    return out


def late_unfit(sh: Shape, w: Workload, p: Regime, strategy: str, n: int, z: ZeroValues | None) -> float:
    """Buffers allocated after the activation peak that fit no block freed before them: the caching
    allocator makes a new segment for them, so reserved grows by their size. Candidates: ZeRO-1/2's
    fp32 gradient partition and ZeRO-3's fp32 sub-group gradient at the step; what they can reuse
    is the largest block freed before (the standard loss's fp32 T x V, else an MLP intermediate)."""
    st = by_key(strategy)
    if precision.family_of(strategy) != "deepspeed" or st.offload_optimizer:
        return 0.0
    P = trainable_params(sh, w)
    freed = max(F32 * w.tokens * sh.vocab if w.loss_impl == "standard" else 0, B16 * w.tokens * sh.intermediate)
    need = P * F32 / n if st.zero_stage in (1, 2) else min(z.sub_group_size, P / n) * F32
    return need if need > freed else 0.0


def peak(
    sh: Shape, w: Workload, p: Regime, strategy: str, n: int = 1, *, sm: int | None = 9, ds_config: dict | None = None
) -> dict:
    """The predicted peak of one device: the phase that holds it, allocated and reserved bytes, the persistent and
    per-phase components, and what lives on the host. `sm`: the GPU's compute capability major (cuBLAS workspace size),
    None for a CPU run. `ds_config`: a DeepSpeed config (dict) to use instead of the strategy's shipped file. `n` is the
    world size; under tensor parallelism (w.tp) every rank holds its tensor-parallel share of the blocks and ZeRO/FSDP
    shard over the n / tp ranks of its data- (and sequence-) parallel group."""
    sh, n = sh.tp_local(w.tp), max(1, n // w.tp)
    w = resolve_loss(sh, w)
    z = zero_values(strategy, sh, ds_config)
    dev, host = states(sh, w, p, strategy, n, z)
    st = by_key(strategy)
    fam = precision.family_of(strategy)
    persistent = dict(dev)
    if sm is not None:
        persistent["cublas_workspaces"] = cublas_bytes(sm)
    persistent["batch"] = batch_bytes(w)
    if fam == "fsdp2":
        # accelerate 1.15 fsdp2_prepare_model shards the root (final norm, embedding, head) with
        # reshard_after_forward=False (accelerate/utils/fsdp_utils.py; torch _fsdp_state.py: False for
        # the root): its unsharded copy lives from forward into backward, even at world size 1
        b = p.param_compute if w.method == "full" else p.frozen_compute
        persistent["fsdp_unsharded_root"] = sh.outside_layers * b
    if st.zero_stage == 3:
        gathered = zero3_gathered(sh, z, n, p.param, p.frozen, w.method, st.offload_params)
        if gathered:
            persistent["zero3_gathered_params"] = gathered
    P = trainable_params(sh, w)
    if w.grad_accum > 1 and fam in ("torch", "fsdp2"):
        persistent["accumulated_grads"] = P * p.grad / (n if fam == "fsdp2" else 1)
    if w.grad_accum > 1 and fam == "deepspeed" and st.zero_stage in (1, 2) and not st.offload_optimizer:
        persistent["accumulated_grad_partition"] = P * p.grad / n  # the partition survives micro-steps
    ph = phases(sh, w, p, strategy, n, z, cpu=sm is None)
    base = sum(persistent.values())
    totals = {name: base + sum(parts.values()) for name, parts in ph.items()}
    name = max(totals, key=totals.get)
    allocated = totals[name]
    late = late_unfit(sh, w, p, strategy, n, z) if sm is not None else 0.0
    reserved = allocated * (1 + ALLOCATOR_FRAGMENTATION) + late if sm is not None else allocated
    A = activations(sh, w, p, cpu=sm is None)
    return {
        "phase": name,
        "allocated": allocated,
        "reserved": reserved,
        "late_unfit": late,
        "persistent": {k: v for k, v in persistent.items() if v},
        "at_peak": ph[name],
        "phases": totals,
        "host_states": host,
        "attn_kind": A["attn_kind"],
        "per_layer": A["per_layer"],
        "zero": z,
    }


def fits_total(reserved: float, on_gpu: bool = True) -> float:
    """What the device must hold: reserved + the CUDA context outside torch's counters."""
    return reserved + (CUDA_CONTEXT_GIB * GIB if on_gpu else 0)


# ---- DeepSpeed's buffer sizes as a run configures them: the shipped ds_configs/*.json with the values
# HF Trainer fills in for "auto" (transformers/integrations/deepspeed.py trainer_config_finalize), and
# ZeRO-3's rule for which gathered parameters stay on the device between forward and backward.

# DeepSpeed's own defaults where a config leaves a key out (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig).
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
    """The ZeRO values of a strategy: `ds_config` (a DeepSpeed JSON as a dict) when given, else the shipped ds_configs
    file of the strategy's row in finetune/strategies.py; None for strategies that are not DeepSpeed."""
    row = by_key(strategy)
    if row.zero_stage is None:
        return None
    if ds_config is None:
        if row.deepspeed_config is None:  # planner-only rows (zero1, zero3_offload_opt): DeepSpeed's defaults
            ds_config = {}
        else:
            from finetune.resources import resolve

            ds_config = json.loads(resolve(row.deepspeed_config).read_text(encoding="utf-8"))
    z = fill_auto(ds_config.get("zero_optimization") or {}, shape.hidden)
    keys = ("reduce_bucket_size", "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance")
    return ZeroValues(*(float(z[k]) for k in keys))


def zero3_gathered(
    shape: Shape, z: ZeroValues, n: int, param_bytes: int, frozen_bytes: int, method: str, offload_params: bool = False
) -> float:
    """ZeRO-3, N > 1: bytes of gathered parameters still on the device when backward starts, by the reuse-distance rule
    (docs/planning.md; deepspeed/runtime/zero/partitioned_param_coordinator.py release_sub_module): layer l is reused
    after 2 (L-1-l) layers + the outside parameters. At N = 1 nothing is gathered (NoGatherHandle) unless the partition
    lives on the host (offload_param). Derived from the code; not measured (needs 2 GPUs)."""
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
