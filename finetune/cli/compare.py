"""`finetune compare` and `finetune sweep`: argument parsing and wiring (the work: finetune/compare/)."""

from __future__ import annotations

import shlex
import signal
from datetime import datetime
from pathlib import Path

from finetune import storage
from finetune.config import command_line
from finetune.errors import UserError

COMPARE_HELP = "compare run records side by side against the single-device QLoRA baseline"
SWEEP_HELP = "run one recipe under several strategies one after another, then compare them"


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help=COMPARE_HELP, description=COMPARE_HELP + " (see docs/compare.md)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each holding run.json)")
    p.add_argument(
        "--baseline",
        metavar="RUN_DIR",
        help="the run to compare against (one of the RUN_DIRs; default: the single-device QLoRA run)",
    )
    _common(p)


def add_sweep_parser(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help=SWEEP_HELP,
        description=SWEEP_HELP + " (see docs/compare.md). Extra --section.key=value overrides apply to every run. "
        "Every row gets a scaling efficiency: a multi-process strategy whose method has no single-device run "
        "among the strategies gets one (`single`, or `qlora_baseline` for QLoRA) added and run first.",
    )
    command_line.add_recipe(p, "the recipe every strategy runs (model, data, hyperparameters)")
    p.add_argument(
        "--strategies",
        required=True,
        help="comma-separated: single or strategy recipe names, e.g. qlora_baseline,ddp,zero2,fsdp",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="use the accelerate_configs/cpu/ variants (automatic when CUDA is not available)",
    )
    p.add_argument(
        "--baseline-strategy",
        "--baseline",
        metavar="STRATEGY",
        help="the strategy whose run the others are compared against (one of --strategies; default: the "
        "single-device QLoRA run). --baseline is its old name",
    )
    _common(p)


def _common(p) -> None:
    p.add_argument("--out", metavar="DIR", help="where the report goes (must not exist or be empty)")
    p.add_argument(
        "--gpu-hour-price",
        type=float,
        metavar="USD",
        help="price of one device for one hour, for the cost per 1M trained tokens",
    )


def _fresh_dir(out: str | None, default: Path) -> Path:
    path = Path(out) if out else default
    if path.is_dir() and any(path.iterdir()):
        raise UserError(f"--out {path}: exists and is not empty; nothing was changed. Choose another directory.")
    return path


def report(
    runs, *, baseline, out_dir: Path, price, left_out: list[str] = (), warnings: list[str] = ()
) -> tuple[int, object]:
    """Table, plots, Markdown + HTML, W&B; prints the table. `left_out`: the runs that could not be
    read, with why; `warnings`: more to say (both among the warnings). Returns (0, table)."""
    from finetune.compare import plots
    from finetune.compare import report as report_lib
    from finetune.compare.table import build_table

    table = build_table(runs, baseline=baseline, gpu_hour_price=price)
    table.warnings += [f"left out (unreadable): {problem}" for problem in left_out] + list(warnings)
    storage.make_directory(out_dir)
    pngs = plots.write_plots(table, out_dir)
    files = report_lib.write_reports(table, pngs, out_dir)
    print(report_lib.console_table(table), flush=True)
    for line in report_lib.log_comparison(table, pngs, out_dir):
        print(line, flush=True)
    print(f"report: {files['markdown']}\n        {files['html']} (self-contained, plots embedded)", flush=True)
    print("plots:  " + "\n        ".join(str(p) for p in pngs.values()), flush=True)
    return 0, table


