"""`accelerate launch` from `finetune train`: the launch line for a recipe, the environment the
ranks inherit, running it in this process, and the report of the ranks that failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from finetune import held_back, resources
from finetune.errors import EXIT_PREEMPTED, UserError

TRAIN_SCRIPT = resources.PACKAGE_DIR / "train.py"  # the launch script (finetune/train.py)


def launch_command(
    recipe: str,
    rest: list[str],
    config_file: str | None,
    num_processes: int | None,
    cpu: bool = False,
    overwrite: bool = False,
    resume: str | None = None,
    allow_config_change: bool = False,
    cfg=None,
    allow_input_change: bool = False,
    problems: list[str] | None = None,
) -> list[str]:
    """The `accelerate launch` arguments for a recipe: its accelerate config unless one is given. With cpu, a
    multi-process config is swapped for its accelerate_configs/cpu/ variant (2 processes over gloo, see
    finetune/launch/cpu_rehearsal.py) and a single-process one gets --cpu. Pure: the environment those launches need
    comes from launch_environment(). `cfg`: the recipe as loaded already; `problems`: a list to add an accelerate config
    that is not found to (for preflight to report with the rest) instead of raising."""
    from finetune.config.recipe import load_recipe

    cfg = cfg or load_recipe(recipe, rest)[0]  # fail here, before any process starts, on a bad recipe
    try:
        path = _accelerate_config_path(config_file or cfg.run.accelerate_config, cfg.run.accelerate_config, cpu)
    except UserError as e:
        if problems is None:
            raise
        problems.append(str(e))
        path = None
    cmd = []
    if path:
        cmd += ["--config_file", str(path)] + _absolute_deepspeed_config(path)
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    if cpu and not (path and path.parent.name == "cpu"):
        cmd += ["--cpu"]
    resume_args = [] if resume is None else ["--resume"] if resume == "auto" else [f"--resume={resume}"]
    resume_args += ["--allow-config-change"] if allow_config_change else []
    resume_args += ["--allow-input-change"] if allow_input_change else []
    return cmd + [str(TRAIN_SCRIPT), "--recipe", recipe, *(["--overwrite"] if overwrite else []), *resume_args, *rest]


def launch_environment(launch_args: list[str]) -> dict[str, str]:
    """Variables the launched ranks inherit: the CPU/gloo opt-in for an accelerate_configs/cpu/
    config (finetune/launch/cpu_rehearsal.py) and the config's path (recorded by the run, W&B artifact)."""
    from finetune.launch import cpu_rehearsal

    if "--config_file" not in launch_args:
        return {}
    path = Path(launch_args[launch_args.index("--config_file") + 1])
    env = {"FINETUNE_ACCELERATE_CONFIG": str(path)}
    if path.parent.name == "cpu":
        env[cpu_rehearsal.ENV] = "1"
    return env


def _accelerate_config_path(config_file: str | None, recipe_config: str | None, cpu: bool) -> Path | None:
    if not config_file:
        return None
    path = resources.locate(config_file)
    if path is None:
        raise UserError(
            f"accelerate config {config_file!r} not found (from "
            f"{'--config_file' if config_file != recipe_config else 'run.accelerate_config'})"
        )
    if cpu:
        path = resources.cpu_variant(path)
    return path.resolve()


def _absolute_deepspeed_config(config: Path) -> list[str]:
    """Configs name their DeepSpeed JSON relative to the resources root (the repository's top level); pass it absolute
    so `finetune train` works from any directory (accelerate's command line beats the file)."""
    from finetune.launch.configs import read_yaml

    ds = read_yaml(config).get("deepspeed_config") or {}
    ds_file = ds.get("deepspeed_config_file")
    if ds_file and not Path(ds_file).is_absolute() and resources.resolve(ds_file).is_file():
        return ["--deepspeed_config_file", str(resources.resolve(ds_file))]
    return []


