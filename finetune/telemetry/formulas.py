"""The formulas of what runs measure, each once: model FLOPs per token, the peak-FLOPs table,
MFU, throughput over steps, the maximum over ranks.

Definitions are shared/DESIGN.md's: throughput over training steps only, the first `warmup`
optimizer steps excluded and said so; MFU only for devices whose peak is in PEAK_DENSE_FLOPS,
never a guess. The counters that feed them: finetune/telemetry/meter.py.
"""

from __future__ import annotations

import re
import statistics

# Peak dense (no sparsity) bf16 tensor FLOP/s per device, from the vendors' datasheets
# (NVIDIA H100/H200/A100/L4/A10/T4 product briefs; T4 has no bf16: its fp16 figure).
# Order matters: the first pattern that matches torch.cuda.get_device_name() wins.
# A10G (AWS) has no public datasheet figure, so it is deliberately absent: no MFU there.
PEAK_DENSE_FLOPS: list[tuple[str, str, float]] = [
    (r"H100.*PCIe", "H100 PCIe", 756e12),
    (r"H100.*NVL", "H100 NVL", 835e12),
    (r"H100", "H100 SXM", 989e12),
    (r"H200", "H200", 989e12),
    (r"A100", "A100", 312e12),
    (r"\bL4\b", "L4", 121e12),
    (r"\bA10\b", "A10", 125e12),
    (r"\bT4\b", "T4 (fp16)", 65e12),
]


def peak_flops(device_name: str | None) -> tuple[str, float] | None:
    """(table entry, peak dense FLOP/s) for a device name, or None when it is not in the table."""
    for pattern, label, flops in PEAK_DENSE_FLOPS:
        if device_name and re.search(pattern, device_name):
            return label, flops
    return None


def device_peak() -> tuple[str, float] | None:
    """peak_flops() of this process's CUDA device 0, or None (no CUDA, or off the table)."""
    import torch

    return peak_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def mfu(input_tokens_per_s: float, flops_per_token: float | None, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s / (peak dense FLOP/s x devices). Model FLOPs
    are spent on every input token (prompt positions too), so it takes input tokens/s. None
    without a FLOPs figure or a device peak."""
    if not flops_per_token or not peak:
        return None
    return input_tokens_per_s * flops_per_token / (peak * devices)


def flops_per_token(config, method: str, seq_len: float) -> tuple[float, str]:
    """Model FLOPs per trained token and the convention used.

    full: 6N + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, appendix B): 2N forward, 4N backward,
    plus attention scores. LoRA/QLoRA: frozen weights get no weight gradients, so the
    backward costs 2N instead of 4N: 4N + 12·L·H·Q·T (adapter FLOPs, <1% of N, ignored).
    N counts every matmul weight: all parameters except the input embedding table (a lookup),
    with the LM head counted even when tied. T is the mean sequence length actually trained.
    """
    hidden = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
    n = layers * per_layer + hidden * config.vocab_size  # + LM head
    attention = 12 * layers * heads * head_dim * seq_len
    if method == "full":
        return 6 * n + attention, "6N + 12LHQT (PaLM appendix B), N = matmul weights incl. LM head"
    return 4 * n + attention, "4N + 12LHQT: frozen base (no weight gradients), LoRA FLOPs ignored"


def max_over_ranks(per_rank: list[dict]) -> dict:
    keys = [k for k in per_rank[0] if k != "rank"]
    out = {}
    for k in keys:
        values = [r[k] for r in per_rank if r.get(k) is not None]
        out[k] = max(values) if values else None
    return out


def rates(step_s: list[float], trained: list[int], inputs: list[int], samples: list[int], *, warmup: int) -> dict:
    """Unrounded per-second figures over per-optimizer-step times and counts. The first `warmup`
    steps are excluded (kept when the run has no more steps than that, and then said so):
    {excluded, steps, seconds, trained_tokens_per_s, input_tokens_per_s, samples_per_s, median_step_s},
    the per-second ones None when the measured steps took no time."""
    excluded = warmup if len(step_s) > warmup else 0
    times = step_s[excluded:]
    total = sum(times)
    per_s = (lambda counts: sum(counts[excluded:]) / total) if total > 0 else (lambda counts: None)
    return {"excluded": excluded, "steps": len(times), "seconds": total, "trained_tokens_per_s": per_s(trained),
            "input_tokens_per_s": per_s(inputs), "samples_per_s": per_s(samples),
            "median_step_s": statistics.median(times) if times else None}


def throughput(step_s: list[float], trained: list[int], inputs: list[int], samples: list[int], *,
               world_size: int, warmup: int, flops_token: float | None, peak: float | None,
               devices: int) -> dict:
    """The run record's `throughput` section from per-optimizer-step times and token counts
    (token counts summed over ranks), rounded as recorded."""
    r = rates(step_s, trained, inputs, samples, warmup=warmup)
    if not r["steps"] or r["seconds"] <= 0:
        return {"trained_tokens_per_s": None, "trained_tokens_per_s_per_device": None, "input_tokens_per_s": None,
                "samples_per_s": None, "median_step_s": None, "mfu": None, "flops_convention": None,
                "warmup_steps_excluded": r["excluded"], "steps_measured": 0}
    tps = r["trained_tokens_per_s"]
    value = mfu(r["input_tokens_per_s"], flops_token, peak, devices)
    return {"trained_tokens_per_s": round(tps, 3), "trained_tokens_per_s_per_device": round(tps / world_size, 3),
            "input_tokens_per_s": round(r["input_tokens_per_s"], 3),
            "samples_per_s": round(r["samples_per_s"], 4),
            "median_step_s": round(r["median_step_s"], 4), "mfu": round(value, 4) if value is not None else None,
            "warmup_steps_excluded": r["excluded"], "steps_measured": r["steps"]}