def compare_main(args) -> int:
    """Every readable run compared; an unreadable one is named with its problem (a warning while two
    runs remain to compare, else exit 2 with every problem, before anything is written)."""
    import sys

    from finetune.compare import table as comparison

    runs, problems = comparison.read_runs(args.run_dirs)
    if problems and len(runs) < 2:
        raise comparison.CompareInputError(
            [*problems, f"{len(runs)} readable run(s) of {len(args.run_dirs)}: a comparison needs at least two"]
        )
    for problem in problems:
        print(f"warning: left out of the comparison: {problem}", file=sys.stderr, flush=True)
    same = comparison.same_runs(runs)
    for warning in same:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    out = _fresh_dir(args.out, Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    comparison.pick_baseline(runs, args.baseline)  # a bad --baseline fails before the directory is made
    code, _ = report(
        runs, baseline=args.baseline, out_dir=out, price=args.gpu_hour_price, left_out=problems, warnings=same
    )
    return code


def sweep_main(args, overrides: list[str]) -> int:
    from finetune.compare import sweep

    cpu = args.cpu
    if not cpu:
        import torch

        cpu = not torch.cuda.is_available()
        if cpu:
            print("no CUDA device: using the CPU variants of the accelerate configs (accelerate_configs/cpu/)")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    out = _fresh_dir(
        args.out, Path("runs") / f"sweep-{Path(args.recipe).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    planned = sweep.plan(args.recipe, names, overrides, cpu=cpu, out=out)
    baseline = args.baseline_strategy
    if baseline is not None:  # in a sweep the baseline is one of its strategies
        if baseline not in names:
            raise UserError(f"--baseline-strategy {baseline}: name one of the strategies ({', '.join(names)})")
        baseline = out / baseline
    storage.make_directory(out)  # before any run: a folder that cannot be made is said now, not after the runs
    print(f"sweep of {args.recipe}: {len(planned)} runs, effective batch {planned[0].effective} each, into {out}")
    for p in planned:
        print(
            f"  {p.strategy:16s} {p.world_size} process(es) x {p.per_device} per device | {shlex.join(p.command()[2:])}"
            + (f"\n  {'':16s} (added: {p.added})" if p.added else "")
        )
    return run_sweep(planned, out=out, baseline=baseline, price=args.gpu_hour_price)


def run_sweep(planned, *, out: Path, baseline, price) -> int:
    """Each planned run in turn (a failure does not stop the others), then the comparison.
    Exit code 1 when any run failed; 128 + the signal's number when a stop signal stopped the sweep (130 for Ctrl-C:
    the run in progress is stopped, no other run starts, the runs that ran are compared)."""
    from finetune.compare import sweep

    outcomes, stopped_by = [], None
    try:
        for i, p in enumerate(planned, 1):
            print(f"\n=== [{i}/{len(planned)}] {p.strategy} ===", flush=True)
            outcomes.append(sweep.execute(p))
            stopped_by = outcomes[-1].stopped_by
            if stopped_by:
                print(f"=== {p.strategy} STOPPED: {outcomes[-1].error or 'completed all the same'}", flush=True)
                break
            if outcomes[-1].error:
                print(f"=== {p.strategy} FAILED: {outcomes[-1].error}", flush=True)
    except KeyboardInterrupt:  # between two runs: the one before it had ended
        stopped_by = signal.SIGINT
    # a run stopped before it wrote its record has nothing to compare (interrupted_text names it)
    compared = [o for o in outcomes if not o.stopped_by or (o.run.run_dir / "run.json").is_file()]
    if compared:
        print("\n=== comparison ===", flush=True)
        ran = {o.run.run_dir for o in compared}
        baseline = baseline if baseline is None or baseline in ran else None  # a baseline not run: the default
        report([_compared(o) for o in compared], baseline=baseline, out_dir=out / "report", price=price)
    if stopped_by:
        print(sweep.interrupted_text(outcomes, planned, stopped_by), flush=True)
        return 128 + stopped_by
    failed = [o.run.strategy for o in outcomes if o.error]
    if failed:
        print(f"sweep: {len(failed)} of {len(outcomes)} runs failed: {', '.join(failed)}", flush=True)
        return 1
    return 0


def _compared(outcome):
    """A sweep run as `compare` reads it; a run that failed carries its error (in memory: the record is the run's)."""
    from finetune.compare import table as comparison

    record = outcome.run.run_dir / "run.json"
    label = f"{Path(outcome.run.recipe).stem}-{outcome.run.strategy}"
    if not record.is_file():
        return comparison.Run(record, None, label, error=outcome.error)
    try:
        (run,) = comparison.load_runs([record])
    except comparison.CompareInputError as e:
        run = comparison.Run(record, None, label, error=str(e))
    if outcome.error and run.record is not None:  # not completed as planned: the error with the exit code
        run.view.set_outcome("failed" if run.status == "completed" else run.get("summary", "status"), outcome.error)
    return run
