"""One recipe under several strategies, one run after another, then the comparison; the runs differ
only in the strategy (docs/compare.md `finetune sweep`).

    finetune sweep --recipe demo --strategies qlora_baseline,ddp,zero2,fsdp [--cpu] [--out DIR] [overrides]
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from finetune import resources, strategies
from finetune.batch import effective_batch
from finetune.errors import UserError

ONE = strategies.one_process()  # its key is no recipe: one process, the recipe's own method
# Keys that make a QLoRA run QLoRA; taken from the baseline strategy recipe.
QLORA_KEYS = ("name", "quant_type", "double_quant", "compute_dtype", "quant_storage")


@dataclass
class PlannedRun:
    strategy: str
    config_file: str  # the accelerate config the recipe names (the CPU variant is chosen by --cpu)
    world_size: int
    per_device: int
    run_dir: Path
    args: list[str]  # overrides passed to `finetune train --recipe R`
    cpu: bool
    recipe: str
    effective: int = 0
    log: Path = field(default=Path())
    added: str | None = None  # why the sweep added this run itself (not in --strategies)

    def command(self) -> list[str]:
        cpu = ["--cpu"] if self.cpu else []
        return [sys.executable, "-m", "finetune.cli", "train", "--recipe", self.recipe, *cpu, *self.args]


def strategy_names() -> list[str]:
    """`single` plus every shipped recipe that names a strategy and its accelerate config."""
    from finetune.config.recipe import RECIPES_DIR, available_recipes, read_recipe_file

    names = [ONE.key]
    for name in available_recipes():
        values = read_recipe_file(RECIPES_DIR / f"{name}.yaml")
        run, method = values.get("run") or {}, values.get("method") or {}
        if run.get("strategy") in (None, "any") or not run.get("accelerate_config"):
            continue
        if run["strategy"] == ONE.name and method.get("name") != "qlora":
            continue  # one process with the recipe's own method: that is `single`
        if any(v != 1 for v in (values.get("parallel") or {}).values()):
            continue  # a mesh recipe (zero3_sp, zero2_tp): the sweep varies the strategy, not the mesh
        names.append(name)
    return names


def _strategy_values(name: str) -> tuple[dict, dict]:
    """(run overrides, method overrides) that define a strategy."""
    from finetune.config.recipe import RECIPES_DIR, read_recipe_file

    if name == ONE.key:
        return {"strategy": ONE.name, "offload": "none", "accelerate_config": ONE.accelerate_config}, {}
    allowed = strategy_names()
    path = RECIPES_DIR / f"{name}.yaml"
    if name not in allowed or not path.is_file():
        raise UserError(f"--strategies: unknown strategy {name!r}; allowed: {', '.join(allowed)}")
    values = read_recipe_file(path)
    run = values["run"]
    run_values = {
        "strategy": run["strategy"],
        "offload": run.get("offload", "any"),
        "accelerate_config": run["accelerate_config"],
    }
    method = values.get("method") or {}
    method_values = {}
    if run["strategy"] == ONE.name and method.get("name") == "qlora":
        method_values = {k: method[k] for k in QLORA_KEYS if k in method}
    return run_values, method_values


def launch_config(config_file: str, cpu: bool) -> Path:
    """The config `finetune train` will launch with (finetune/launch/accelerate.py launch_command's choice)."""
    path = resources.locate(config_file)
    if path is None:
        raise UserError(f"accelerate config {config_file!r} not found")
    return resources.cpu_variant(path) if cpu else path


def processes(config: Path) -> int:
    return int((yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("num_processes", 1) or 1)


def plan(recipe: str, strategies: list[str], overrides: list[str], *, cpu: bool, out: Path) -> list[PlannedRun]:
    """Every run of the sweep, validated (recipe + overrides load) before any of them starts."""
    from finetune.config.recipe import load_recipe

    if not strategies:
        raise UserError(
            f"--strategies: none given; name one or more of {', '.join(strategy_names())}, comma-separated, e.g. "
            "--strategies qlora_baseline,ddp,zero2,fsdp"
        )
    dupes = sorted({s for s in strategies if strategies.count(s) > 1})
    if dupes:
        raise UserError(f"--strategies: {', '.join(dupes)} given more than once")
    for key in ("run.output_dir", "run.name", "run.strategy", "run.offload", "run.accelerate_config"):
        if any(o.startswith(f"--{key}=") or o == f"--{key}" for o in overrides):
            raise UserError(f"--{key}: set by the sweep for each strategy (see `finetune sweep --help`); drop it")
    cfg, _ = load_recipe(recipe, overrides)
    base_world = processes(launch_config(cfg.run.accelerate_config, cpu)) if cfg.run.accelerate_config else 1
    per_device, accum = cfg.training.typed.per_device_train_batch_size, cfg.training.typed.gradient_accumulation_steps
    if per_device == "auto":
        raise UserError(
            "training.per_device_train_batch_size: auto is planned by each run for its own device, and a sweep keeps "
            "one effective batch across strategies: give a number (`finetune plan` suggests one)"
        )
    effective = effective_batch(per_device, accum, base_world)
    reference = _scaling_reference(strategies, cfg.method.name, cpu)
    planned, problems = [], []
    for name in [*reference, *strategies]:
        run_values, method_values = _strategy_values(name)
        config = launch_config(run_values["accelerate_config"], cpu)
        world = processes(config)
        if effective % (world * accum):
            problems.append(
                f"{name}: the recipe's effective batch {effective} ({per_device} per device x {accum} "
                f"accumulation x {base_world} processes) cannot be kept with {world} processes "
                f"x {accum} accumulation; set --training.per_device_train_batch_size / "
                f"--training.gradient_accumulation_steps so that it divides"
            )
            continue
        run_dir = out / name
        extra = [f"--run.{k}={v}" for k, v in run_values.items()]
        extra += [f"--method.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in method_values.items()]
        extra += [
            f"--training.per_device_train_batch_size={effective // (world * accum)}",
            f"--run.output_dir={run_dir}",
            f"--run.name={cfg.recipe}-{name}",
        ]
        load_recipe(recipe, [*overrides, *extra])  # the exact values this run will train with must load
        planned.append(
            PlannedRun(
                name,
                run_values["accelerate_config"],
                world,
                effective // (world * accum),
                run_dir,
                [*overrides, *extra],
                cpu,
                recipe,
                effective,
                out / "logs" / f"{name}.log",
                "the single-device reference for scaling efficiency" if name in reference else None,
            )
        )
    if problems:
        raise UserError(
            "cannot keep the same effective batch across strategies:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return planned


def _scaling_reference(strategies: list[str], method: str, cpu: bool) -> list[str]:
    """[ONE.key] when a multi-process strategy of the recipe's method has no one-process run of that method
    among the strategies to measure its scaling efficiency against (finetune/compare/table.py
    same_method_single), else []: a one-process run already there is the reference."""
    runs = []
    for name in strategies:
        run_values, method_values = _strategy_values(name)
        world = processes(launch_config(run_values["accelerate_config"], cpu))
        runs.append((world, method_values.get("name", method)))
    without = {m for w, m in runs if w > 1} - {m for w, m in runs if w == 1}
    return [ONE.key] if method in without else []


# What stops a sweep: Ctrl-C, `kill`, a closed terminal. Each is relayed once to the run in progress.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Outcome:
    run: PlannedRun
    returncode: int
    error: str | None  # None when the run completed as planned
    stopped_by: int | None = None  # a stop signal the sweep got while this run ran (relayed to it): no run after it


def execute(run: PlannedRun) -> Outcome:
    """Run one strategy to the end, its output to the console and to its log file. The run is started in a session of
    its own, so a terminal's Ctrl-C reaches the sweep alone; a stop signal to the sweep is relayed once to the run's
    `finetune train` (which stops its ranks with a complete checkpoint, docs/faults.md "Signals") and waited for."""
    from finetune.launch import cpu_rehearsal

    run.log.parent.mkdir(parents=True, exist_ok=True)
    env = cpu_rehearsal.without_opt_in()  # each run's `finetune train` sets it from its own config
    env.setdefault("PYTHONUNBUFFERED", "1")
    tail: list[str] = []
    stopped: list[int] = []
    started: list[subprocess.Popen] = []

    def relay(signum, _frame) -> None:
        name = signal.Signals(signum).name
        if stopped:
            print(f"sweep: {name} again: ignored while {run.strategy} stops", flush=True)
            return
        stopped.append(signum)
        for proc in started:
            proc.send_signal(signum)
        print(
            f"\nsweep: {name}: {run.strategy} is told to stop (a run that trained stops with a complete checkpoint); "
            "the sweep starts no other run and compares the runs that ran",
            flush=True,
        )

    previous = {sig: signal.signal(sig, relay) for sig in STOP_SIGNALS}
    try:
        with open(run.log, "w", encoding="utf-8") as log:
            started.append(
                subprocess.Popen(
                    run.command(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                    bufsize=1,
                    start_new_session=True,
                )
            )
            if stopped:  # the signal came while it started
                started[0].send_signal(stopped[0])
            for line in started[0].stdout:
                sys.stdout.write(line)
                log.write(line)
                tail = (tail + [line.rstrip()])[-40:]
            rc = started[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return Outcome(run, rc, _failure(run, rc, tail), stopped[0] if stopped else None)


def _failure(run: PlannedRun, rc: int, tail: list[str]) -> str | None:
    from finetune.telemetry.record import RecordView, load

    record_file = run.run_dir / "run.json"
    record = RecordView(load(record_file)) if record_file.is_file() else None
    error = record.get("summary", "error") if record else None
    if rc != 0:
        if error:
            return f"exit {rc}: {error}"
        errors = [line for line in tail if line.startswith("error:") or "Error" in line]
        return f"exit {rc}: {(errors or [line for line in tail if line] or ['no output'])[-1]} (log: {run.log})"
    if record is None:
        return f"exit 0 but no run record at {record_file}"
    status = record.get("summary", "status")
    if status != "completed":
        return f"status {status}: {error}"
    effective, world = record.get("batch", "effective"), record.get("strategy", "world_size")
    if effective != run.effective or world != run.world_size:
        return (
            f"ran with effective batch {effective} on {world} "
            f"processes, planned {run.effective} on {run.world_size}: not comparable"
        )
    return None


def interrupted_text(outcomes: list[Outcome], planned: list[PlannedRun], signum: int) -> str:
    """What a sweep stopped by a signal says last: where it stopped, which runs completed and how to compare them,
    which are left to run."""
    last = outcomes[-1] if outcomes and outcomes[-1].stopped_by else None
    where = "between two runs"
    if last is not None and not (last.run.run_dir / "run.json").is_file():
        where = f"during {last.run.strategy}, which stopped before it wrote its record (left out; log: {last.run.log})"
    elif last is not None:
        where = f"during {last.run.strategy} ({last.error or 'it completed all the same'})"
    done = [o.run for o in outcomes if o.error is None]
    left = [o.run.strategy for o in outcomes if o.stopped_by and o.error]
    left += [p.strategy for p in planned[len(outcomes) :]]
    lines = [f"sweep: stopped by {signal.Signals(signum).name} {where}; {len(done)} of {len(planned)} run(s) completed"]
    if done:
        lines.append(
            f"  the comparison above includes them; alone: finetune compare {' '.join(str(r.run_dir) for r in done)}"
        )
    if left:
        lines.append(
            f"  left to run: {', '.join(left)} (the same sweep command with --strategies {','.join(left)} and another "
            "--out)"
        )
    return "\n".join(lines)
