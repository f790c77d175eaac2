"""`finetune bench`'s report: each side's median over rounds per method, and ours / each baseline
(the sides: docs/benchmarks.md, finetune/bench/baselines.py).
"""

from __future__ import annotations

import statistics

SIDES = ("finetune", "plain_trainer", "trl_plain", "trl_tuned")
# TrainingArguments that are each run's own, not a setting (--baseline-like-ours leaves them)
PER_RUN = ("output_dir", "logging_dir", "run_name")


# Why a TrainingArguments setting of ours differs from a baseline's (a difference without one here
# is reported as unexplained)
WHY = {
    "logging_nan_inf_filter": "ours off: the step guard (docs/faults.md) handles a non-finite loss on the device; "
    "Trainer's default on tests each micro-batch's loss on the host, a device sync per micro-batch on a GPU",
    "num_train_epochs": "no effect: every side sets max_steps, which overrides it",
    "output_dir": "each run's own directory (nothing is saved)",
    "logging_dir": "each run's own directory (nothing is written)",
    "run_name": "ours names its run; no logger reads it here (report_to none)",
    "use_cpu": "the baselines set it where there is no CUDA device; ours runs there on the CPU without it",
    "dataloader_pin_memory": "Trainer turns it off with use_cpu; pinning does nothing without a GPU",
}
MIN_ROUNDS = 3  # rounds a ratio needs for a verdict


def differing(ours: dict, theirs: dict) -> dict:
    """{setting: (ours, theirs)} of the TrainingArguments fields both sides have whose values differ."""
    return {k: (ours[k], theirs[k]) for k in sorted(ours.keys() & theirs.keys()) if ours[k] != theirs[k]}


def settings_differences(results: list[dict]) -> list[dict]:
    """Every TrainingArguments setting in which a baseline's live arguments differ from ours (the
    first run of each side and method), with the methods it holds for and why."""
    rows: dict = {}
    for run in results:
        ours = next((r for r in results if r["side"] == "finetune" and r["method"] == run["method"]), None)
        if run["side"] == "finetune" or ours is None or run["round"] != ours["round"]:
            continue
        for key, (a, b) in differing(ours["training_args"], run["training_args"]).items():
            row = rows.setdefault((run["side"], key), {"side": run["side"], "setting": key, "methods": []})
            row.update(ours=a, theirs=b, why=WHY.get(key))
            row["methods"] += [run["method"]] if run["method"] not in row["methods"] else []
    return list(rows.values())


def settings_table(rows: list[dict], *, like_ours: bool = False) -> str:
    head = (
        "TrainingArguments that differ from ours (each side's live arguments"
        + ("; the baselines ran with ours, --baseline-like-ours" if like_ours else ", as its users run it")
        + "):\n\n| side | setting | ours | theirs | methods | why |\n|---|---|---|---|---|---|"
    )
    lines = [
        f"| {LABELS[r['side']]} | `{r['setting']}` | {r['ours']} | {r['theirs']} | {', '.join(r['methods'])} | "
        f"{r['why'] or 'unexplained'} |"
        for r in rows
    ]
    return "\n".join([head, *lines]) if lines else head + "\n| (none) | | | | | |"


def verdict(per_round: list) -> str | None:
    """None when ours / the baseline is on one side of 1.0 in every one of at least MIN_ROUNDS rounds."""
    rounds = [x for x in per_round if x is not None]
    if len(rounds) < MIN_ROUNDS:
        return f"{len(rounds)} round(s): no verdict"
    return "not significant" if min(rounds) <= 1.0 <= max(rounds) else None


LABELS = {"finetune": "finetune", "plain_trainer": "plain Trainer", "trl_plain": "TRL plain", "trl_tuned": "TRL tuned"}
BASELINE_SIDES = SIDES[1:]


