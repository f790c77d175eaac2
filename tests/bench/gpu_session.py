"""One prepared GPU session (issue 47 item 4): the speed and memory figures users train at, in about 10 minutes
of one H100/H200, from one command. Not a test: `python -m tests.bench.gpu_session --out DIR [--tiny]`.

What it runs, in order, each under its own time limit (a step that fails or runs out is recorded with its
reason and the session goes on; the exit code is 1 when any step failed):

1. the machine: device, driver, torch/transformers/accelerate/peft versions, what is missing;
2. a random-weight model of Llama-3.1-8B's shape (config from the planner's shipped table, weights random:
   speed and memory are real, losses are not) and long synthetic text rows (random words, every row cut to
   the sequence length, so every example is exactly `--seq-len` tokens);
3. `finetune train --recipe demo` (LoRA, one device, precision `auto` = bf16-mixed on a bf16 GPU) on that model
   at 4,096 tokens with `training.per_device_train_batch_size: auto` and `gradient_checkpointing: auto`, the
   run's defaults otherwise (its save and the save's check included): trained tokens/s, MFU (PEFT convention:
   4N + 12LHQT per token, docs/run_record.md `throughput`), the plan's levers and its predicted device peak
   against the measured one;
4. `finetune bench` of Qwen2.5-1.5B's shape, full fine-tuning, packed at 2,048 tokens (6N + 12LHQT), ours
   against the plain transformers Trainer on the same tokens;
5. ZeRO-2 against ZeRO-3 at world size 1 (the same 1.5B full run under each), only where DeepSpeed is
   installed: the GPU machines this project is lent have no DeepSpeed unless it is built there first (a few
   minutes), and the step says so when it is absent;
6. `finetune doctor --quick` (the environment checks' GPU path).

Writes DIR/session.json (every step: command, seconds, exit code, figures) and DIR/session.md (the table for
docs/benchmarks.md, with the machine). `--tiny`: the same steps at CPU sizes (a 2-layer model, 128 tokens,
2-3 steps), to prove the script end to end on a machine without a GPU; its figures mean nothing.

Targets it reports against (issue 47): 8B LoRA >= 13,000 trained tok/s and >= 42% MFU on one H100/H200, 1.5B
full >= 45% MFU, ZeRO-3 <= 1.5x ZeRO-2's step, the planned device peak within 10% of the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# step -> seconds it may take; the sum fits 10 minutes of device time with the model's writing
LIMITS_S = {"model": 120, "lora_8b_auto": 240, "full_1.5b_packed": 150, "zero2": 90, "zero3": 120, "doctor": 30}
SIZES = {  # GPU session / --tiny: model, sequence, steps, 1.5B shape for the bench
    False: {"model": "Llama-3.1-8B", "seq_len": 4096, "steps": 12, "bench_shape": "qwen2.5-1.5b", "bench_seq": 2048},
    True: {"model": "tiny", "seq_len": 128, "steps": 3, "bench_shape": "tiny", "bench_seq": 128},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for session.json, session.md, the runs and their logs")
    p.add_argument("--tiny", action="store_true", help="CPU sizes: proves the script, measures nothing")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the bundled model's)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    size = SIZES[args.tiny]
    session = {"tiny": args.tiny, "machine": machine(), "steps": {}}
    tokenizer = tokenizer_dir(args.tokenizer)
    model = out / "models" / size["model"]
    step(session, "model", lambda: make_model(size["model"], tokenizer, model) or {"folder": str(model)})
    data = make_rows(out / "long.jsonl", size["seq_len"])
    common = [
        f"--model.name_or_path={model}",
        f"--data.path={data}",
        "--data.format=text",
        f"--data.max_length={size['seq_len']}",
        f"--training.max_steps={size['steps']}",
        "--training.logging_steps=1",
        "--training.warmup_steps=0",
        "--eval.exact_match=false",
    ]
    auto = ["--training.per_device_train_batch_size=auto", "--training.gradient_checkpointing=auto"]
    train(session, "lora_8b_auto", out, ["--recipe", "demo", *common, *auto])
    bench = [
        "bench",
        "--shape",
        size["bench_shape"],
        "--methods",
        "full",
        "--layout",
        "packing",
        "--seq-len",
        str(size["bench_seq"]),
        "--batch",
        "2" if args.tiny else "8",
        "--steps",
        str(size["steps"] if args.tiny else 20),
        "--warmup-steps",
        "1" if args.tiny else "5",
        "--rounds",
        "1",
        "--baseline",
        "plain-trainer",
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out / "bench-full-packed"),
    ]

    def packed():
        command(out, "full_1.5b_packed", bench)
        return bench_figures(out / "bench-full-packed" / "report.json")

    step(session, "full_1.5b_packed", packed)
    zero_runs(session, out, tokenizer, data, size)
    step(session, "doctor", lambda: {"exit": command(out, "doctor", ["doctor", "--quick"], check=False)})
    (out / "session.json").write_text(json.dumps(session, indent=1))
    (out / "session.md").write_text(table(session))
    print((out / "session.md").read_text())
    failed = [name for name, s in session["steps"].items() if s["status"] == "failed"]
    if failed:
        print(f"gpu_session: steps that failed: {', '.join(failed)} (session.json says why)", file=sys.stderr)
    return 1 if failed else 0


def machine() -> dict:
    import importlib.metadata as md

    facts = {"python": platform.python_version(), "host": platform.node(), "load": os.getloadavg()}
    for name in ("torch", "transformers", "accelerate", "peft", "deepspeed", "bitsandbytes", "datasets", "trl"):
        try:
            facts[name] = md.version(name)
        except md.PackageNotFoundError:
            facts[name] = None  # absent: the steps that need it say so
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True)
        facts["driver"] = smi.stdout.decode().strip() or None
    else:
        facts["device"] = "cpu"
    return facts


def step(session: dict, name: str, work) -> None:
    """Run one step, recording its seconds and figures, or its failure and why; never stop the session."""
    print(f"[gpu_session] {name} ...", flush=True)
    start = time.perf_counter()
    try:
        found = {"status": "ok", **(work() or {})}
    except Exception as e:  # noqa: BLE001 - a failed step is recorded, and the session's exit code says so
        found = {"status": "failed", "why": f"{type(e).__name__}: {e}"}
    found["seconds"] = round(time.perf_counter() - start, 1)
    session["steps"][name] = found
    print(f"[gpu_session] {name}: {found['status']} in {found['seconds']} s", flush=True)


def command(out: Path, name: str, args: list[str], check: bool = True) -> int:
    """`finetune ARGS` in a process of its own under the step's time limit; its output in logs/NAME.log."""
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                [sys.executable, "-m", "finetune.cli", *args],
                cwd=out,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=LIMITS_S[name],
            ).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"ran past its {LIMITS_S[name]} s (logs/{name}.log)") from None
    if check and code != 0:
        raise RuntimeError(f"exit {code}: {log.read_text(errors='replace')[-600:]}")
    return code


