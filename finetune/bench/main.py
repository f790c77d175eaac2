"""`finetune bench`: the same workload through this project and through a plain TRL SFTTrainer
script, alternating, in one invocation; reports trained tokens/s, MFU, peak memory and ratios.

    finetune bench --shape qwen2.5-1.5b --methods full lora qlora --seq-len 2048 --batch 8 \
        --steps 30 --rounds 3 --out bench-out
    python -m finetune.bench --shape tiny --methods lora --steps 2 --rounds 1     # CPU smoke test

Workload: synthetic pre-tokenized instruction data (prompt + response, loss on the response
only) with lengths drawn from log-normal distributions (defaults: prompt median 60 tokens,
sigma 0.8; response median 180 tokens, sigma 0.9; both clipped so a row fits --seq-len).
These are chosen to resemble instruction-tuning sets (a long tail of long answers); they are
not measured from a particular dataset. Models: real architectures' shapes (Qwen2.5-0.5B and
-1.5B configs) with random weights (speed does not depend on the values), or small Qwen2-
architecture shapes for CPU. Each run is a separate process (finetune/bench/worker.py); the
order of the two sides alternates from round to round. Ours: finetune.model loading, the
chosen batch layout (default padding-free), FinetuneTrainer. TRL: finetune/bench/trl_side.py.
No timing is asserted anywhere; figures belong to the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from finetune import resources
from finetune.errors import UserError

# Real architectures' configurations (Qwen2.5 config.json on the Hub), random weights here.
SHAPES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": None},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "intermediate_size": 1024, "vocab_size": None},
    "qwen2.5-0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936},
    "qwen2.5-1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936},
}
METHODS = ("qlora", "lora", "full")
LAYOUTS = ("padding_free", "packing", "padded")
SIDES = ("finetune", "trl")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="finetune bench", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="tiny",
                   help="model shape: tiny/small (Qwen2 architecture, CPU-sized; vocab = the tokenizer's) or a "
                        "real Qwen2.5 configuration")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["lora"])
    p.add_argument("--seq-len", type=int, default=256, help="max tokens per example (both sides' max_length)")
    p.add_argument("--batch", type=int, default=4, help="examples per step per device (both sides)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the figures")
    p.add_argument("--rounds", type=int, default=1, help="runs per side and method, alternating sides")
    p.add_argument("--layout", choices=LAYOUTS, default="padding_free", help="our side's batch layout")
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides")
    p.add_argument("--torch-compile", action="store_true", help="our side only (a speed option of ours)")
    p.add_argument("--liger", action="store_true", help="our side only: Liger kernels (CUDA, liger-kernel installed)")
    p.add_argument("--prompt-median", type=float, default=60.0, help="tokens")
    p.add_argument("--response-median", type=float, default=180.0, help="tokens")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the bundled model's)")
    p.add_argument("--out", default="bench-out", help="directory for report.json, report.md, runs and logs")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds per run before it is killed")
    p.add_argument("--in-process", action="store_true",
                   help="run both sides in this process (smoke tests: saves start-up; host peaks are then shared)")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len < 16:
        p.error("--seq-len must be >= 16")
    return args


def make_examples(n: int, seq_len: int, vocab: int, *, seed: int, prompt_median: float,
                  response_median: float, special: set[int]) -> list[dict]:
    """Pre-tokenized rows {input_ids, labels}: random token ids, loss on the response only."""
    import math
    import random

    rng = random.Random(seed)
    ids = [i for i in range(vocab) if i not in special]
    rows = []
    for _ in range(n):
        prompt = max(4, min(int(rng.lognormvariate(math.log(prompt_median), 0.8)), seq_len // 2))
        response = max(4, min(int(rng.lognormvariate(math.log(response_median), 0.9)), seq_len - prompt))
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
    config = Qwen2Config(**dims, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from finetune.config.sections import ModelConfig
    from finetune.config.validate import build_config
    from finetune.modeling.load import load_tokenizer
    from finetune.training import speed

    # Our side's options pass the same checks as a recipe (boundary safety, Liger on this machine).
    speed.check(build_config({"data": {"packing": args.layout == "packing", "padding_free": args.layout == "padding_free"},
                              "model": {"attn_implementation": args.attn_implementation},
                              "training": {"per_device_train_batch_size": args.batch, "use_liger_kernel": args.liger}},
                             source="finetune bench options"))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    tokenizer = load_tokenizer(ModelConfig(name_or_path=args.tokenizer) if args.tokenizer else ModelConfig())
    model_dir = build_model_dir(args.shape, tokenizer, out / "models", cuda=cuda)
    rows = make_examples(args.steps * args.batch, args.seq_len, len(tokenizer), seed=args.seed,
                         prompt_median=args.prompt_median, response_median=args.response_median,
                         special=set(tokenizer.all_special_ids))
    data_file = out / "data.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = sorted(len(r["input_ids"]) for r in rows)
    print(f"[bench] {len(rows)} examples, tokens per example: median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}, mean {sum(lengths) / len(lengths):.0f}; model {args.shape} at {model_dir}", flush=True)

    results, failures = [], []
    for method in args.methods:
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                spec = {"side": side, "method": method, "round": r, "model_dir": str(model_dir),
                        "data_file": str(data_file), "seq_len": args.seq_len, "batch": args.batch,
                        "steps": args.steps, "warmup_steps": args.warmup_steps, "seed": args.seed,
                        "learning_rate": args.learning_rate, "attn_implementation": args.attn_implementation,
                        "gradient_checkpointing": args.gradient_checkpointing, "layout": args.layout,
                        "torch_compile": args.torch_compile, "liger": args.liger,
                        "output_dir": str(out / "runs" / f"{method}-{side}-{r}")}
                result = _run_in_process(spec) if args.in_process else _run_side(spec, out, args.run_timeout)
                (results if "error" not in result else failures).append(result)
                _print_run(result)
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": sys.argv,
              "in_process": args.in_process,
              "environment": environment(), "settings": vars(args) | {"data": "synthetic log-normal lengths",
                                                                   "examples": len(rows)},
              "length_stats": {"median": lengths[len(lengths) // 2], "max": lengths[-1],
                               "mean": sum(lengths) / len(lengths)},
              "summary": summarize(results, args.methods), "runs": results, "failures": failures}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    table = markdown_table(report["summary"])
    (out / "report.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    print(f"\n[bench] report: {out / 'report.json'}, {out / 'report.md'}", flush=True)
    if failures:
        raise UserError(f"{len(failures)} benchmark run(s) failed: "
                        + "; ".join(f"{f['method']} {f['side']} round {f['round']}: {f['error']}" for f in failures))
    return 0


def _run_side(spec: dict, out: Path, timeout: float) -> dict:
    name = f"{spec['method']}-{spec['side']}-{spec['round']}"
    spec_file, result_file, log_file = (out / "runs" / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(spec, indent=1))
    result_file.unlink(missing_ok=True)
    repo = str(resources.PACKAGE_DIR.parent)  # the folder holding this finetune: the worker imports the same copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TOKENIZERS_PARALLELISM": "false"}
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


def _print_run(r: dict) -> None:
    if "error" in r:
        print(f"[bench] {r['method']:5s} {r['side']:8s} round {r['round']}: FAILED {r['error']}", flush=True)
        return
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    print(f"[bench] {r['method']:5s} {r['side']:8s} round {r['round']}: {r['trained_tokens_per_s']:,.1f} trained tok/s,"
          f" padding {100 * (r['padding_fraction'] or 0):.0f}% of positions,"
          f" MFU {mfu}, median step {r['median_step_s']:.3f} s, host peak {r['host_peak_rss_gib']:.2f} GiB"
          + (f", device peak {r['device_peak_allocated_gib']:.2f} GiB" if r["device_peak_allocated_gib"] else "")
          + f", first losses {[round(x, 4) for x in r['losses'][:2]]}", flush=True)


def summarize(results: list[dict], methods: list[str]) -> list[dict]:
    """Per method: each side's median over rounds, and ours / TRL."""
    rows = []
    for method in methods:
        sides = {}
        for side in SIDES:
            runs = [r for r in results if r["method"] == method and r["side"] == side]
            if not runs:
                continue
            def med(key, runs=runs):
                values = [r[key] for r in runs if r[key] is not None]
                return statistics.median(values) if values else None

            def peak(key, runs=runs):
                values = [r[key] for r in runs if r[key] is not None]
                return max(values) if values else None
            sides[side] = {"runs": len(runs), "trained_tokens_per_s": med("trained_tokens_per_s"),
                           "input_tokens_per_s": med("input_tokens_per_s"), "mfu": med("mfu"),
                           "median_step_s": med("median_step_s"),
                           "device_peak_allocated_gib": peak("device_peak_allocated_gib"),
                           "host_peak_rss_gib": peak("host_peak_rss_gib"), "padding_fraction": med("padding_fraction"),
                           "trained_tokens_per_step": statistics.mean(
                               t for r in runs for t in r["trained_tokens"][r["warmup_steps_excluded"]:] or [0])}
        ours, trl = sides.get("finetune"), sides.get("trl")
        row = {"method": method, "finetune": ours, "trl": trl,
               "ratio_trained_tokens_per_s": _ratio(ours, trl, "trained_tokens_per_s"),
               "ratio_mfu": _ratio(ours, trl, "mfu"),
               "ratio_device_peak": _ratio(ours, trl, "device_peak_allocated_gib"),
               "ratio_host_peak": _ratio(ours, trl, "host_peak_rss_gib")}
        rows.append(row)
    return rows


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def markdown_table(summary: list[dict]) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [("| method | side | trained tok/s | MFU | device peak GiB | host peak GiB | median step s | padding | "
              "tok/s ratio (ours/TRL) | MFU ratio | device mem ratio | host mem ratio |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary:
        for side in SIDES:
            s = row[side]
            if s is None:
                continue
            ours = side == "finetune"
            lines.append(" | ".join([
                f"| {row['method']}", "finetune" if ours else "TRL SFTTrainer", f(s["trained_tokens_per_s"], ",.1f"),
                "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%", f(s["device_peak_allocated_gib"], ".2f"),
                f(s["host_peak_rss_gib"], ".2f"), f(s["median_step_s"], ".3f"),
                "n/a" if s.get("padding_fraction") is None else f"{100 * s['padding_fraction']:.0f}%",
                f(row["ratio_trained_tokens_per_s"], ".2f") if ours else "",
                f(row["ratio_mfu"], ".2f") if ours else "", f(row["ratio_device_peak"], ".2f") if ours else "",
                f(row["ratio_host_peak"], ".2f") if ours else ""]) + " |")
    return "\n".join(lines)


def environment() -> dict:
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets", "liger-kernel"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"device": device, "python": platform.python_version(), "versions": versions, "host": platform.node()}

