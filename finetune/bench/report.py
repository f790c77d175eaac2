"""`finetune bench`'s report: each side's median over rounds per method, and ours / each TRL side.

Sides: `finetune` (this project), `trl_plain` (a plain TRL SFTTrainer script: TRL's defaults for
batching, so padded batches) and `trl_tuned` (TRL's own padding-free or BFD packing, its own
chunked loss, the same SDPA backend policy as ours); finetune/bench/trl_side.py.
"""

from __future__ import annotations

import statistics

SIDES = ("finetune", "trl_plain", "trl_tuned")
LABELS = {"finetune": "finetune", "trl_plain": "TRL plain", "trl_tuned": "TRL tuned"}
TRL_SIDES = SIDES[1:]


def summarize(results: list[dict], methods: list[str]) -> list[dict]:
    """Per method: each side's median over rounds (peaks: the max), and ours / each TRL side."""
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

            sides[side] = {
                "runs": len(runs),
                "trained_tokens_per_s": med("trained_tokens_per_s"),
                "input_tokens_per_s": med("input_tokens_per_s"),
                "mfu": med("mfu"),
                "median_step_s": med("median_step_s"),
                "device_peak_allocated_gib": peak("device_peak_allocated_gib"),
                "device_peak_source": runs[0].get("device_peak_source"),
                "host_peak_rss_gib": peak("host_peak_rss_gib"),
                "padding_fraction": med("padding_fraction"),
                "trained_tokens_per_step": statistics.mean(
                    t for r in runs for t in r["trained_tokens"][r["warmup_steps_excluded"] :] or [0]
                ),
            }
        row = {"method": method, **{side: sides.get(side) for side in SIDES}, "ratios": {}}
        for trl in TRL_SIDES:
            row["ratios"][trl] = {
                key: _ratio(sides.get("finetune"), sides.get(trl), key)
                for key in ("trained_tokens_per_s", "mfu", "device_peak_allocated_gib", "host_peak_rss_gib")
            }
        rows.append(row)
    return rows


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def markdown_table(summary: list[dict]) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        (
            "| method | side | trained tok/s | MFU | device peak GiB | host peak GiB | median step s | padding | "
            "ours/TRL plain tok/s | ours/TRL tuned tok/s | ours/TRL tuned MFU | ours/TRL tuned device mem |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        plain, tuned = row["ratios"]["trl_plain"], row["ratios"]["trl_tuned"]
        for side in SIDES:
            s = row[side]
            if s is None:
                continue
            ours = side == "finetune"
            lines.append(
                " | ".join(
                    [
                        f"| {row['method']}",
                        LABELS[side],
                        f(s["trained_tokens_per_s"], ",.1f"),
                        "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%",
                        f(s["device_peak_allocated_gib"], ".2f"),
                        f(s["host_peak_rss_gib"], ".2f"),
                        f(s["median_step_s"], ".3f"),
                        "n/a" if s.get("padding_fraction") is None else f"{100 * s['padding_fraction']:.1f}%",
                        f(plain["trained_tokens_per_s"], ".2f") if ours else "",
                        f(tuned["trained_tokens_per_s"], ".2f") if ours else "",
                        f(tuned["mfu"], ".2f") if ours else "",
                        f(tuned["device_peak_allocated_gib"], ".2f") if ours else "",
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def print_run(r: dict) -> None:
    head = f"[bench] {r['method']:5s} {LABELS.get(r['side'], r['side']):9s} round {r['round']}"
    if "error" in r:
        print(f"{head}: FAILED {r['error']}", flush=True)
        return
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    print(
        f"{head}: {r['trained_tokens_per_s']:,.1f} trained tok/s,"
        f" padding {100 * (r['padding_fraction'] or 0):.1f}% of positions,"
        f" MFU {mfu}, median step {r['median_step_s']:.3f} s, host peak {r['host_peak_rss_gib']:.2f} GiB"
        + (f", device peak {r['device_peak_allocated_gib']:.2f} GiB" if r["device_peak_allocated_gib"] else "")
        + f", first losses {[round(x, 4) for x in r['losses'][:2]]}",
        flush=True,
    )
