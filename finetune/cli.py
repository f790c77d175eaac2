"""The `finetune` command.

    finetune train --recipe demo [--config_file F] [--num_processes N] [--section.key=value ...]
    finetune prepare-model
    finetune recipes
    finetune compare RUN_DIR... [--baseline RUN_DIR] [--out DIR] [--gpu-hour-price USD]
    finetune sweep --recipe demo --strategies qlora_baseline,ddp,zero2,fsdp [--cpu] [--out DIR] [overrides]
    finetune plan --recipe demo [--model ID_OR_DIR] [--gpus N] [--gpu-memory 24GiB] [--bandwidth GB/s|FILE] [--json]
    finetune bench-comm [--cpu] [--num_processes N] [--sizes 1MiB 64MiB] [--out FILE.json]
    finetune bench [--shape S] [--methods M ...] [...]     (see finetune/bench.py)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from finetune import resources
from finetune.cli_support import TRAIN_EPILOG
from finetune.errors import EXIT_PREEMPTED, UserError, exit_on_user_error

PACKAGE_DIR = Path(__file__).resolve().parent
TRAIN_SCRIPT = PACKAGE_DIR / "train.py"


def launch_command(recipe: str, rest: list[str], config_file: str | None, num_processes: int | None,
                   cpu: bool = False, overwrite: bool = False, resume: str | None = None) -> list[str]:
    """The `accelerate launch` arguments for a recipe: its accelerate config unless one is given.
    With cpu, a multi-process config is swapped for its accelerate_configs/cpu/ variant (2
    processes over gloo, see finetune/cpu_distributed.py) and a single-process one gets --cpu.
    Pure: the environment those launches need comes from launch_environment()."""
    from finetune.recipe import load_recipe

    cfg, _ = load_recipe(recipe, rest)  # fail here, before any process starts, on a bad recipe
    path = _accelerate_config_path(config_file or cfg.run.accelerate_config, cfg.run.accelerate_config, cpu)
    cmd = []
    if path:
        cmd += ["--config_file", str(path)] + _absolute_deepspeed_config(path)
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    if cpu and not (path and path.parent.name == "cpu"):
        cmd += ["--cpu"]
    resume_args = [] if resume is None else ["--resume"] if resume == "auto" else [f"--resume={resume}"]
    return cmd + [str(TRAIN_SCRIPT), "--recipe", recipe, *(["--overwrite"] if overwrite else []), *resume_args, *rest]


def launch_environment(launch_args: list[str]) -> dict[str, str]:
    """Variables the launched ranks inherit: the CPU/gloo opt-in for an accelerate_configs/cpu/
    config (finetune/cpu_distributed.py) and the config's path (recorded by the run, W&B artifact)."""
    from finetune import cpu_distributed

    if "--config_file" not in launch_args:
        return {}
    path = Path(launch_args[launch_args.index("--config_file") + 1])
    env = {"FINETUNE_ACCELERATE_CONFIG": str(path)}
    if path.parent.name == "cpu":
        env[cpu_distributed.ENV] = "1"
    return env


def _accelerate_config_path(config_file: str | None, recipe_config: str | None, cpu: bool) -> Path | None:
    if not config_file:
        return None
    path = resources.locate(config_file)
    if path is None:
        raise UserError(f"accelerate config {config_file!r} not found (from "
                        f"{'--config_file' if config_file != recipe_config else 'run.accelerate_config'})")
    if cpu:
        path = resources.cpu_variant(path)
    return path.resolve()


def _absolute_deepspeed_config(config: Path) -> list[str]:
    """Configs name their DeepSpeed JSON relative to the resources root (the repository's top
    level); pass it absolute so `finetune train` works from any directory (accelerate's command
    line beats the file)."""
    from finetune.launch_config import read_yaml

    ds = read_yaml(config).get("deepspeed_config") or {}
    ds_file = ds.get("deepspeed_config_file")
    if ds_file and not Path(ds_file).is_absolute() and resources.resolve(ds_file).is_file():
        return ["--deepspeed_config_file", str(resources.resolve(ds_file))]
    return []


