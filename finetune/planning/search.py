"""The levers a plan searches, and a run's `auto` resolves: the micro-batch (with the accumulation that keeps the
sequences per device per optimizer step), gradient checkpointing, and, for `finetune plan`, the strategy with its
offload. The answer is the fastest option that fits with the margin (docs/planning.md "The answer").

Fastest = the least estimated optimizer-step time: the model FLOPs of the step, with the forward that
checkpointing recomputes, at an assumed MFU of the GPU's peak, plus the communication and host<->device copies at
--bandwidth when one is given (without one the collectives are taken as hidden behind the compute, and the copies
run at an assumed PCIe bandwidth); ties go to the strategy speed order (finetune/strategies.py), then to the larger
micro-batch (fewer, larger kernels). Offload is the answer only where nothing else fits or communication dominates
(fastest)."""

from __future__ import annotations

from dataclasses import replace

from finetune.planning import prediction
from finetune.planning.memory import fits_total
from finetune.planning.prediction import AUTO, DEFAULT_MICRO_BATCH
from finetune.planning.shapes import Shape, Workload
from finetune.strategies import by_key

MARGIN = 0.90  # "fits" = at most 90% of device (and host) memory: headroom for fragmentation spikes

# ASSUMED: the GPU when none is named (--gpu): an H100 SXM's dense bf16 peak (NVIDIA H100 whitepaper, 989.4 TFLOP/s;
# finetune/telemetry/formulas.py PEAK_DENSE_FLOPS has the same row), as the memory arithmetic assumes compute
# capability 9.x. Only relative times are ranked without --gpu; tokens/s are predicted only for a named GPU.
PEAK_FLOPS = 989.4e12
# ASSUMED: the model FLOPs utilisation of a tuned fine-tuning step (the target of docs/benchmarks.md; not measured).
MFU = 0.40
# ASSUMED: host<->device copy bandwidth when --bandwidth is a number (PCIe 4.0 x16 carries about 25 GB/s of pinned
# copies); `finetune bench-comm --out` measures it on a GPU machine.
H2D_GBS = 25.0


def sequences_per_step(cfg) -> tuple[int, str]:
    """(sequences per device per optimizer step the recipe trains, how that number is made). The search keeps
    it: micro-batch x accumulation, whatever the micro-batch."""
    t = cfg.training.typed
    b, a = t.per_device_train_batch_size, t.gradient_accumulation_steps
    if b == AUTO:
        return DEFAULT_MICRO_BATCH * a, f"auto: {DEFAULT_MICRO_BATCH} (the default micro-batch) x accumulation {a}"
    return b * a, f"micro-batch {b} x accumulation {a}"