def tokenizer_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    from finetune.modeling.bundled import ensure_bundled_model

    return ensure_bundled_model()


def make_model(name: str, tokenizer: Path, folder: Path) -> None:
    """Random weights of a real shape, in bf16 on the GPU (fp32 on CPU), with the tokenizer beside them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    if name == "tiny":
        from finetune.modeling.bundled import save_tiny_llama

        save_tiny_llama(folder, tok)
        return
    from finetune.planning.model_source import read_config

    values = dict(read_config(name).values)
    config = AutoConfig.for_model(**values)
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def make_rows(path: Path, seq_len: int, rows: int = 240) -> Path:
    """Text rows of random lowercase words, each longer than `seq_len` tokens (cut there by the data layer)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq_len))}) + "\n")
    return path


def train(session: dict, name: str, out: Path, args: list[str]) -> None:
    run_dir = out / "runs" / name

    def run():
        command(out, name, ["train", *args, f"--run.output_dir={run_dir}"])
        return figures(run_dir)

    step(session, name, run)


def figures(run_dir: Path) -> dict:
    """What the run recorded about its speed, memory and plan (docs/run_record.md)."""
    record = json.loads((run_dir / "run.json").read_text())
    speed, plan, error = record["throughput"], record.get("plan") or {}, record.get("predicted_memory") or {}
    levers = {k: v["planned"] for k, v in plan.get("levers", {}).items()}
    device = (error.get("error") or {}).get("device_reserved") or {}
    return {
        "trained_tokens_per_s": speed["trained_tokens_per_s"],
        "mfu": speed["mfu"],
        "flops_convention": speed["flops_convention"],
        "median_step_s": speed["median_step_s"],
        "levers": levers,
        "plan_predicted_gib": plan.get("predicted_gib"),
        "step_s_predicted": plan.get("step_s_predicted"),
        "device_reserved_predicted_gib": device.get("predicted_gib"),
        "device_reserved_measured_gib": device.get("measured_gib"),
        "device_reserved_relative_error": device.get("relative_error"),
        "precision": record["precision"].get("policy"),
        "export_check": {
            k: (record.get("export") or {}).get("check", {}).get(k) for k in ("kind", "passed", "seconds")
        },
    }