def run_accelerate_launch(launch_args: list[str]) -> int:
    """Run `accelerate launch` in this process and return the training script's exit code.
    Accelerate reports a failed child with a traceback of its own launcher; the child has
    already printed the real error, so we pass its exit code on instead (2 = user error)."""
    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser

    parsed = launch_command_parser().parse_args(launch_args)
    # On SIGTERM/SIGINT torchrun's agent forwards the signal to the ranks and SIGKILLs them after
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT s (default 30): give them time to finish the preemption
    # checkpoint (docs/faults.md). A value the user exported wins.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    try:
        accelerate_launch(parsed)
    except subprocess.CalledProcessError as e:  # single-process launches
        return e.returncode
    except Exception as e:  # torchrun's ChildFailedError / SignalException for multi-process launches
        if type(e).__name__ == "SignalException":  # the launcher itself was signalled; the ranks were
            # told to checkpoint and stop
            print(f"finetune: launcher received {e.sigval.name}: preempted (exit {EXIT_PREEMPTED})",
                  file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
        if type(e).__name__ != "ChildFailedError":
            raise
        return _report_failed_ranks(e.failures)
    return 0


def _report_failed_ranks(failures: dict) -> int:
    """Name every rank that failed (first failure first) and return the ranks' common exit code,
    else 1. A rank killed by a signal (exitcode -N) is named with the signal."""
    import signal

    ordered = sorted(failures.items(), key=lambda kv: kv[1].timestamp)
    for i, (rank, f) in enumerate(ordered):
        how = f"killed by {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 else f"exit code {f.exitcode}" + \
            (" (preempted)" if f.exitcode == 75 else "")
        first = " (first failure)" if i == 0 and len(ordered) > 1 else ""
        print(f"finetune: rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed: {how}{first}",
              file=sys.stderr, flush=True)
    codes = {f.exitcode for f in failures.values()}
    # Once one rank exits, torchrun SIGTERMs the ranks still running: those are consequences, so a
    # single real exit code among them is the run's (3 non-finite, 75 preempted, 2 user error),
    # whichever rank happened to exit first.
    real = {c for c in codes if c > 0}
    if len(real) == 1 and codes - real <= {-signal.SIGTERM}:
        code = real.pop()
        if code == EXIT_PREEMPTED:  # the checkpoint's completion marker says it is whole
            print(f"finetune: preempted (exit {EXIT_PREEMPTED}); continue with --resume", file=sys.stderr,
                  flush=True)
        return code
    return 1


def _restores_environment(fn):
    """accelerate launch runs in this process and hands os.environ to the ranks, so launches set
    their variables there (FINETUNE_CPU_DISTRIBUTED, FINETUNE_ACCELERATE_CONFIG, ...). Put the
    environment back afterwards: a caller that runs main() twice (a sweep, a test) must not see
    the first launch's CPU opt-in leak into the second."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        saved = dict(os.environ)
        try:
            return fn(*args, **kwargs)
        finally:
            for key in set(os.environ) - set(saved):
                del os.environ[key]
            os.environ.update(saved)
    return wrapper


@_restores_environment
@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune causal LMs under any strategy.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="launch finetune/train.py through accelerate launch",
                           epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                           allow_abbrev=False)
    train.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    train.add_argument("--config_file", help="accelerate config (default: the recipe's run.accelerate_config)")
    train.add_argument("--num_processes", type=int, help="override the accelerate config's process count")
    train.add_argument("--cpu", action="store_true",
                       help="rehearse on CPU: the accelerate_configs/cpu/ variant of the config, 2 processes over gloo")
    train.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    train.add_argument("--resume", nargs="?", const="auto", metavar="PATH",
                       help="continue the run from its newest complete checkpoint, or from PATH (docs/faults.md)")
    sub.add_parser("prepare-model", help="fetch and convert the bundled default model (once)")
    sub.add_parser("recipes", help="list the shipped recipes")
    # compare and sweep (issue 6): their parsers and wiring live in finetune/compare_cli.py
    from finetune import compare_cli

    compare_cli.add_compare_parser(sub)
    compare_cli.add_sweep_parser(sub)
    # Memory/communication planner and collective benchmark (finetune/plan_report.py, finetune/bench_comm.py).
    plan = sub.add_parser("plan", help="predict memory and communication per strategy and recommend one",
                          allow_abbrev=False, epilog="recipe overrides (--section.key=value) apply, e.g. --method.name=full")
    plan.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    plan.add_argument("--model", help="local dir, config.json, or hub id with a cached config (default: the recipe's)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpu-memory", default="24GiB", help="memory per GPU (default 24GiB)")
    plan.add_argument("--host-memory", default="64GiB", help="host memory per node (default 64GiB)")
    plan.add_argument("--bandwidth", help="bus bandwidth in GB/s, or the JSON written by `finetune bench-comm --out`")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    bench = sub.add_parser("bench-comm", help="measure all-reduce/reduce-scatter/all-gather bandwidth",
                           allow_abbrev=False, epilog="other options: see `python -m finetune.bench_comm --help`")
    bench.add_argument("--cpu", action="store_true", help="processes on the CPU over gloo")
    bench.add_argument("--num_processes", type=int, default=2, help="processes to launch (default 2)")
    sub.add_parser("bench", add_help=False, help="this project vs a plain TRL SFTTrainer script, side by side "
                   "(finetune bench --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "sweep":
        return compare_cli.sweep_main(args, rest)
    if args.command == "compare" and not rest:
        return compare_cli.compare_main(args)
    if args.command == "plan":
        from finetune import plan_report

        return plan_report.run(args, rest)
    if args.command == "bench-comm":
        from finetune import bench_comm, cpu_distributed

        if args.cpu:
            os.environ[cpu_distributed.ENV] = "1"  # NCCL stays off even where a GPU exists
        launch_args = bench_comm.launch_args(rest, cpu=args.cpu, num_processes=args.num_processes)
        print("+ accelerate launch " + " ".join(launch_args), flush=True)
        return run_accelerate_launch(launch_args)
    if args.command == "bench":  # finetune/bench.py parses its own options
        from finetune import bench

        return bench.main(rest)

    if args.command == "train":
        from finetune import cpu_distributed

        launch_args = launch_command(args.recipe, rest, args.config_file, args.num_processes, cpu=args.cpu,
                                     overwrite=args.overwrite, resume=args.resume)
        from finetune import preflight

        os.environ.update(launch_environment(launch_args))  # put back on return (_restores_environment)
        preflight.check_launch(launch_args)  # config mistakes, all at once, before any process starts
        env = f"{cpu_distributed.ENV}=1 " if os.environ.get(cpu_distributed.ENV) == "1" else ""
        print(f"+ {env}accelerate launch " + " ".join(launch_args), flush=True)
        return run_accelerate_launch(launch_args)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "prepare-model":
        from finetune.bundled_model import ensure_bundled_model

        print(ensure_bundled_model())
        return 0
    if args.command == "recipes":
        from finetune.recipe import available_recipes, find_recipe

        for name in available_recipes():
            first = find_recipe(name).read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
            print(f"{name:20s} {first}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
