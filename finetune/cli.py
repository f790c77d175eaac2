"""The `finetune` command.

    finetune train --recipe demo [--config_file F] [--num_processes N] [--section.key=value ...]
    finetune prepare-model
    finetune recipes
    finetune bench [--shape S] [--methods M ...] [...]     (see finetune/bench.py)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from finetune.cli_support import TRAIN_EPILOG, exit_on_user_error
from finetune.errors import UserError

PACKAGE_DIR = Path(__file__).resolve().parent
TRAIN_SCRIPT = PACKAGE_DIR / "train.py"


def launch_command(recipe: str, rest: list[str], config_file: str | None, num_processes: int | None,
                   cpu: bool = False, overwrite: bool = False) -> list[str]:
    """The `accelerate launch` arguments for a recipe: its accelerate config unless one is given.
    With cpu, a multi-process config is swapped for its accelerate_configs/cpu/ variant (2
    processes over gloo, see finetune/cpu_distributed.py) and a single-process one gets --cpu."""
    from finetune import cpu_distributed
    from finetune.recipe import REPO_ROOT, load_recipe

    cfg, _ = load_recipe(recipe, rest)  # fail here, before any process starts, on a bad recipe
    config_file = config_file or cfg.run.accelerate_config
    cmd = []
    if config_file:
        path = Path(config_file)
        if not path.is_file() and (REPO_ROOT / path).is_file():
            path = REPO_ROOT / path
        if not path.is_file():
            raise UserError(f"accelerate config {config_file!r} not found (from "
                            f"{'--config_file' if config_file != cfg.run.accelerate_config else 'run.accelerate_config'})")
        if cpu and (REPO_ROOT / "accelerate_configs" / "cpu" / path.name).is_file() and path.parent.name != "cpu":
            path = REPO_ROOT / "accelerate_configs" / "cpu" / path.name
        if cpu and path.parent.name == "cpu":
            os.environ[cpu_distributed.ENV] = "1"  # inherited by the launched processes
        cmd += ["--config_file", str(path.resolve())]
        os.environ["FINETUNE_ACCELERATE_CONFIG"] = str(path.resolve())  # recorded by the run (W&B artifact)
        cmd += _absolute_deepspeed_config(path, REPO_ROOT)
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    if cpu and os.environ.get(cpu_distributed.ENV) != "1":
        cmd += ["--cpu"]
    return cmd + [str(TRAIN_SCRIPT), "--recipe", recipe, *(["--overwrite"] if overwrite else []), *rest]


def _absolute_deepspeed_config(config: Path, repo_root: Path) -> list[str]:
    """Configs name their DeepSpeed JSON relative to the repo root; pass it absolute so
    `finetune train` works from any directory (accelerate's command line beats the file)."""
    import yaml

    ds = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("deepspeed_config") or {}
    ds_file = ds.get("deepspeed_config_file")
    if ds_file and not Path(ds_file).is_absolute() and (repo_root / ds_file).is_file():
        return ["--deepspeed_config_file", str(repo_root / ds_file)]
    return []


def run_accelerate_launch(launch_args: list[str]) -> int:
    """Run `accelerate launch` in this process and return the training script's exit code.
    Accelerate reports a failed child with a traceback of its own launcher; the child has
    already printed the real error, so we pass its exit code on instead (2 = user error)."""
    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser

    parsed = launch_command_parser().parse_args(launch_args)
    try:
        accelerate_launch(parsed)
    except subprocess.CalledProcessError as e:  # single-process launches
        return e.returncode
    except Exception as e:  # torchrun's ChildFailedError for multi-process launches
        if type(e).__name__ != "ChildFailedError":
            raise
        codes = {f.exitcode for f in e.failures.values()}
        return codes.pop() if len(codes) == 1 else 1
    return 0


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
    sub.add_parser("prepare-model", help="fetch and convert the bundled default model (once)")
    sub.add_parser("recipes", help="list the shipped recipes")
    sub.add_parser("bench", add_help=False, help="this project vs a plain TRL SFTTrainer script, side by side "
                   "(finetune bench --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":  # finetune/bench.py parses its own options
        from finetune import bench

        return bench.main(rest)

    if args.command == "train":
        from finetune import cpu_distributed

        launch_args = launch_command(args.recipe, rest, args.config_file, args.num_processes, cpu=args.cpu,
                                     overwrite=args.overwrite)
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
