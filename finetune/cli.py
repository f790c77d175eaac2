"""The `finetune` command.

    finetune train --recipe demo [--config_file F] [--num_processes N] [--section.key=value ...]
    finetune prepare-model
    finetune recipes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from finetune.cli_support import TRAIN_EPILOG, exit_on_user_error
from finetune.errors import UserError

PACKAGE_DIR = Path(__file__).resolve().parent
TRAIN_SCRIPT = PACKAGE_DIR / "train.py"


def launch_command(recipe: str, rest: list[str], config_file: str | None, num_processes: int | None,
                   extra_launch_args: list[str] = ()) -> list[str]:
    """The `accelerate launch` arguments for a recipe: its accelerate config unless one is given."""
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
        cmd += ["--config_file", str(path)]
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    cmd += list(extra_launch_args)
    return cmd + [str(TRAIN_SCRIPT), "--recipe", recipe, *rest]


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
    train.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even where a GPU exists")
    train.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    sub.add_parser("prepare-model", help="fetch and convert the bundled default model (once)")
    sub.add_parser("recipes", help="list the shipped recipes")
    args, rest = parser.parse_known_args(argv)

    if args.command == "train":
        extra = ["--cpu"] if args.cpu else []
        if args.overwrite:
            rest = [*rest, "--overwrite"]
        launch_args = launch_command(args.recipe, rest, args.config_file, args.num_processes, extra)
        print("+ accelerate launch " + " ".join(launch_args), flush=True)
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