def run_accelerate_launch(launch_args: list[str]) -> int:
    """Run `accelerate launch` in this process and return the training script's exit code. Accelerate reports a failed
    child with a traceback of its own launcher; the child has already printed the real error, so we pass its exit code
    on instead (2 = user error). Under `finetune train` (a relay installed, finetune/launch/relay.py) the one-process
    launch runs its process in its own session, as torchrun does for many."""
    import accelerate.commands.launch as accelerate_launch

    from finetune.launch import relay

    parsed = accelerate_launch.launch_command_parser().parse_args(launch_args)
    held_back.install_launcher()
    # torchrun SIGKILLs the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT s (default 30) after it stops
    # them: give them time to finish a checkpoint (docs/faults.md). A value the user exported wins.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    simple = accelerate_launch.simple_launcher
    if os.environ.get(relay.ENV):
        accelerate_launch.simple_launcher = relay.one_process_launcher
        parsed.signals_to_handle = relay.TORCHRUN_SIGNALS
    try:
        accelerate_launch.launch_command(parsed)
    except subprocess.CalledProcessError as e:  # single-process launches
        if e.returncode >= 0:
            return e.returncode
        import signal  # killed by a signal (-N): named, exit 1, as report_failed_ranks says a rank of many

        _say(f"rank 0 (the one process) failed: killed by {signal.Signals(-e.returncode).name}")
        return 1
    except Exception as e:  # torchrun's ChildFailedError / SignalException for multi-process launches
        if type(e).__name__ == "SignalException":  # the launcher itself was signalled (no relay: bench-comm);
            # torchrun told the ranks to stop
            _say(f"launcher received {e.sigval.name}: preempted (exit {EXIT_PREEMPTED})")
            return EXIT_PREEMPTED
        if type(e).__name__ != "ChildFailedError":
            raise
        return report_failed_ranks(e.failures)
    finally:
        accelerate_launch.simple_launcher = simple
    return 0


def report_failed_ranks(failures: dict, beats: dict | None = None) -> int:
    """Name every rank that failed and return the ranks' common exit code, else 1. A rank that stopped making progress
    (its heartbeats ended long before the others failed: finetune/launch/ peers.py) is named first, as the cause;
    otherwise the first failure is. A rank killed by a signal (exitcode -N) is named with the signal. A preempted launch
    (every rank 75, or stopped by torchrun after one did) is no failure: rank 0 has printed the checkpoint and the
    resume command, so nothing more is said."""
    import signal

    from finetune.launch import peers

    codes = {f.exitcode for f in failures.values()}
    # Once one rank exits, torchrun SIGTERMs the ranks still running: those are consequences, so a single real exit code
    # among them is the run's (3 non-finite, 75 preempted, 2 user error), whichever rank happened to exit first.
    real = {c for c in codes if c > 0}
    consequences_only = len(real) == 1 and codes - real <= {-signal.SIGTERM}
    if consequences_only and real == {EXIT_PREEMPTED}:
        return EXIT_PREEMPTED
    stalled = peers.stalled(
        peers.read_progress() if beats is None else beats, {r: f.timestamp for r, f in failures.items()}
    )
    for rank, why in sorted(stalled.items()):
        _say(f"rank {rank} {why}")
    ordered = sorted(failures.items(), key=lambda kv: (kv[0] not in stalled, kv[1].timestamp))
    for i, (rank, f) in enumerate(ordered):
        how = (
            f"killed by {signal.Signals(-f.exitcode).name}"
            if f.exitcode < 0
            else f"exit code {f.exitcode}" + (" (preempted)" if f.exitcode == EXIT_PREEMPTED else "")
        )
        if rank in stalled:
            note = " (stalled: the cause)"
        elif stalled:
            note = f" (a consequence: it waited for rank(s) {sorted(stalled)})"
        else:
            note = " (first failure)" if i == 0 and len(ordered) > 1 else ""
        _say(f"rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed: {how}{note}")
    return real.pop() if consequences_only else 1


def _say(text: str) -> None:
    print(f"finetune: {text}", file=sys.stderr, flush=True)


def restores_environment(fn):
    """accelerate launch runs in this process and hands os.environ to the ranks, so launches set their variables there
    (FINETUNE_CPU_DISTRIBUTED, FINETUNE_ACCELERATE_CONFIG, ...). Put the environment back afterwards: a caller that runs
    main() twice (a sweep, a test) must not see the first launch's CPU opt-in leak into the second."""
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