def summarize(results: list[dict], methods: list[str]) -> list[dict]:
    """Per method: each side's median over rounds (peaks: the max; trained tokens/s also its range
    over rounds), and ours / each baseline: the ratio of the medians and each round's own ratio (the
    sides of one round ran back to back, so a round's ratio shares that round's machine load)."""
    rows = []
    for method in methods:
        sides = {}
        for side in SIDES:
            runs = [r for r in results if r["method"] == method and r["side"] == side]
            if not runs:
                continue

            def med(key, runs=runs, how=statistics.median):
                values = [r[key] for r in runs if r[key] is not None]
                return how(values) if values else None

            sides[side] = {
                "runs": len(runs),
                "trainer": runs[0].get("trainer"),
                "precision": runs[0].get("precision"),
                "trained_tokens_per_s": med("trained_tokens_per_s"),
                "trained_tokens_per_s_range": [
                    min(r["trained_tokens_per_s"] for r in runs),
                    max(r["trained_tokens_per_s"] for r in runs),
                ],
                "input_tokens_per_s": med("input_tokens_per_s"),
                "mfu": med("mfu"),
                "median_step_s": med("median_step_s"),
                "device_peak_allocated_gib": med("device_peak_allocated_gib", how=max),
                "device_peak_source": runs[0].get("device_peak_source"),
                "host_peak_rss_gib": med("host_peak_rss_gib", how=max),
                "padding_fraction": med("padding_fraction"),
                "trained_tokens_per_step": statistics.mean(
                    t for r in runs for t in r["trained_tokens"][r["warmup_steps_excluded"] :] or [0]
                ),
            }
        row = {"method": method, **{side: sides.get(side) for side in SIDES}, "ratios": {}}
        ours = {r["round"]: r for r in results if r["method"] == method and r["side"] == "finetune"}
        for base in BASELINE_SIDES:
            row["ratios"][base] = {
                key: _ratio(sides.get("finetune"), sides.get(base), key)
                for key in ("trained_tokens_per_s", "mfu", "device_peak_allocated_gib", "host_peak_rss_gib")
            }
            per_round = [
                _ratio(ours[r["round"]], r, "trained_tokens_per_s")
                for r in results
                if r["method"] == method and r["side"] == base and r["round"] in ours
            ]
            row["ratios"][base]["trained_tokens_per_s_per_round"] = per_round
            row["ratios"][base]["trained_tokens_per_s_verdict"] = verdict(per_round) if per_round else None
        rows.append(row)
    return rows


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def markdown_table(summary: list[dict], *, precision: str | None = None, ours: str | None = None) -> str:
    """One row per method and side: its figures, its live precision (parameter/compute dtype) and,
    on our row, ours / each baseline's trained tokens/s (and ours / TRL tuned MFU, device memory)."""

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    head = "".join(
        [
            f"Ours (`finetune`): {ours}.\n" if ours else "",
            f"Every side under the precision policy {precision}.\n" if precision else "",
        ]
    )
    head += "\n" if head else ""
    lines = [
        "| method | side | precision (param/compute) | trained tok/s, median (min-max) | MFU | device peak GiB | "
        "host peak GiB | median step s | padding | ours/plain Trainer tok/s | ours/TRL plain tok/s | "
        "ours/TRL tuned tok/s | ours/TRL tuned MFU | ours/TRL tuned device mem |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        ratios = row["ratios"]
        for side in SIDES:
            s = row[side]
            if s is None:
                continue
            p, tuned = s.get("precision") or {}, ratios["trl_tuned"]
            versus = [_ratio_cell(ratios[b]) for b in BASELINE_SIDES]
            versus += [f(tuned["mfu"], ".2f"), f(tuned["device_peak_allocated_gib"], ".2f")]
            cells = [
                row["method"],
                LABELS[side],
                f"{p.get('param_dtype')}/{p.get('compute_dtype')}" if p else "n/a",
                _with_range(s["trained_tokens_per_s"], s.get("trained_tokens_per_s_range"), s["runs"]),
                "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%",
                f(s["device_peak_allocated_gib"], ".2f"),
                f(s["host_peak_rss_gib"], ".2f"),
                f(s["median_step_s"], ".3f"),
                "n/a" if s.get("padding_fraction") is None else f"{100 * s['padding_fraction']:.1f}%",
                *(versus if side == "finetune" else [""] * len(versus)),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    legend = (
        "\n\nA ratio: ours / the baseline, of the medians; in brackets the min-max over rounds of each "
        f"round's own ratio (the sides of a round ran back to back); not significant: that range crosses 1.0; "
        f"no verdict under {MIN_ROUNDS} rounds."
    )
    return head + "\n".join(lines) + legend


def _with_range(median: float | None, span: list | None, runs: int) -> str:
    if median is None:
        return "n/a"
    return f"{median:,.1f}" + (f" ({span[0]:,.1f}-{span[1]:,.1f})" if span and runs > 1 else "")


def _ratio_cell(ratio: dict) -> str:
    """The ratio of the medians, the per-round ratios' range when there are several rounds, and why
    it is no verdict (a range crossing 1.0, too few rounds)."""
    if ratio["trained_tokens_per_s"] is None:
        return "n/a"
    rounds = [x for x in ratio.get("trained_tokens_per_s_per_round", []) if x is not None]
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    why = ratio.get("trained_tokens_per_s_verdict")
    return f"{ratio['trained_tokens_per_s']:.2f}{spread}" + (f" {why}" if why else "")


def print_run(r: dict) -> None:
    head = f"[bench] {r['method']:5s} {LABELS.get(r['side'], r['side']):13s} round {r['round']}"
    if "error" in r:
        print(f"{head}: FAILED {r['error']}", flush=True)
        return
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    print(
        f"{head}: {r['trained_tokens_per_s']:,.1f} trained tok/s,"
        f" padding {100 * (r['padding_fraction'] or 0):.1f}% of positions,"
        f" MFU {mfu}, median step {r['median_step_s']:.3f} s, host peak {r['host_peak_rss_gib']:.2f} GiB"
        + (f", device peak {r['device_peak_allocated_gib']:.2f} GiB" if r["device_peak_allocated_gib"] else "")
        + f", first losses {[round(x, 4) for x in r['losses'][:2]]}"
        + f", {r['trainer']} in {r['precision']['param_dtype']}/{r['precision']['compute_dtype']}"
        + (f", load {r['load_1min'][0]:.1f}-{r['load_1min'][1]:.1f}" if "load_1min" in r else ""),
        flush=True,
    )
