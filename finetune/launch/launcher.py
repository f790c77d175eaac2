"""What started this process, and which accelerate config file (if any) it read. A DDP or one-device
config gives the processes the same environment as a plain launch, so only the launcher's own
command line tells them apart: the parent process's argv, read with psutil and parsed with
accelerate's own parser (docs/preflight.md "How a config file is seen", and what it cannot see).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

# `accelerate launch`'s spellings: the console scripts and their modules.
_LAUNCH_MODULES = {"accelerate.commands.launch": 0, "accelerate.commands.accelerate_cli": 1}


@dataclass(frozen=True)
class Launcher:
    kind: str  # accelerate launch | torchrun | python | finetune train | unknown
    config_file: str | None = None  # the accelerate config it read (absolute when it was relative)
    config_from: str | None = None  # --config_file | default config | finetune train
    num_processes: int | None = None  # `--num_processes N` given on its command line
    cpu: bool = False  # `--cpu` given
    note: str | None = None  # why the parent could not be read, or was not this script's launcher
    num_machines: int | None = None  # `--num_machines N` given on its command line (finetune/launch/nodes.py)
    machine_rank: int | None = None  # `--machine_rank K` given on its command line

    def describe(self) -> str:
        """The launch, as problems and the record name it."""
        if self.config_from == "default config":
            return (
                f"your accelerate default config {self.config_file} (read by every `accelerate launch` "
                f"without --config_file or --cpu)"
            )
        if self.config_from == "finetune train":
            return f"accelerate config {self.config_file}"
        if self.config_file:
            return f"the accelerate config {self.config_file} (accelerate launch --config_file)"
        if self.kind == "accelerate launch":
            return "accelerate launch without an accelerate config"
        return self.kind + (f" ({self.note})" if self.note else "")


def launch_args(argv: list[str]) -> list[str] | None:
    """The arguments after `accelerate launch` in a command line, or None when it is no
    `accelerate launch` (`accelerate launch ...`, `accelerate-launch ...`, `python -m
    accelerate.commands.launch ...`, `python -m accelerate.commands.accelerate_cli launch ...`)."""
    for i, arg in enumerate(argv):
        name = os.path.basename(arg)
        if name == "accelerate" and argv[i + 1 : i + 2] == ["launch"]:
            return argv[i + 2 :]
        if name == "accelerate-launch":
            return argv[i + 1 :]
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in _LAUNCH_MODULES:
            skip = _LAUNCH_MODULES[argv[i + 1]]
            if skip and argv[i + 2 : i + 3] != ["launch"]:
                return None
            return argv[i + 2 + skip :]
    return None


def from_parent_argv(
    argv: list[str], cwd: str, *, script: str, main_module: str | None, default_config: str | None, env=os.environ
) -> Launcher:
    """The launcher from its command line (pure: tests give it made-up ones). `script` is this
    process's sys.argv[0], `main_module` its `python -m` module name (or None); `default_config`
    the accelerate default config file if it exists. Kind `python`: no launcher at all (`python
    finetune/train.py` from a shell or a program; no rank variables)."""
    rest = launch_args(argv)
    if rest is None:
        parent = os.path.basename(argv[0]) if argv else "an unnamed process"
        if any(os.path.basename(a) == "torchrun" or a == "torch.distributed.run" for a in argv):
            return Launcher("torchrun")
        if "LOCAL_RANK" in env or "WORLD_SIZE" in env:  # a launcher we do not know (deepspeed, a wrapper...)
            return Launcher("unknown", note=f"started by {parent} with rank variables set")
        return Launcher("python", note=f"no launcher, started by {parent}")
    from accelerate.commands.launch import launch_command_parser

    try:
        parsed = launch_command_parser().parse_args(rest)
    except SystemExit:
        return Launcher("unknown", note="the parent's accelerate launch arguments did not parse")
    if parsed.module:
        same = parsed.training_script == main_module
    else:
        same = _real(parsed.training_script, cwd) == _real(script, os.getcwd())
    if not same:  # the parent launched something else, which started us: its config is not ours to judge
        return Launcher("unknown", note=f"the parent accelerate launch ran {parsed.training_script}, not this script")
    if parsed.config_file:
        config, source = _real(parsed.config_file, cwd), "--config_file"
    elif default_config and not parsed.cpu:
        config, source = default_config, "default config"
    else:
        config, source = None, None
    return Launcher(
        "accelerate launch",
        config,
        source,
        parsed.num_processes,
        bool(parsed.cpu),
        num_machines=parsed.num_machines,
        machine_rank=parsed.machine_rank,
    )


def detect(env=os.environ) -> Launcher:
    """The launcher of this process: `finetune train` by its variable, else from the parent's command line."""
    if env.get("FINETUNE_ACCELERATE_CONFIG"):
        return Launcher("finetune train", env["FINETUNE_ACCELERATE_CONFIG"], "finetune train")
    import psutil
    from accelerate.commands.config.config_args import default_config_file

    try:
        parent = psutil.Process(os.getppid())
        argv, cwd = parent.cmdline(), parent.cwd()
    except (psutil.Error, OSError) as e:
        return Launcher("unknown", note=f"the parent process could not be read: {type(e).__name__}")
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return from_parent_argv(
        argv,
        cwd,
        script=sys.argv[0],
        main_module=getattr(spec, "name", None),
        default_config=default_config_file if os.path.isfile(default_config_file) else None,
        env=env,
    )


def script_form() -> str:
    """How a launch line should name the launch script: `finetune/train.py` from a directory that holds
    it (the repository root), else `-m finetune.train`, which works wherever the package is installed;
    `-m finetune.train` also when this process was started that way."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) != "finetune.train" and Path("finetune/train.py").is_file():
        return "finetune/train.py"
    return "-m finetune.train"


def _real(path: str, cwd: str) -> str:
    return os.path.realpath(Path(cwd) / Path(path).expanduser())
