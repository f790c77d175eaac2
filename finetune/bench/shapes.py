"""`finetune bench --shape-overhead`: what a new input shape costs per step, under SDPA backend
choices and shape bucketing: the measurements behind model.sdpa_backends `auto` (docs/speed.md,
docs/benchmarks.md: the rows and the method). On CPU there is no cuDNN: the `auto` rows are n/a.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

ROWS = [  # (name, SDPA policy, variable lengths, bucket tokens)
    ("fixed shape 8 x 300 tokens", "torch_default", False, None),
    ("variable, torch default backends", "torch_default", True, None),
    ("variable, auto (cuDNN off)", "auto", True, None),
    ("variable, bucket 256 tokens", "torch_default", True, 256),
    ("variable, bucket 1024 tokens", "torch_default", True, 1024),
    ("variable, auto + bucket 256", "auto", True, 256),
]


def draw_lengths(rng: random.Random, seq_len: int, prompt_median: float, response_median: float) -> tuple[int, int]:
    """(prompt, response) tokens of one synthetic example: log-normal, at least 4 each, within seq_len."""
    prompt = max(4, min(int(rng.lognormvariate(math.log(prompt_median), 0.8)), seq_len // 2))
    response = max(4, min(int(rng.lognormvariate(math.log(response_median), 0.9)), seq_len - prompt))
    return prompt, response


def lengths(rng: random.Random, args, n: int = 8) -> list[int]:
    return [sum(draw_lengths(rng, args.seq_len, args.prompt_median, args.response_median)) for _ in range(n)]


def run(args, model_dir: Path, out: Path, environment: dict) -> int:
    """args: `finetune bench`'s options (seq_len, steps, seed, prompt/response medians, shape);
    model_dir: the bench's model of the shape (finetune/bench/main.py build_model_dir)."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa"
    ).to("cuda" if cuda else "cpu")
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    results = []
    for name, policy, variable, bucket in ROWS:
        if policy == "auto" and not cuda:
            results.append({"row": name, "median_ms": None, "note": "n/a: no cuDNN on CPU (auto changes nothing)"})
            continue
        results.append(measure_row(args, model, opt, name, policy, variable, bucket))
        print(f"[shape-overhead] {name:36s} median {results[-1]['median_ms']:9.2f} ms", flush=True)
    report = {k: getattr(args, k) for k in ("shape", "seq_len", "steps", "warmup_steps")}
    report.update(environment=environment, rows=results)
    (out / "shapes.json").write_text(json.dumps(report, indent=1))
    lines = ["| row | median ms/step | first ms | min ms |", "|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['row']} | "
            + (
                " | ".join(str(r[k]) for k in ("median_ms", "first_ms", "min_ms"))
                if r["median_ms"] is not None
                else f"{r['note']} | | "
            )
            + " |"
        )
    (out / "shapes.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n\n[shape-overhead] {out / 'shapes.json'}, {out / 'shapes.md'}", flush=True)
    return 0


def measure_row(args, model, opt, name: str, policy: str, variable: bool, bucket: int | None) -> dict:
    """Warm-up and timed steps of one row under its SDPA policy (restored afterwards)."""
    from finetune.modeling import attention

    rng = random.Random(args.seed)
    fixed = [min(300, args.seq_len)] * 8
    with attention.flags_restored():
        enabled = attention.apply(policy, model.device.type)["sdpa_backends_enabled"]
        times = [
            timed_step(model, opt, lengths(rng, args) if variable else fixed, bucket)
            for _ in range(args.warmup_steps + args.steps)
        ]
    timed = times[args.warmup_steps :]
    return {
        "row": name,
        "sdpa_policy": policy,
        "sdpa_backends_enabled": enabled,
        "bucket": bucket,
        "median_ms": round(1e3 * statistics.median(timed), 2),
        "first_ms": round(1e3 * times[0], 2),
        "min_ms": round(1e3 * min(timed), 2),
        "steps": len(timed),
    }


def timed_step(model, opt, lens: list[int], bucket: int | None) -> float:
    """Seconds of one forward + backward + AdamW step on the examples of `lens` packed into one row
    (padded up to a multiple of `bucket` tokens when given)."""
    import torch

    device, cuda = model.device, model.device.type == "cuda"
    n = sum(lens)
    filler = (-n % bucket) if bucket else 0
    ids = torch.randint(0, model.config.vocab_size, (1, n + filler), device=device)
    pos = torch.cat(
        [torch.arange(x, device=device) for x in lens[:-1]] + [torch.arange(lens[-1] + filler, device=device)]
    ).unsqueeze(0)
    labels = ids.clone()
    labels[0, n:] = -100
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    model(input_ids=ids, position_ids=pos, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t
