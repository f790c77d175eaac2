"""`finetune bench-comm`: collective bandwidth over the processes of the current launch (algbw and
busbw as nccl-tests define them: docs/planning.md). Each size is timed as the median of `--iters`
repetitions after `--warmup` untimed ones, all ranks synchronized by a barrier per repetition.

    finetune bench-comm --cpu --num-processes 2 --out comm.json      # gloo, 2 CPU processes
    finetune bench-comm --num-processes 2 --out comm.json            # NCCL over 2 GPUs
    accelerate launch --config_file accelerate_configs/ddp.yaml -m finetune.planning.bench_comm --out comm.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DEFAULT_SIZES = ("64KiB", "1MiB", "16MiB", "64MiB")
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
}


DESCRIPTION = "Collective bandwidth (all-reduce, reduce-scatter, all-gather) over the processes of a launch."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The measurement's options (the `finetune bench-comm` command adds how to launch it)."""
    p.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="buffer sizes (full buffer: the reduced or gathered tensor), e.g. 1MiB 64MiB",
    )
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per op and size (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    p.add_argument("--out", help="write the results as JSON here (for `finetune plan --bandwidth FILE`)")


def parser() -> argparse.ArgumentParser:
    from finetune.config.command_line import Parser

    p = Parser(prog="python -m finetune.planning.bench_comm", description=DESCRIPTION)
    add_arguments(p)
    return p


def parse_sizes(values: list[str], world: int) -> list[int]:
    from finetune.errors import UserError
    from finetune.units import parse_size

    out = []
    for v in values:
        size = int(parse_size(v, "--sizes"))
        size -= size % (4 * world)  # whole fp32 elements, divisible into equal shards
        if size < 4 * world:
            raise UserError(f"--sizes: {v!r} is smaller than one fp32 element per rank ({4 * world} bytes)")
        out.append(size)
    return out


def _collectives(dist):
    """The three ops on flat fp32 tensors. torch 2.13 names the tensor forms *_single; earlier
    versions *_tensor. gloo implements both here (checked with torch 2.13); if a backend lacks one,
    the error propagates: an op is never skipped silently."""
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return {
        "all_reduce": lambda full, shard: dist.all_reduce(full),
        "reduce_scatter": lambda full, shard: rs(shard, full),
        "all_gather": lambda full, shard: ag(full, shard),
    }


def verify(device) -> dict:
    """Each op once on rank-valued data, checked against its definition, so that a wrong buffer
    layout (and hence a wrong bytes count) cannot pass unnoticed."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    ops, m = _collectives(dist), 4  # m elements per rank shard
    full = torch.full((m * world,), float(rank + 1), device=device)
    ops["all_reduce"](full, None)
    ok = {"all_reduce": bool((full == world * (world + 1) / 2).all())}
    full, shard = torch.full((m * world,), float(rank + 1), device=device), torch.empty(m, device=device)
    ops["reduce_scatter"](full, shard)
    ok["reduce_scatter"] = bool((shard == world * (world + 1) / 2).all())
    full, shard = torch.empty(m * world, device=device), torch.full((m,), float(rank), device=device)
    ops["all_gather"](full, shard)
    ok["all_gather"] = bool((full == torch.arange(world, device=device).repeat_interleave(m).float()).all())
    return ok


def measure(sizes: list[int], iters: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    verified = verify(device)
    if not all(verified.values()):
        raise RuntimeError(f"collectives returned wrong results on {dist.get_backend()}: {verified}")
    results = []
    for op, fn in _collectives(dist).items():
        for size in sizes:
            full = torch.ones(size // 4, dtype=torch.float32, device=device)
            shard = torch.ones(size // 4 // world, dtype=torch.float32, device=device)
            times = []
            for i in range(warmup + iters):
                dist.barrier()
                t0 = time.perf_counter()
                fn(full, shard)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            # the slowest rank decides when a collective is done
            t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = t.item()
            algbw = size / seconds / 1e9
            factor = BUS_FACTORS[op](world)
            results.append(
                {
                    "op": op,
                    "bytes": size,
                    "time_s": seconds,
                    "algbw_gbs": algbw,
                    "busbw_gbs": algbw * factor,
                    "bus_factor": factor,
                    "bytes_per_rank": round(size * factor),
                }
            )
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return {
        "world_size": world,
        "rank": rank,
        "backend": dist.get_backend(),
        "results": results,
        "verified": verified,
        "implementation": {
            "all_reduce": "torch.distributed.all_reduce",
            "reduce_scatter": f"torch.distributed.{rs.__name__}",
            "all_gather": f"torch.distributed.{ag.__name__}",
        },
    }


def host_device_copy(size: int = 256 * 2**20, iters: int = 5) -> dict:
    """Pinned host <-> device copy bandwidth (GB/s) on this rank's GPU, or why there is none."""
    import torch

    if not torch.cuda.is_available():
        return {"h2d_gbs": None, "d2h_gbs": None, "note": "no GPU: host<->device copy not measured"}
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d_gbs": (dev, host), "d2h_gbs": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = size * iters / (time.perf_counter() - t0) / 1e9
    return {**out, "bytes": size, "device": torch.cuda.get_device_name(), "note": "pinned memory"}


def render(report: dict) -> str:
    impl = ", ".join(f"{k}: {v} (native, verified)" for k, v in report["implementation"].items())
    lines = [
        f"ops: {impl}",
        f"{report['backend']} over {report['world_size']} ranks (nccl-tests definitions: "
        f"algbw = bytes/time, busbw = algbw x factor)",
        f"{'op':15}{'bytes':>14}{'time ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}{'factor':>8}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['op']:15}{r['bytes']:14,}{1e3 * r['time_s']:10.3f}{r['algbw_gbs']:12.3f}"
            f"{r['busbw_gbs']:12.3f}{r['bus_factor']:8.3f}"
        )
    hd = report["host_device"]
    lines.append(
        f"host->device {hd['h2d_gbs']:.2f} GB/s, device->host {hd['d2h_gbs']:.2f} GB/s ({hd['note']})"
        if hd.get("h2d_gbs")
        else hd["note"]
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from finetune.errors import UserError

    args = parser().parse_args(argv)
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise UserError(
            "bench-comm measures the processes of a launch: run `finetune bench-comm --cpu "
            "--num-processes 2` or `accelerate launch ... -m finetune.planning.bench_comm`"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise UserError(f"bench-comm needs at least 2 processes to measure collectives, the launch has {world}")
    if args.iters < 1 or args.warmup < 0:
        raise UserError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    sizes = parse_sizes(args.sizes, world)
    use_nccl = torch.cuda.is_available() and os.environ.get("FINETUNE_CPU_DISTRIBUTED") != "1"
    if use_nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_nccl else "gloo")
    try:
        report = measure(sizes, args.iters, args.warmup)
        why = "no GPU" if not torch.cuda.is_available() else "CPU launch"
        unmeasured = {"h2d_gbs": None, "d2h_gbs": None, "note": f"{why}: host<->device copy not measured"}
        report["host_device"] = host_device_copy() if use_nccl else unmeasured
        report["sizes_requested"] = args.sizes
        if report["rank"] == 0:
            print(render(report), flush=True)
            if args.out:
                path = Path(args.out)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
                os.replace(tmp, path)
                print(f"wrote {path}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def measurement_args(args) -> list[str]:
    """The measurement's options as the launched module reads them (from `finetune bench-comm`'s parse)."""
    out = ["--sizes", *args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    return out + (["--out", str(Path(args.out).resolve())] if args.out else [])


def launch_args(rest: list[str], *, cpu: bool, num_processes: int) -> list[str]:
    """`accelerate launch` arguments that run this module on num_processes processes:
    the CPU DDP config (gloo) with --cpu, else torchrun-style multi-GPU."""
    from finetune import resources, strategies
    from finetune.errors import UserError

    if num_processes < 2:
        raise UserError(f"--num-processes: bench-comm needs at least 2 processes, got {num_processes}")
    args = parser().parse_args(rest)  # bad options fail here, before any process starts
    parse_sizes(args.sizes, num_processes)
    if cpu:
        ddp = next(s for s in strategies.STRATEGIES if s.replicates)  # its CPU variant: 2 processes over gloo
        cmd = ["--config_file", str(resources.resolve(ddp.cpu_config))]
    else:
        cmd = ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return cmd + ["--num_processes", str(num_processes), "-m", "finetune.planning.bench_comm", *rest]


if __name__ == "__main__":
    from finetune.errors import exit_on_user_error

    sys.exit(exit_on_user_error(main)())
