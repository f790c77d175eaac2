"""Time per optimizer step, for the recommendation when a bandwidth is known: compute at an assumed
fraction of an assumed GPU's peak, plus the communication at the bus bandwidth and the host<->device
copies (finetune/planning/comm.py), with no overlap. Strategies are tried fastest first
(finetune/strategies.py SPEED_ORDER), which assumes the communication hides behind the compute;
where it does not (it takes longer than the compute), the strategy with the least estimated time
wins instead (docs/planning.md "Recommendation").
"""

from __future__ import annotations

from finetune.planning.shapes import Shape, Workload

# ASSUMED: the GPU the plan is for, as the memory arithmetic assumes compute capability 9.x: an H100
# SXM's dense bf16 peak (NVIDIA H100 whitepaper, 989.4 TFLOP/s; finetune/telemetry/formulas.py
# PEAK_DENSE_FLOPS has the same row).
PEAK_FLOPS = 989.4e12
# ASSUMED: the model FLOPs utilisation of a tuned fine-tuning step (the target of docs/benchmarks.md;
# not measured here). Only decides whether communication dominates; a lower MFU makes that rarer.
MFU = 0.40
# ASSUMED: host<->device copy bandwidth when --bandwidth is a number (PCIe 4.0 x16 carries about
# 25 GB/s of pinned copies); `finetune bench-comm --out` measures it on a GPU machine.
H2D_GBS = 25.0


def flops_per_step(shape: Shape, w: Workload) -> float:
    """Model FLOPs of one optimizer step on one device, as the runs count MFU
    (finetune/telemetry/model_flops.py): 6N per token for full fine-tuning, 4N with a frozen base
    (LoRA, QLoRA: no weight gradients), N the matmul weights (the blocks' linears and the head), plus
    PaLM's 12·L·Q·T attention term; every row taken at its full length (an upper bound)."""
    matmul = shape.block_linear_params + shape.vocab * shape.hidden
    per_token = (6 if w.method == "full" else 4) * matmul + 12 * shape.layers * shape.q * w.seq_len
    return per_token * w.micro_batch * w.seq_len * w.grad_accum


def step_seconds(shape: Shape, w: Workload, comm_times: dict) -> dict | None:
    """{compute_s, communication_s, total_s, communication_dominates} of one row, or None when the
    communication time is unknown (no bandwidth given)."""
    coll, h2d = comm_times.get("collectives_s"), comm_times.get("host_device_s")
    if coll is None or h2d is None:
        return None
    compute = flops_per_step(shape, w) / (PEAK_FLOPS * MFU)
    moving = coll + h2d
    return {
        "compute_s": compute,
        "communication_s": moving,
        "total_s": compute + moving,
        "communication_dominates": moving > compute,
    }


def constants() -> dict:
    return {
        "step_time_peak_flops": {
            "value": PEAK_FLOPS,
            "kind": "assumed",
            "source": "H100 SXM dense bf16 (whitepaper), the GPU of compute capability 9.x the plan assumes",
        },
        "step_time_mfu": {
            "value": MFU,
            "kind": "assumed",
            "source": "a tuned fine-tuning step (docs/benchmarks.md's target); not measured",
        },
        "h2d_gbs_when_not_measured": {
            "value": H2D_GBS,
            "kind": "assumed",
            "source": "PCIe 4.0 x16 pinned copies; `finetune bench-comm --out FILE` measures it",
        },
    }
