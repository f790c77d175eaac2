"""Communication per optimizer step and per rank, and the time it implies at a bus bandwidth (ring
collectives as nccl-tests counts them; per-strategy volumes and offload copies: docs/planning.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import UserError
from finetune.planning.bench_comm import BUS_FACTORS
from finetune.planning.memory import NF4_BITS
from finetune.planning.regimes import Regime
from finetune.planning.shapes import Shape, Workload
from finetune.strategies import by_key
from finetune.units import GB  # nccl-tests report GB/s as 1e9 bytes/s


def ring_factor(op: str, n: int) -> float:
    """Bytes per rank / buffer bytes for a ring collective (nccl-tests PERFORMANCE.md busbw factors)."""
    return BUS_FACTORS[op](n) if n >= 2 else 0.0


def step_traffic(shape: Shape, w: Workload, strategy: str, n: int, regime: Regime) -> dict:
    """{'collectives': {name: bytes per rank}, 'host_device': {name: bytes per rank}} per optimizer step.
    Bytes per element from the precision regime (finetune/planning/regimes.py): gradients are reduced
    in their accumulation dtype (DDP's .grad, FSDP2's reduce_dtype, DeepSpeed's module dtype), the
    updated parameters gathered in the module's dtype, and ZeRO-3/FSDP2 gather what forward reads."""
    st = by_key(strategy)
    p = regime
    mp = _model_parallel_traffic(shape, w, p)
    shape, n = shape.tp_local(w.tp), max(1, n // w.tp)  # ZeRO/FSDP over the ranks of one tp shard
    if w.method == "full":
        trainable = shape.params.total
        all_bytes = trainable * p.param_compute
    else:
        trainable = shape.lora_params(w.lora_r, w.lora_targets)
        frozen = shape.params.total
        if w.method == "qlora":  # the packed 4-bit storage is what gets gathered
            q = shape.block_linear_params
            frozen_bytes = q * NF4_BITS[w.double_quant] / 8 + (frozen - q) * p.frozen_compute
        else:
            frozen_bytes = frozen * p.frozen_compute
        all_bytes = frozen_bytes + trainable * p.param_compute
    s_g, s_w, a = trainable * p.grad, trainable * p.param, w.grad_accum
    coll, h2d = {}, {}
    if n >= 2 and st.multi_process:
        if st.replicates:
            coll["all_reduce gradients"] = ring_factor("all_reduce", n) * s_g
        elif not st.shards_params:  # ZeRO-1/2
            coll["reduce_scatter gradients"] = a * ring_factor("reduce_scatter", n) * s_g
            coll["all_gather updated params"] = ring_factor("all_gather", n) * s_w
        else:  # ZeRO-3 / FSDP2
            coll["all_gather params (forward)"] = a * ring_factor("all_gather", n) * all_bytes
            coll["all_gather params (backward)"] = a * ring_factor("all_gather", n) * all_bytes
            coll["reduce_scatter gradients"] = a * ring_factor("reduce_scatter", n) * s_g
    if st.offload_optimizer:
        h2d["gradients device->host"] = (a if st.zero_stage is None else 1) * s_g / n
        h2d["updated params host->device"] = s_w / n
    if st.offload_params:
        h2d["params host->device (forward + backward)"] = 2 * a * all_bytes / n
    return {"collectives": {**coll, **mp}, "host_device": h2d}


def _model_parallel_traffic(shape: Shape, w: Workload, p: Regime) -> dict:
    """Bytes per rank per optimizer step of the mesh's own collectives, forward and backward of every
    block and micro-batch: AutoTP's all-reduce of the two row-parallel outputs (and of the two
    column-parallel inputs' gradients), T x hidden each; Ulysses' all-to-all of q, k, v and the
    attention output (and their gradients), of which (sp - 1) / sp leaves the rank."""
    out, T, b = {}, w.tokens, p.param_compute if w.method == "full" else p.frozen_compute
    if w.tp > 1:
        out["all_reduce tensor-parallel activations"] = (
            w.grad_accum * shape.layers * 4 * ring_factor("all_reduce", w.tp) * T * shape.hidden * b
        )
    if w.sp > 1:
        width = 2 * shape.q + 2 * shape.kv
        out["all_to_all sequence-parallel attention"] = (
            w.grad_accum * shape.layers * 2 * (w.sp - 1) / w.sp * T * width * b
        )
    return out


def step_time(traffic: dict, busbw_gbs: float | None, h2d_gbs: float | None) -> dict:
    """Seconds per optimizer step spent moving those bytes (no overlap with compute assumed)."""
    coll = sum(traffic["collectives"].values())
    host = sum(traffic["host_device"].values())
    return {
        "collectives_s": coll / (busbw_gbs * GB) if busbw_gbs else None,
        "host_device_s": host / (h2d_gbs * GB) if h2d_gbs and host else (0.0 if not host else None),
    }


def read_bandwidth(value: str | None) -> dict:
    """--bandwidth: a number of GB/s (bus bandwidth), or the JSON file `finetune bench-comm` wrote.
    From the file: the all-reduce bus bandwidth at the largest size measured, and the
    host->device copy bandwidth when it was measured."""
    if value is None:
        return {"busbw_gbs": None, "h2d_gbs": None, "source": None}
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None:
        if number <= 0:
            raise UserError(f"--bandwidth: must be > 0 GB/s, got {value}")
        return {"busbw_gbs": number, "h2d_gbs": None, "source": f"--bandwidth {value} GB/s"}
    path = Path(value)
    if not path.is_file():
        raise UserError(
            f"--bandwidth: {value!r} is neither a number of GB/s nor a file written by "
            f"`finetune bench-comm --out FILE.json`"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = [r for r in data["results"] if r["op"] == "all_reduce"]
        best = max(rows, key=lambda r: r["bytes"])
        busbw = float(best["busbw_gbs"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"--bandwidth: {path} is not a bench-comm result (needs results[] with op "
            f"'all_reduce', bytes, busbw_gbs): {type(e).__name__}: {e}"
        ) from None
    copy = data.get("host_device") or {}
    h2d = copy.get("h2d_gbs") if isinstance(copy, dict) else None
    return {
        "busbw_gbs": busbw,
        "h2d_gbs": h2d,
        "source": f"{path}: all_reduce busbw at {best['bytes']:,} bytes over {data.get('world_size')} ranks "
        f"({data.get('backend')})",
    }