def splits(sequences: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs that train `sequences` per device per step, largest micro-batch first."""
    return [(b, sequences // b) for b in range(sequences, 0, -1) if sequences % b == 0]


def flops_per_step(shape: Shape, w: Workload) -> int:
    """FLOPs of one optimizer step on one device: the model FLOPs as the runs count MFU
    (finetune/telemetry/model_flops.py: 6N per token for full fine-tuning, 4N with a frozen base, N the matmul
    weights (the blocks' linears and the head), plus PaLM's 12·L·Q·T attention term; every row at its full
    length), plus, with gradient checkpointing, the blocks' forward run again in the backward: 2N + 4·L·Q·T per
    token less each block's last linear (down_proj), which torch's non-reentrant checkpoint does not re-run (its
    early stop: nothing saved needs its output); about a third of full fine-tuning's block FLOPs, half of LoRA's.
    tests/planning/test_plan.py counts the recompute with torch's FLOP counter."""
    matmul = shape.block_linear_params + shape.vocab * shape.hidden
    attention = 12 * shape.layers * shape.q * w.seq_len
    per_token = (6 if w.method == "full" else 4) * matmul + attention
    if w.gradient_checkpointing:
        _, n_in, n_out = shape.linears[-1]
        per_token += 2 * (shape.block_linear_params - shape.layers * n_in * n_out) + attention // 3
    return per_token * w.micro_batch * w.seq_len * w.grad_accum


def step_seconds(shape: Shape, w: Workload, comm_times: dict, peak: float = PEAK_FLOPS) -> dict:
    """{compute_s, collectives_s, host_device_s, communication_s, total_s, communication_dominates} of one option,
    nothing overlapped. collectives_s is None without a bus bandwidth: the collectives are then taken as hidden
    behind the compute (the host<->device copies never are: PCIe carries them whatever links the GPUs)."""
    compute = flops_per_step(shape, w) / (peak * MFU)
    coll, h2d = comm_times.get("collectives_s"), comm_times.get("host_device_s")
    moving = (coll or 0.0) + (h2d or 0.0)
    return {
        "compute_s": compute,
        "collectives_s": coll,
        "host_device_s": h2d,
        "communication_s": moving,
        "total_s": compute + moving,
        "communication_dominates": moving > compute,
    }


def rank(row: dict) -> tuple:
    """The order of fitting options: estimated step time, the strategy speed order, the larger micro-batch."""
    return (row["step_time"]["total_s"], by_key(row["strategy"]).speed_rank, -row["micro_batch"])


def fastest(rows: list[dict]) -> dict | None:
    """The fitting option with the least rank(), or None when nothing fits. An offload option carries a cost the
    estimate leaves out (the host's optimizer step), so it is the answer only when nothing without offload fits,
    or when the best of those spends longer moving data than computing: then the least estimated time wins."""
    fitting = [r for r in rows if r["fits"]]
    on_device = [r for r in fitting if by_key(r["strategy"]).offload == "none"]
    if not on_device:
        return min(fitting, key=rank) if fitting else None
    best = min(on_device, key=rank)
    return min(fitting, key=rank) if best["step_time"].get("communication_dominates") else best


def lever_workloads(w: Workload, sequences: int, *, micro_batch: bool, checkpointing: bool) -> list[Workload]:
    """The workloads to try: every split of `sequences` when the micro-batch is a lever (else the workload's own),
    with and without checkpointing when that is one (else as given)."""
    pairs = splits(sequences) if micro_batch else [(w.micro_batch, w.grad_accum)]
    ckpt = (False, True) if checkpointing else (w.gradient_checkpointing,)
    return [replace(w, micro_batch=b, grad_accum=a, gradient_checkpointing=c) for c in ckpt for b, a in pairs]


def resolve_levers(
    shape: Shape,
    w: Workload,
    strategy: str,
    n: int,
    *,
    limit_bytes: float,
    sm: int | None,
    sequences: int,
    micro_batch: bool,
    checkpointing: bool,
) -> dict:
    """A run's `auto`: the fastest micro-batch and checkpointing of `strategy` whose predicted memory fits MARGIN of
    `limit_bytes` (a GPU run: the device total, the CUDA context included; a CPU run (sm None): the process's
    resident set). {"chosen": {micro_batch, grad_accum, gradient_checkpointing, predicted_gib, fraction} | None,
    "tried": [...]}: what each option needs, in the order tried."""
    tried = []
    for option in lever_workloads(w, sequences, micro_batch=micro_batch, checkpointing=checkpointing):
        b = prediction.breakdown(shape, option, strategy, n, sm=sm)
        need = fits_total(b["peak"]["reserved"]) if sm is not None else sum(b["host"].values())
        tried.append(
            {
                "strategy": strategy,
                "micro_batch": option.micro_batch,
                "grad_accum": option.grad_accum,
                "gradient_checkpointing": option.gradient_checkpointing,
                "predicted_gib": round(need / 2**30, 4),
                "fraction": round(need / limit_bytes, 4),
                "fits": need <= MARGIN * limit_bytes,
                "step_time": {"total_s": flops_per_step(shape, option) / (PEAK_FLOPS * MFU)},
            }
        )
    return {"chosen": fastest(tried), "tried": tried}
