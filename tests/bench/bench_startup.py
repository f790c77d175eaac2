"""Start-up benchmark (docs/speed.md "Start-up"): seconds from the command to the first step line, and
import times of the commands that do not train, in wall and CPU seconds. Not a test:
`python -m tests.bench.bench_startup --out DIR`.

Each case runs `--repeat` times on the machine as it is; report the median with the machine's load.
The first step line is the progress line `step 1/N` our console prints (finetune/training/trainer.py);
"first step" is therefore the end of optimizer step 1, so one tiny step's compute is included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_STEP = re.compile(r"\bstep 1/\d+")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process and every process below it (and of their children
    already reaped), from the kernel through psutil: on a loaded machine far steadier than wall seconds."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def timed(cmd: list[str], env: dict, cwd: Path, until: re.Pattern | None = None) -> dict:
    """Wall seconds to the first line matching `until` (None: to the exit), and to the exit; CPU seconds
    of the process tree at that line, and of the whole command at its exit."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    first = first_cpu = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if first is None and until is not None and until.search(line):
            first, first_cpu = time.perf_counter() - start, tree_cpu_s(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    total = time.perf_counter() - start
    code = proc.returncode = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"exit {code}: {' '.join(cmd)}\n{''.join(lines[-40:])}")
    return {
        "to_first_step_s": first,
        "total_s": total,
        "cpu_to_first_step_s": first_cpu,
        "cpu_total_s": usage.ru_utime + usage.ru_stime,  # the command and every process it waited for
        "console_lines": lines,
    }


def tiny_model(where: Path) -> Path:
    from transformers import AutoTokenizer

    from finetune.modeling.bundled import ensure_bundled_model, save_tiny_llama

    return save_tiny_llama(where, AutoTokenizer.from_pretrained(ensure_bundled_model()))


def yardstick_rank(work: Path, datasets: bool = True) -> Path:
    """A rank that does only what no run can skip: import the libraries every rank imports (as a rank does, without
    the garbage collector: finetune/errors.py imports_without_gc), join the gloo process group, print a step line.
    Its 2-rank launch is the floor under a DDP launch's start-up that our code can reach. Without `datasets`, that
    package is kept out (as finetune/training/rank_imports.py keeps others out), so the Trainer does not import it."""
    script = work / f"yardstick_rank{'' if datasets else '_without_datasets'}.py"
    script.write_text(
        ("" if datasets else "import sys\nsys.modules['datasets'] = None\n") + "import gc\n"
        "gc.disable()\n"
        "import torch, torch.distributed as dist, transformers.trainer, peft, accelerate\n"
        "gc.freeze()\n"
        "gc.enable()\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "print('step 1/1', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    return script


def train_cases(model: Path, work: Path) -> dict[str, list[str]]:
    common = [
        f"--model.name_or_path={model}",
        "--data.demo_train_size=64",
        "--eval.exact_match=false",
        "--training.max_steps=2",
        "--training.logging_steps=1",
        "--overwrite",
    ]
    py = sys.executable
    return {
        "single (demo recipe, 1 process)": [
            py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no",
            str(REPO / "finetune/train.py"), "--recipe", "demo", *common, f"--run.output_dir={work}/single",
        ],
        "ddp (2 ranks, gloo)": [
            py, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/cpu/ddp.yaml"),
            str(REPO / "finetune/train.py"), "--recipe", "ddp", *common, f"--run.output_dir={work}/ddp",
        ],
        "finetune train demo (1 process)": [
            py, "-m", "finetune.cli", "train", "--recipe", "demo", *common, f"--run.output_dir={work}/ft_single",
        ],
        "finetune train ddp --cpu (2 ranks)": [
            py, "-m", "finetune.cli", "train", "--recipe", "ddp", "--cpu", *common, f"--run.output_dir={work}/ft_ddp",
        ],
        "ddp yardstick (2 ranks, gloo: the imports and a process group, no run)": [
            py, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/cpu/ddp.yaml"),
            str(yardstick_rank(work)),
        ],
        "ddp yardstick without datasets (2 ranks, gloo)": [
            py, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/cpu/ddp.yaml"),
            str(yardstick_rank(work, datasets=False)),
        ],
        "zero2 (2 ranks, gloo)": [
            py, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/cpu/zero2.yaml"),
            str(REPO / "finetune/train.py"), "--recipe", "zero2", *common, f"--run.output_dir={work}/zero2",
        ],
    }  # fmt: skip


COMMANDS = {
    "--help": ["--help"],
    "recipes": ["recipes"],
    "plan (README)": ["plan", "--recipe", "zero2", "--model", "Llama-3.1-8B", "--gpus", "2", "--gpu-memory", "24GiB"],
    "doctor --quick": ["doctor", "--quick"],
}
IMPORTS = {"import torch, transformers.trainer, peft": "import torch, transformers.trainer, peft"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated case names (substring match)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "FINETUNE_CPU_DISTRIBUTED": "1"}
    results = {"load_before": os.getloadavg(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = {name: ([sys.executable, "-c", code], None) for name, code in IMPORTS.items()}
        cases |= {f"finetune {n}": ([sys.executable, "-m", "finetune.cli", *a], None) for n, a in COMMANDS.items()}
        if not args.only or any(k in args.only for k in ("single", "ddp", "zero2")):
            model = tiny_model(work / "tiny")
            cases |= {name: (cmd, FIRST_STEP) for name, cmd in train_cases(model, work).items()}
        wanted = [w for w in args.only.split(",") if w]
        for name, (cmd, until) in cases.items():
            if wanted and not any(w in name for w in wanted):
                continue
            runs = [timed(cmd, env, REPO, until) for _ in range(args.repeat)]
            key, cpu_key = ("to_first_step_s", "cpu_to_first_step_s") if until else ("total_s", "cpu_total_s")
            values, cpus = [r[key] for r in runs], [r[cpu_key] for r in runs]
            results["cases"][name] = {
                "measure": key,
                "median_s": round(statistics.median(values), 2),
                "runs_s": [round(v, 2) for v in values],
                "cpu_median_s": round(statistics.median(cpus), 2),
                "cpu_runs_s": [round(v, 2) for v in cpus],
                "console_lines_last_run": runs[-1]["console_lines"],
            }
            median, cpu = statistics.median(values), statistics.median(cpus)
            print(f"{name:45s} {key:16s} median {median:6.2f} s, CPU {cpu:6.2f} s  {values}", flush=True)
    results["load_after"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
