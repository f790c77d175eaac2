"""The `finetune` command.

finetune train --recipe demo [--config_file F] [--num_processes N] [--section.key=value ...]
finetune prepare-model
finetune recipes
finetune compare RUN_DIR... [--baseline RUN_DIR] [--out DIR] [--gpu-hour-price USD]
finetune sweep --recipe demo --strategies qlora_baseline,ddp,zero2,fsdp [--cpu] [--out DIR] [overrides]
finetune plan --recipe demo [--model ID_OR_DIR] [--gpus N] [--gpu-memory 24GiB] [--bandwidth GB/s|FILE] [--json]
finetune bench-comm [--cpu] [--num_processes N] [--sizes 1MiB 64MiB] [--out FILE.json]
finetune bench [--shape S] [--methods M ...] [...]     (see finetune/bench/main.py)
finetune doctor [--quick] [--offload] [--out DIR] [...]  (see finetune/doctor/main.py)
"""

from __future__ import annotations

import argparse
import os
import sys

from finetune.cli import options
from finetune.errors import exit_on_user_error
from finetune.launch import accelerate as launcher


@launcher.restores_environment
@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    from finetune.console import guard_streams

    guard_streams()  # a vanished console (a killed `| tee`, a closed terminal) must not end a launch
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune causal LMs under any strategy.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="launch finetune/train.py through accelerate launch",
        epilog=options.TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    options.add_recipe(train)
    train.add_argument("--config_file", help="accelerate config (default: the recipe's run.accelerate_config)")
    train.add_argument("--num_processes", type=int, help="override the accelerate config's process count")
    train.add_argument(
        "--cpu",
        action="store_true",
        help="rehearse on CPU: the accelerate_configs/cpu/ variant of the config, 2 processes over gloo",
    )
    options.add_run_options(train)
    sub.add_parser("prepare-model", help="fetch and convert the bundled default model (once)")
    sub.add_parser("recipes", help="list the shipped recipes")
    # compare and sweep (issue 6): their parsers and wiring live in finetune/cli/compare.py
    from finetune.cli import compare

    compare.add_compare_parser(sub)
    compare.add_sweep_parser(sub)
    # Memory/communication planner and collective benchmark (finetune/planning/).
    plan = sub.add_parser(
        "plan",
        help="predict memory and communication per strategy and recommend one",
        allow_abbrev=False,
        epilog="recipe overrides (--section.key=value) apply, e.g. --method.name=full",
    )
    options.add_recipe(plan)
    plan.add_argument("--model", help="local dir, config.json, or hub id with a cached config (default: the recipe's)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpu-memory", default="24GiB", help="memory per GPU (default 24GiB)")
    plan.add_argument("--host-memory", default="64GiB", help="host memory per node (default 64GiB)")
    plan.add_argument("--bandwidth", help="bus bandwidth in GB/s, or the JSON written by `finetune bench-comm --out`")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    bench = sub.add_parser(
        "bench-comm",
        help="measure all-reduce/reduce-scatter/all-gather bandwidth",
        allow_abbrev=False,
        epilog="other options: see `python -m finetune.planning.bench_comm --help`",
    )
    bench.add_argument("--cpu", action="store_true", help="processes on the CPU over gloo")
    bench.add_argument("--num_processes", type=int, default=2, help="processes to launch (default 2)")
    sub.add_parser(
        "bench",
        add_help=False,
        help="this project vs TRL's SFTTrainer (plain and tuned), side by side (finetune bench --help)",
    )
    sub.add_parser(
        "doctor",
        add_help=False,
        help="check this machine: environment, GPU links, every strategy engaged and agreeing (finetune doctor --help)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "sweep":
        return compare.sweep_main(args, rest)
    if args.command == "compare" and not rest:
        return compare.compare_main(args)
    if args.command == "plan":
        from finetune.planning import report

        return report.run(args, rest)
    if args.command == "bench-comm":
        from finetune.launch import cpu_rehearsal
        from finetune.planning import bench_comm

        if args.cpu:
            os.environ[cpu_rehearsal.ENV] = "1"  # NCCL stays off even where a GPU exists
        launch_args = bench_comm.launch_args(rest, cpu=args.cpu, num_processes=args.num_processes)
        print("+ accelerate launch " + " ".join(launch_args), flush=True)
        return launcher.run_accelerate_launch(launch_args)
    if args.command == "doctor":  # finetune/doctor/main.py parses its own options
        from finetune.doctor import main as doctor_main

        return doctor_main.main(rest)
    if args.command == "bench":  # finetune/bench/main.py parses its own options
        from finetune.bench import main as bench_main

        return bench_main.main(rest)

    if args.command == "train":
        from finetune.launch import relay

        with relay.Relay() as signals:  # from here to the ranks' end (finetune/launch/relay.py)
            return _train(args, rest, signals)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "prepare-model":
        from finetune.modeling.bundled import ensure_bundled_model

        print(ensure_bundled_model())
        return 0
    if args.command == "recipes":
        from finetune.config.recipe import available_recipes, find_recipe

        for name in available_recipes():
            first = find_recipe(name).read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
            print(f"{name:20s} {first}")
        return 0
    return 2


def _train(args, rest: list[str], signals) -> int:
    """`finetune train`: the launch line, preflight, then `accelerate launch` (its exit code)."""
    from finetune import preflight
    from finetune.checkpointing import resume_plan
    from finetune.errors import EXIT_PREEMPTED
    from finetune.launch import cpu_rehearsal

    launch_args = launcher.launch_command(
        args.recipe,
        rest,
        args.config_file,
        args.num_processes,
        cpu=args.cpu,
        overwrite=args.overwrite,
        resume=args.resume,
    )
    os.environ.update(launcher.launch_environment(launch_args))  # put back on return (restores_environment)
    # config mistakes and a checkpoint that cannot resume under this launch, all at once, before any process starts
    preflight.check_launch(launch_args, resume_check=resume_plan.preflight_problems)
    if signals.signals:  # signalled during the checks: nothing started yet
        print(f"finetune: stopped before launching; nothing was started (exit {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    env = f"{cpu_rehearsal.ENV}=1 " if os.environ.get(cpu_rehearsal.ENV) == "1" else ""
    print(f"+ {env}accelerate launch " + " ".join(launch_args), flush=True)
    return launcher.run_accelerate_launch(launch_args)