def bench_figures(report_json: Path) -> dict:
    report = json.loads(report_json.read_text())
    runs = {r["side"]: r for r in report["runs"]}
    keys = ("trained_tokens_per_s", "mfu", "device_peak_allocated_gib")
    return {side: {k: run.get(k) for k in keys} for side, run in runs.items()} | {"failures": report["failures"]}


def zero_runs(session: dict, out: Path, tokenizer: Path, data: Path, size: dict) -> None:
    """ZeRO-2 and ZeRO-3 at world size 1, full fine-tuning of the 1.5B shape at the bench's sequence, where
    DeepSpeed is installed (the 8B shape's full fine-tuning does not fit one device)."""
    if session["machine"]["deepspeed"] is None:
        for name in ("zero2", "zero3"):
            session["steps"][name] = {"status": "skipped", "why": "DeepSpeed is not installed on this machine"}
        return
    model = out / "models" / ("tiny" if session["tiny"] else "Qwen2.5-1.5B")
    if not model.is_dir():
        make_model("tiny" if session["tiny"] else "Qwen2.5-1.5B", tokenizer, model)
    for name in ("zero2", "zero3"):
        args = [
            f"--model.name_or_path={model}",
            f"--data.path={data}",
            "--data.format=text",
            f"--data.max_length={size['bench_seq']}",
            "--training.per_device_train_batch_size=4",
            f"--training.max_steps={size['steps']}",
            "--training.logging_steps=1",
            "--eval.exact_match=false",
            "--method.name=full",
            "--training.learning_rate=1e-5",
        ]
        train(session, name, out, ["--recipe", name, "--num_processes", "1", *args])


def table(session: dict) -> str:
    m = session["machine"]
    lines = [
        f"Machine: {m.get('device')} ({m.get('device_memory_gib')} GiB), driver {m.get('driver')}, CUDA {m.get('cuda')}; "
        f"torch {m['torch']}, transformers {m['transformers']}, accelerate {m['accelerate']}, peft {m['peft']}, "
        f"deepspeed {m['deepspeed']}" + (" (--tiny: CPU sizes, figures mean nothing)" if session["tiny"] else ""),
        "",
        "| step | status | seconds | figures |",
        "|---|---|---|---|",
    ]
    for name, s in session["steps"].items():
        shown = {k: v for k, v in s.items() if k not in ("status", "seconds")}
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', '')} | `{json.dumps(shown)}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
