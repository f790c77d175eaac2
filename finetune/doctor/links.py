"""The links section: `finetune bench-comm` over this machine's processes (NCCL over the GPUs, or
gloo over 2 CPU processes), each op's bus bandwidth beside the link's expected figure (devices.py).

The figures are shown, not judged: what fraction of NCCL's link figure a collective reaches at these
sizes has not been measured on a GPU for this project, so no threshold is derived. A launch that
fails, or collectives that return wrong values (bench-comm checks them), are problems.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.doctor import commands, lines
from finetune.doctor.devices import Devices
from finetune.planning.bench_comm import DEFAULT_SIZES

S = "links"
TIMEOUT_S = 300


def command(dev: Devices, out: Path) -> list[str] | str:
    """The bench-comm command for this machine, or why there is none."""
    if dev.world_size < 2:
        return f"{dev.world_size} GPU: collectives need 2 or more"
    cpu = [] if dev.cuda_available else ["--cpu"]
    return commands.finetune_command(
        "bench-comm", *cpu, "--num_processes", str(dev.world_size), "--sizes", *DEFAULT_SIZES, "--out", str(out)
    )


def check(dev: Devices, out_dir: Path) -> tuple[list[lines.Line], dict | None]:
    """(lines, the bench-comm report) after running it."""
    result_file = out_dir / "comm.json"
    cmd = command(dev, result_file)
    if isinstance(cmd, str):
        return [lines.skipped(S, "collectives", cmd)], None
    result_file.unlink(missing_ok=True)
    print(f"[doctor] links: {commands.shown(cmd)}", flush=True)
    done = commands.run(cmd, out_dir / "logs" / "bench-comm.log", TIMEOUT_S)
    if done.returncode != 0 or not result_file.is_file():
        return [
            lines.problem(
                S,
                "collectives",
                f"`{done.shown()}` failed (exit {done.returncode}): {done.error_line()}",
                f"run it alone and read {done.log}; on GPUs add NCCL_DEBUG=INFO to see NCCL's reason",
                log=str(done.log),
            )
        ], None
    report = json.loads(result_file.read_text(encoding="utf-8"))
    return describe(report, dev), report


def describe(report: dict, dev: Devices) -> list[lines.Line]:
    """One line per op: bus bandwidth at each size, and the largest size's share of the link figure."""
    if report["backend"] == "nccl":
        expected, how = dev.expected_busbw()
    else:
        expected, how = None, f"{report['backend']} over host memory: no link figure"
    out = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = sorted((r for r in report["results"] if r["op"] == op), key=lambda r: r["bytes"])
        sizes = ", ".join(f"{_size(r['bytes'])} {r['busbw_gbs']:.2f}" for r in rows)
        largest = rows[-1]["busbw_gbs"]
        versus = (
            f"expected {expected:g} GB/s ({how}): {largest / expected:.0%} at {_size(rows[-1]['bytes'])}"
            if expected
            else f"expected unknown ({how})"
        )
        detail = f"busbw GB/s {sizes}; {versus} ({report['backend']}, {report['world_size']} ranks)"
        data = {
            "busbw_gbs": {str(r["bytes"]): r["busbw_gbs"] for r in rows},
            "expected_gbs": expected,
            "expected_from": how,
        }
        if not report["verified"].get(op):
            out.append(
                lines.problem(
                    S,
                    op,
                    f"{op} returned wrong values on {report['backend']}",
                    "reinstall torch (its collectives are broken here) and rerun `finetune doctor`",
                    **data,
                )
            )
        else:
            out.append(lines.ok(S, op, detail, **data))
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
