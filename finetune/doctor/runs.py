"""The strategy runs: which strategies this machine can run, the `finetune train` line of each, and
running them one after another on one prepared model and data file. Every run trains the same thing
as tests/training/test_strategies.py (docs/doctor.md); the single-process reference accumulates as
many micro-batches as the others have ranks, so every run takes the same sequences per step.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from finetune import batch, strategies
from finetune.doctor.devices import Devices
from finetune.errors import ConfigError, UserError
from finetune.launch import cpu_rehearsal

STEPS = 10
PER_DEVICE = 4
LEARNING_RATE = 1e-3
SEED = 42
RUN_TIMEOUT_S = 600
MODEL_SPEC = {"architecture": "LlamaForCausalLM", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 0}


def rows(offload: bool) -> list[strategies.Strategy]:
    """The launchable rows the doctor runs: without offload, and with --offload the offload rows too."""
    return [s for s in strategies.STRATEGIES if s.launchable and (offload or s.offload == "none")]


def names(offload: bool) -> list[str]:
    return [s.key for s in rows(offload)]


@dataclass
class Planned:
    row: strategies.Strategy
    world: int
    run_dir: Path
    command: list[str]
    overrides: list[str] = field(default_factory=list)  # --override values given for this strategy

    @property
    def name(self) -> str:
        return self.row.key


@dataclass
class Done:
    planned: Planned
    finished: Finished
    record: dict | None  # run.json, when the run wrote one


def sequences_per_step(world: int) -> int:
    """What every run takes per optimizer step: PER_DEVICE on each of `world` ranks, or as many
    accumulated micro-batches in the single-process reference."""
    return batch.effective_batch(PER_DEVICE, 1, world)


def plan(
    dev: Devices,
    out_dir: Path,
    model_dir: Path,
    data_file: Path,
    *,
    offload: bool,
    only: list[str] | None,
    precision: str,
    overrides: dict[str, list[str]],
) -> tuple[list[Planned], dict[str, str]]:
    """(runs in order, the single-process reference first; skipped strategy -> why)."""
    world = dev.world_size
    wanted = selected(only, overrides, offload=offload)
    runs, skipped = [], {}
    for row in rows(True):
        if row.key not in wanted:
            continue
        n = world if row.multi_process else 1
        if row.replicates and n < 2:
            skipped[row.key] = f"DDP needs 2 or more ranks; {n} GPU visible"
            continue
        run_dir = out_dir / "runs" / row.key
        args = [
            *common_args(model_dir, data_file, precision, accumulation=1 if row.multi_process else world),
            f"--run.output_dir={run_dir}",
            f"--run.name=doctor-{row.key}",
            *overrides.get(row.key, []),
        ]
        launch = (["--num_processes", str(n)] if dev.cuda_available else ["--cpu"]) if row.multi_process else []
        cmd = finetune_command("train", "--recipe", row.recipe, *launch, "--overwrite", *args)
        runs.append(Planned(row, n, run_dir, cmd, overrides.get(row.key, [])))
    return runs, skipped


def common_args(model_dir: Path, data_file: Path, precision: str, *, accumulation: int) -> list[str]:
    return [
        f"--model.name_or_path={model_dir}",
        f"--data.path={data_file}",
        "--method.name=lora",
        "--method.lora_dropout=0.0",
        "--eval.exact_match=false",
        f"--training.max_steps={STEPS}",
        "--training.logging_steps=1",
        "--training.warmup_steps=0",
        f"--training.learning_rate={LEARNING_RATE}",
        "--training.lr_scaling=none",
        "--training.max_grad_norm=1.0",
        f"--training.seed={SEED}",
        f"--training.per_device_train_batch_size={PER_DEVICE}",
        f"--training.gradient_accumulation_steps={accumulation}",
        f"--training.precision={precision}",
        "--training.save_strategy=no",
        "--run.save_model=false",
        "--logging.report_to=[]",
    ]


def selected(only: list[str] | None, overrides: dict[str, list[str]], *, offload: bool) -> list[str]:
    """The strategies to run, the single-process reference first; bad names are a UserError."""
    wanted = only or names(offload)
    unknown = sorted(set(wanted) - set(names(True)))
    if unknown:
        raise UserError(f"--strategies: unknown {', '.join(unknown)}; allowed: {', '.join(names(True))}")
    for key in overrides:
        if key not in wanted:
            raise UserError(f"--override {key}:...: {key} is not among the strategies run ({', '.join(wanted)})")
    reference = strategies.one_process().key  # the run every other run is compared with
    return wanted if reference in wanted else [reference, *wanted]


def parse_overrides(values: list[str]) -> dict[str, list[str]]:
    """`--override zero2:training.learning_rate=2e-3` -> {"zero2": ["--training.learning_rate=2e-3"]}."""
    out: dict[str, list[str]] = {}
    for value in values:
        key, sep, setting = value.partition(":")
        if not sep or "=" not in setting or not setting.split("=")[0].count("."):
            raise UserError(
                f"--override {value!r}: expected STRATEGY:section.key=value, e.g. zero2:training.learning_rate=2e-3"
            )
        out.setdefault(key, []).append("--" + setting.removeprefix("--"))
    return out


def check_overrides(overrides: dict[str, list[str]], precision: str) -> None:
    """Each strategy's --override values loaded with its recipe and the doctor's own values, as its run will load
    them: a ConfigError naming the strategy, the key and what is allowed, before anything runs (not when the run
    starts, minutes in)."""
    from finetune.config.recipe import load_recipe

    recipes = {row.key: row.recipe for row in rows(True)}
    doctors = common_args(Path("model"), Path("data.jsonl"), precision, accumulation=1)
    problems = []
    for key, values in overrides.items():
        try:
            load_recipe(recipes[key], [*doctors, *values])
        except ConfigError as e:
            problems += [f"{key} (recipe {recipes[key]}): {problem}" for problem in e.problems]
    if problems:
        raise ConfigError(problems, "--override")


def prepare(out_dir: Path, world: int) -> tuple[Path, Path]:
    """(model directory, data file), written once into out_dir and reused while their spec is unchanged."""
    from finetune.data.demo import generate, write_jsonl

    rows = STEPS * sequences_per_step(world)  # one epoch: every row once
    data_file = out_dir / "data" / f"train-{rows}.jsonl"
    if not data_file.is_file():
        train, _ = generate(rows, 0, seed=0)
        write_jsonl(train, data_file)
    return tiny_model(out_dir / "model"), data_file


def tiny_model(path: Path) -> Path:
    """A random Llama of MODEL_SPEC (finetune/modeling/bundled.py save_tiny_llama) with the bundled model's tokenizer and
    chat template (fetched and converted once per machine by `finetune prepare-model`)."""
    marker = path / "doctor-model.json"
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == MODEL_SPEC:
        return path
    from transformers import AutoTokenizer

    from finetune.modeling.bundled import ensure_bundled_model, is_prepared, save_tiny_llama

    if not is_prepared():
        print(
            "[doctor] preparing the bundled model once for its tokenizer (finetune prepare-model, ~1 min)", flush=True
        )
    spec = {k: v for k, v in MODEL_SPEC.items() if k != "architecture"}
    save_tiny_llama(path, AutoTokenizer.from_pretrained(ensure_bundled_model()), **spec)
    marker.write_text(json.dumps(MODEL_SPEC) + "\n", encoding="utf-8")
    return path


def execute(planned: Planned, out_dir: Path) -> Done:
    print(f"[doctor] {planned.name}: {shown(planned.command)}", flush=True)
    finished = run_command(planned.command, out_dir / "logs" / f"{planned.name}.log", RUN_TIMEOUT_S)
    record_file = planned.run_dir / "run.json"
    record = json.loads(record_file.read_text(encoding="utf-8")) if record_file.is_file() else None
    print(f"[doctor] {planned.name}: exit {finished.returncode} after {finished.seconds:.0f} s", flush=True)
    return Done(planned, finished, record)


# Running `finetune` subcommands (train, bench-comm) as the user would type them, one at a time,
# each in its own process group with its output in a log file and a time limit.
@dataclass
class Finished:
    command: list[str]
    returncode: int  # 124: killed at the time limit
    seconds: float
    log: Path
    tail: list[str]  # the last lines of its output

    def shown(self) -> str:
        return shown(self.command)

    def error_line(self) -> str:
        """The line of the output that says what went wrong, else its last line."""
        for line in reversed(self.tail):
            if line.startswith(("error:", "finetune: rank")) or "Error:" in line:
                return line.strip()
        return next((t.strip() for t in reversed(self.tail) if t.strip()), "no output")


def finetune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "finetune.cli", *args]


def shown(command: list[str]) -> str:
    """A command as the user would type it (`finetune ...` for the finetune CLI)."""
    if command[1:3] == ["-m", "finetune.cli"]:
        return "finetune " + shlex.join(command[3:])
    return shlex.join(command)


def run_command(command: list[str], log: Path, timeout: float, env: dict | None = None) -> Finished:
    """Run to the end (or the time limit, when the whole group is killed); output to `log`.
    The CPU/gloo opt-in is never inherited: `finetune train --cpu` and `bench-comm --cpu` set it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = cpu_rehearsal.without_opt_in()
    full_env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
        except BaseException:  # Ctrl-C: take the launched ranks down with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
    if code == 124:
        tail.append(f"killed after {timeout:.0f} s (the doctor's time limit for this command)")
    return Finished(command, code, time.monotonic() - start, log, tail)
