"""`finetune bench` (what it compares: options.py DESCRIPTION, docs/benchmarks.md): the model and
the synthetic rows, then every method, round and side, each run in its own process (worker.py),
then the report. No timing is asserted anywhere.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from finetune import precision, resources, storage
from finetune.bench import report as bench_report
from finetune.bench.options import BASELINES, SHAPES, parse_args
from finetune.errors import UserError


def make_examples(n: int, args, vocab: int, special: set[int]) -> list[dict]:
    """n pre-tokenized rows {input_ids, labels} of --seq-len, --seed and the length medians: random
    token ids, loss on the response only."""
    import random

    from finetune.bench.shapes import draw_lengths

    rng = random.Random(args.seed)
    ids = [i for i in range(vocab) if i not in special]
    rows = []
    for _ in range(n):
        prompt, response = draw_lengths(rng, args.seq_len, args.prompt_median, args.response_median)
        tokens = [rng.choice(ids) for _ in range(prompt + response)]
        rows.append({"input_ids": tokens, "labels": [-100] * prompt + tokens[prompt:]})
    return rows


def build_model_dir(shape: str, tokenizer, directory: Path, *, cuda: bool) -> Path:
    """A random-weight Qwen2 model of the shape, saved once (bf16 on CUDA, fp32 on CPU)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dtype = torch.bfloat16 if cuda else torch.float32
    path = directory / f"{shape}-{'bf16' if cuda else 'fp32'}"
    if (path / "config.json").exists():
        return path
    dims = dict(SHAPES[shape])
    dims["vocab_size"] = dims["vocab_size"] or len(tokenizer)
    config = Qwen2Config(
        **dims,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    return run(parse_args(argv))


def run(args) -> int:
    """The benchmark of parsed options (finetune/bench/options.py)."""
    import torch

    from finetune.config.sections import ModelConfig
    from finetune.modeling.load import load_tokenizer

    out = storage.own_directory(Path(args.out).resolve(), "finetune bench", "report.*, data.jsonl, models/, runs/")
    cuda = torch.cuda.is_available()
    tokenizer = load_tokenizer(ModelConfig(name_or_path=args.tokenizer) if args.tokenizer else ModelConfig())
    model_dir = build_model_dir(args.shape, tokenizer, out / "models", cuda=cuda)
    if args.shape_overhead:
        from finetune.bench import shapes

        return shapes.run(args, model_dir, out, environment())
    rows = bench_examples(args, len(tokenizer), set(tokenizer.all_special_ids))
    data_file = out / "data.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    policy = precision.resolve(args.precision, cuda, cuda and torch.cuda.is_bf16_supported())
    if policy.needs_cuda and not cuda:
        raise UserError(f"--precision {policy.name}: needs a CUDA device; this machine has none (use 32-true or auto)")
    common = common_spec(args, model_dir, data_file, policy.name, out)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    print(
        f"[bench] {len(rows)} examples, tokens per example: median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}, mean {sum(lengths) / len(lengths):.0f}; model {args.shape} at {model_dir}; "
        f"precision {policy.name} ({policy.summary}) on every side; ours: {OURS}",
        flush=True,
    )
    results, failures = run_sides(args, common, out)
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": sys.argv,
        "in_process": args.in_process,
        "environment": environment(),
        "settings": vars(args) | {"data": "synthetic log-normal lengths", "examples": len(rows)},
        "ours": OURS,
        "precision": {"requested": args.precision, "policy": policy.name, "summary": policy.summary},
        "length_stats": {"median": lengths[len(lengths) // 2], "max": lengths[-1], "mean": sum(lengths) / len(lengths)},
        "summary": bench_report.summarize(results, args.methods),
        "settings_differences": bench_report.settings_differences(results),
        "runs": results,
        "failures": failures,
    }
    write_report(report, args, out)
    if failures:
        raise UserError(
            f"{len(failures)} benchmark run(s) failed: "
            + "; ".join(f"{f['method']} {f['side']} round {f['round']}: {f['error']}" for f in failures)
        )
    return 0


# The command-line options every side's spec carries under their own names.
SPEC_OPTIONS = (
    "seq_len batch steps warmup_steps seed learning_rate attn_implementation gradient_checkpointing layout "
    "torch_compile liger loss_impl sdpa_backends pad_to_multiple_of"
).split()


def common_spec(args, model_dir: Path, data_file: Path, policy: str, out: Path) -> dict:
    """What every side's run is given; our side's options pass the checks a recipe passes first
    (boundary safety, attention, Liger on this machine)."""
    from finetune.bench import worker
    from finetune.training import speed

    common = {
        "model_dir": str(model_dir),
        "data_file": str(data_file),
        "precision": policy,
        **{key: getattr(args, key) for key in SPEC_OPTIONS},
    }
    speed.check(worker.config_of({**common, "method": args.methods[0], "output_dir": str(out / "runs")}))
    return common


def run_sides(args, common: dict, out: Path) -> tuple[list[dict], list[dict]]:
    """(results, failures) of every method, round and side, the sides in the same order every round:
    each side's runs spread evenly over the machine's load."""
    sides = ("finetune", *dict.fromkeys(BASELINES[b] for b in args.baseline))
    results, failures, ours_args = [], [], {}
    for method in args.methods:
        for r in range(args.rounds):
            for side in sides:
                spec = {**common, "side": side, "method": method, "round": r}
                spec["output_dir"] = str(out / "runs" / f"{method}-{side}-{r}")
                load = os.getloadavg()[0]
                like_ours = args.baseline_like_ours and side != "finetune"
                if like_ours and method not in ours_args:  # not run as users run it instead, silently
                    result = {**{k: spec[k] for k in ("side", "method", "round")}, "error": "ours failed: no settings"}
                else:
                    if like_ours:
                        spec["ours_args"] = ours_args[method]
                    result = _run_in_process(spec) if args.in_process else _run_side(spec, out, args.run_timeout)
                result["load_1min"] = [load, os.getloadavg()[0]]  # at the run's start and end
                if side == "finetune" and "error" not in result:
                    ours_args.setdefault(method, result["training_args"])
                (results if "error" not in result else failures).append(result)
                bench_report.print_run(result)
    return results, failures


def write_report(report: dict, args, out: Path) -> None:
    """report.json and report.md (also printed): the summary table, the settings that differ, the load."""
    (out / "report.json").write_text(json.dumps(report, indent=1))
    policy = report["precision"]["policy"]
    table = bench_report.markdown_table(report["summary"], precision=policy, ours=OURS)
    table += "\n\n" + bench_report.settings_table(report["settings_differences"], like_ours=args.baseline_like_ours)
    loads = [x for r in report["runs"] + report["failures"] for x in r["load_1min"]]
    table += f"\n\n1-minute load average at the runs' starts and ends: {min(loads):.1f}-{max(loads):.1f}."
    (out / "report.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    print(f"\n[bench] report: {out / 'report.json'}, {out / 'report.md'}", flush=True)


OURS = "ResilientTrainer as finetune train builds it (finetune/training/build.py)"


def bench_examples(args, vocab: int, special: set[int]) -> list[dict]:
    """steps x batch examples; with --layout packing enough for steps x batch full rows (+5%), so no
    epoch wraps around and no partial last row is timed."""
    rows = make_examples(args.steps * args.batch, args, vocab, special)
    if args.layout == "packing":
        mean = sum(len(r["input_ids"]) for r in rows) / len(rows)
        count = math.ceil(args.steps * args.batch * args.seq_len / mean * 1.05)
        rows = make_examples(count, args, vocab, special)  # same seed: a longer prefix
    return rows


def _run_side(spec: dict, out: Path, timeout: float) -> dict:
    name = f"{spec['method']}-{spec['side']}-{spec['round']}"
    spec_file, result_file, log_file = (out / "runs" / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(spec, indent=1))
    result_file.unlink(missing_ok=True)
    repo = str(resources.PACKAGE_DIR.parent)  # the folder holding this finetune: the worker imports the same copy
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, "-m", "finetune.bench.worker", str(spec_file), str(result_file)]
    with open(log_file, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code == 0 and result_file.exists():
        return json.loads(result_file.read_text())
    tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    return {**{k: spec[k] for k in ("side", "method", "round")}, "error": f"exit {code}: {tail[0]} (log: {log_file})"}


def _run_in_process(spec: dict) -> dict:
    from finetune.bench import worker

    return worker.run(spec)  # an error ends the benchmark with its traceback


def environment() -> dict:
    import torch

    from finetune.telemetry.record import installed_version

    packages = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets", "liger-kernel")
    versions = {pkg: installed_version(pkg) for pkg in packages}
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    return {"device": device, "python": platform.python_version(), "versions": versions, "host": platform.node()}
