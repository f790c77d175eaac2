"""Runs side by side: read and check run records, pick the baseline, derive the comparison columns
(speedup, memory ratio, scaling efficiency, cost per 1M trained tokens; docs/compare.md has the
definitions). Each derived value is None with a reason when it cannot be had.

    runs = load_runs(["runs/a", "runs/b"])          # CompareInputError (exit 2) on unusable input
    table = build_table(runs, baseline=None, gpu_hour_price=2.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from finetune import strategies
from finetune.compare import comparable
from finetune.compare.comparable import NOT_COMPARABLE
from finetune.errors import UserError
from finetune.storage import read_json
from finetune.telemetry.record import RecordView, check


class CompareInputError(UserError):
    """Run records that cannot be compared: every problem, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("cannot compare:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Run:
    path: Path  # the run.json file
    record: dict | None  # None: the run never wrote a record (a sweep launch that failed early)
    label: str
    error: str | None = None  # why a launch failed, when record is None
    given: list[str] = field(default_factory=list)  # the arguments that named it (two or more: the same run)

    @property
    def view(self) -> RecordView | None:
        return RecordView(self.record) if self.record is not None else None

    @property
    def status(self) -> str:
        return "failed" if self.record is None else self.view.status

    def get(self, section: str, *keys, default=None):
        """Nested lookup that treats null sections (a run still running or failed early) as missing
        (finetune/telemetry/record.py RecordView)."""
        return default if self.record is None else self.view.get(section, *keys, default=default)


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Each path: a run directory holding run.json, or a run.json file. All problems are collected
    and raised together, before anything is written."""
    runs, problems = read_runs(paths)
    if problems:
        raise CompareInputError(problems)
    if not runs:
        raise CompareInputError(["no run directories given"])
    return runs


def read_runs(paths: list[str | Path]) -> tuple[list[Run], list[str]]:
    """(the runs whose run.json is readable, each once however many arguments name it: by its resolved path, what is
    wrong with each of the others)."""
    runs, problems, seen = [], [], {}
    for given in paths:
        path = Path(given)
        file = path / "run.json" if path.is_dir() else path
        if not path.exists():
            problems.append(f"{given}: no such file or directory")
            continue
        if not file.is_file():
            problems.append(
                f"{given}: no run.json in this directory (is it a run directory? "
                f"`finetune train` writes <output_dir>/run.json)"
            )
            continue
        if file.resolve() in seen:  # None: unreadable, its problem already named
            if seen[file.resolve()] is not None:
                seen[file.resolve()].given.append(str(given))
            continue
        seen[file.resolve()] = None
        record, why = read_json(file)
        if why:
            problems.append(f"{file}: {why}")
            continue
        problem = check(record)
        if problem:
            problems.append(f"{file}: {problem}")
            continue
        runs.append(Run(file, record, label=RecordView(record).get("run_name"), given=[str(given)]))
        seen[file.resolve()] = runs[-1]
    _unique_labels(runs)
    return runs, problems


def same_runs(runs: list[Run]) -> list[str]:
    """A warning for each run that two or more arguments named (read_runs counts it once)."""
    return [
        f"{', '.join(run.given[:-1])} and {run.given[-1]} name the same run {run.label} ({run.path.resolve()}): "
        f"compared once"
        for run in runs
        if len(run.given) > 1
    ]


def _unique_labels(runs: list[Run]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        n = seen.get(run.label, 0)
        seen[run.label] = n + 1
        if n:
            run.label = f"{run.label} ({n + 1})"


# --- baseline and comparability --------------------------------------------------------------


def pick_baseline(runs: list[Run], baseline: str | Path | None) -> tuple[Run | None, str]:
    """(baseline run or None, how it was chosen / why there is none)."""
    if baseline is not None:
        wanted = Path(baseline)
        wanted = (wanted / "run.json" if wanted.is_dir() else wanted).resolve()
        for run in runs:
            if run.path.resolve() == wanted:
                if run.record is None:
                    raise CompareInputError([f"--baseline {baseline}: that run failed before writing a record"])
                return run, f"--baseline {baseline}"
        raise CompareInputError([f"--baseline {baseline}: not among the runs compared; give it as a RUN_DIR too"])
    candidates = [
        r
        for r in runs
        if r.record is not None
        and r.get("strategy", "name") == strategies.one_process().name
        and r.get("strategy", "method") == "qlora"
    ]
    completed = [r for r in candidates if r.status == "completed"]
    chosen = (completed or candidates or [None])[0]
    if chosen is None:
        return None, "no baseline: none of the runs is a single-device QLoRA run (pass --baseline RUN_DIR)"
    note = "single-device QLoRA run"
    if len(candidates) > 1:
        note += f" (first of {len(candidates)}; pass --baseline to choose)"
    if chosen.status != "completed":
        note += f"; its status is {chosen.status}, so the comparisons against it may rest on partial figures"
    return chosen, note


def comparability_warnings(runs: list[Run]) -> list[str]:
    """Runs of different models, data, precision policy, effective batch or applied learning rate are
    reported, but said not to be comparable (finetune/compare/comparable.py); unfinished runs too."""
    warnings = comparable.warnings([r for r in runs if r.record is not None])
    for run in runs:
        if run.status != "completed":
            warnings.append(
                f"{run.label}: status {run.status}"
                + (f" ({e})" if (e := _error_of(run)) else "")
                + "; its figures are partial or missing"
            )
    return warnings


def _error_of(run: Run) -> str | None:
    return run.error if run.record is None else run.get("summary", "error")


# --- the table ---------------------------------------------------------------------------------


@dataclass
class Column:
    key: str
    header: str  # short, for the console
    title: str  # long, for Markdown/HTML
    fmt: str = "{}"  # for numbers


COLUMNS = [
    Column("run", "run", "run"),
    Column("status", "status", "status"),
    Column("strategy", "strategy", "strategy (offload)"),
    Column("method", "method", "method"),
    Column("precision", "precision", "precision policy"),
    Column("comparable", "comparable", "comparable with the reference run (same model, data, precision, batch, LR)"),
    Column("layout", "layout", "batch layout"),
    Column("loss_impl", "loss", "loss implementation"),
    Column("attention", "attn", "attention (SDPA backend policy)"),
    Column("compile", "compile", "torch.compile"),
    Column("liger", "liger", "Liger kernels"),
    Column("devices", "dev", "devices (world size)"),
    Column("effective_batch", "eff.batch", "effective batch (sequences/step)"),
    Column("lr_applied", "lr", "applied LR", "{:.3g}"),
    Column("tokens_per_s", "tok/s", "trained tokens/s (all devices)", "{:,.1f}"),
    Column("tokens_per_s_per_device", "tok/s/dev", "trained tokens/s per device", "{:,.1f}"),
    Column("mfu", "MFU", "MFU", "{:.1%}"),
    Column("device_peak_gib", "dev GiB", "peak device memory, GiB (allocated, max over ranks)", "{:.2f}"),
    Column("host_peak_gib", "host GiB", "host peak RSS, GiB (max over ranks)", "{:.2f}"),
    Column("predicted_gib", "pred GiB", "predicted memory, GiB (device allocated, else host)", "{:.2f}"),
    Column("predicted_error", "pred err", "prediction error (relative)", "{:+.1%}"),
    Column("train_loss", "train loss", "final train loss (mean over training)", "{:.4f}"),
    Column("eval_loss", "eval loss", "eval loss", "{:.4f}"),
    Column("task_metric", "task", "task metric (after training)"),
    Column("wall_s", "wall s", "wall time, s", "{:,.0f}"),
    Column("train_s", "train s", "training time, s", "{:,.0f}"),
    Column("cost_per_mtok", "$/1M tok", "cost per 1M trained tokens, USD (training time)", "{:,.4g}"),
    Column("speedup", "speedup", "speedup vs baseline (tokens/s)", "{:.2f}x"),
    Column("memory_ratio", "mem ratio", "memory ratio vs baseline", "{:.2f}"),
    Column("scaling_efficiency", "scaling", "scaling efficiency (vs same-method single device)", "{:.0%}"),
]
# The answer first: what a reader compares strategies by (docs/compare.md "The report").
PEAK = Column("peak_gib", "GiB/dev", "peak memory per device, GiB (the basis of the memory ratio)", "{:.2f}")
HEADLINE = tuple(
    "run strategy tokens_per_s speedup peak_gib memory_ratio scaling_efficiency cost_per_mtok comparable".split()
)
TASK = "task_metric"  # in the headline, before `comparable`, when a run has one (exact match)
# never "the same for every run" (they identify the run or are the answer)
NEVER_CONSTANT = {"run", "status", *HEADLINE, TASK}


@dataclass
class Table:
    rows: list[dict]  # key -> value (number, str or None)
    notes: list[dict]  # key -> why the value is missing, per row
    baseline: Run | None
    baseline_note: str
    warnings: list[str]
    runs: list[Run]
    gpu_hour_price: float | None
    columns: list[Column] = field(default_factory=lambda: list(COLUMNS))

    @property
    def headline(self) -> tuple[str, ...]:
        """The headline's columns: HEADLINE, with the task metric when a run measured one."""
        if not any(row.get(TASK) for row in self.rows):
            return HEADLINE
        return (*HEADLINE[:-1], TASK, HEADLINE[-1])

    def column(self, key: str) -> Column:
        return PEAK if key == "peak_gib" else next(c for c in self.columns if c.key == key)

    def headline_cell(self, i: int, key: str) -> str:
        """The headline's cell: the comparable verdict as yes / no / reference (the differing keys are in
        the full table and the warnings), the memory ratio without its basis (said once, above)."""
        value = self.rows[i].get(key)
        if key == "comparable" and isinstance(value, str):
            return value.split(":")[0]
        if key == "strategy" and isinstance(value, str):  # the offload in short: the table must stay narrow
            return value.replace("optimizer", "opt")
        if key == "memory_ratio" and value is not None:
            return self.column(key).fmt.format(value)
        if key == "peak_gib" and value is None:
            return "n/a"
        if key == TASK:  # the result and the one before training, short: the metric's name is the title
            return self.rows[i]["task_short"] or "n/a"
        return self.cell(i, key)

    def constant_columns(self) -> list[tuple[Column, str]]:
        """Columns whose cell is the same in every row (of two or more runs with a record): said once."""
        rows = [i for i, run in enumerate(self.runs) if run.record is not None]
        if len(rows) < 2:
            return []
        out = []
        for c in self.columns:
            if c.key in NEVER_CONSTANT:
                continue
            cells = {self.cell(i, c.key) for i in rows}
            if len(cells) == 1:
                out.append((c, cells.pop()))
        return out

    def cell(self, i: int, key: str) -> str:
        value = self.rows[i][key]
        if value is None:
            return "n/a"
        column = self.column(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            text = column.fmt.format(value)
            if key == "memory_ratio":
                text += f" ({self.rows[i]['memory_basis']})"
            if key in ("train_loss", "eval_loss") and str(self.rows[i]["comparable"]).startswith("no"):
                text += f" ({NOT_COMPARABLE})"
            return text
        return str(value)


def build_table(runs: list[Run], baseline: str | Path | None = None, gpu_hour_price: float | None = None) -> Table:
    if gpu_hour_price is not None and not (gpu_hour_price >= 0 and math.isfinite(gpu_hour_price)):
        raise CompareInputError([f"--gpu-hour-price: must be a non-negative number of USD, got {gpu_hour_price}"])
    base, base_note = pick_baseline(runs, baseline)
    reference = base or next((r for r in runs if r.record is not None), None)
    rows, notes = [], []
    for run in runs:
        row, why = _row(run, runs, base, gpu_hour_price)
        if run.record is not None and reference is not None:
            diff = comparable.differences(run, reference)
            row["comparable"] = (
                "reference"
                if run is reference
                else ("yes" if not diff else "no: " + ", ".join(d.split(" ")[0] for d in diff))
            )
            row["differences"] = diff
        rows.append(row)
        notes.append(why)
    return Table(rows, notes, base, base_note, comparability_warnings(runs), runs, gpu_hour_price)


def memory_pair(run: Run, base: Run) -> tuple[float | None, float | None, str]:
    """(run GiB, baseline GiB, basis): device peak allocated when both runs recorded one (GPU
    runs), else host peak RSS of both (CPU runs, or a GPU run against a CPU one)."""
    mine = run.get("memory", "max", "device_peak_allocated_gib")
    theirs = base.get("memory", "max", "device_peak_allocated_gib")
    if mine is not None and theirs is not None:
        return mine, theirs, "device"
    return run.get("memory", "max", "host_peak_rss_gib"), base.get("memory", "max", "host_peak_rss_gib"), "host"


def row_peak(run: Run) -> float | None:
    """Peak memory per device without a baseline: device allocated where recorded, else host RSS."""
    device = run.get("memory", "max", "device_peak_allocated_gib")
    return device if device is not None else run.get("memory", "max", "host_peak_rss_gib")


def same_method_single(run: Run, runs: list[Run], base: Run | None) -> tuple[Run | None, str | None]:
    """(the single-device run of the same method and the same work to measure scaling against, or None and why
    there is none). The baseline if it fits, else the one measured over the most steps."""
    method = run.get("strategy", "method")
    singles = [
        r
        for r in runs
        if r.record is not None
        and r.get("strategy", "world_size") == 1
        and r.get("strategy", "method") == method
        and r.get("throughput", "trained_tokens_per_s") is not None
    ]
    if not singles:
        return None, f"no single-device {method} run among the runs"
    fits = [r for r in singles if r is run or comparable.other_work(run, r) is None]
    if not fits:
        others = "; ".join(comparable.other_work(run, r) for r in singles)
        return None, f"no single-device {method} run of the same work: {others}"
    if base in fits:
        return base, None
    return max(fits, key=lambda r: r.get("throughput", "steps_measured") or 0), None


def _mesh(run: Run) -> str:
    """` sp2`, ` tp2`, ...: the run's live mesh (strategy.parallel) where it splits anything."""
    par = run.get("strategy", "parallel") or {}
    return "".join(f" {k}{par[k]}" for k in ("sp", "tp", "cp") if (par.get(k) or 1) > 1)


def _row(run: Run, runs: list[Run], base: Run | None, price: float | None) -> tuple[dict, dict]:
    """(the run's cells, why each missing one is missing)."""
    row = _recorded_cells(run, base)
    if run.record is None:
        return row, {k: "the run failed before writing run.json" for k in row}
    why = _unrecorded(run, row)
    _fill_prediction(row, run, why)
    _fill_cost(row, run, price, why)
    _fill_against_baseline(row, run, base, why)
    _fill_scaling(row, run, runs, base, why)
    return row, why


def _recorded_cells(run: Run, base: Run | None) -> dict:
    """The cells read from the record as they are; the derived ones None until filled."""
    strategy = run.get("strategy", "name")
    offload = run.get("strategy", "offload")
    return {
        "run": run.label + (" [baseline]" if run is base else ""),
        "status": run.status,
        "strategy": (strategy + (f" ({offload})" if offload not in (None, "none") else "") + _mesh(run))
        if strategy
        else None,
        "method": run.get("strategy", "method") or run.get("config", "method", "name"),
        "precision": run.get("precision", "policy"),
        "comparable": None,
        "differences": [],
        **speed_cells(run.get("speed")),
        "devices": run.get("strategy", "world_size"),
        "effective_batch": run.get("batch", "effective"),
        "lr_applied": run.get("lr", "applied"),
        "tokens_per_s": run.get("throughput", "trained_tokens_per_s"),
        "tokens_per_s_per_device": run.get("throughput", "trained_tokens_per_s_per_device"),
        "mfu": run.get("throughput", "mfu"),
        "device_peak_gib": run.get("memory", "max", "device_peak_allocated_gib"),
        "host_peak_gib": run.get("memory", "max", "host_peak_rss_gib"),
        "predicted_gib": None,
        "predicted_error": None,
        "train_loss": run.get("summary", "train_loss"),
        "eval_loss": run.get("summary", "eval_loss"),
        "task_metric": _task_metric(run),
        "task_short": _task_metric(run, short=True),
        "wall_s": _wall_s(run),
        "train_s": run.get("summary", "train_s"),
        "cost_per_mtok": None,
        "speedup": None,
        "memory_ratio": None,
        "memory_basis": None,
        "peak_gib": row_peak(run),
        "scaling_efficiency": None,
        "error": _error_of(run),
    }


def _unrecorded(run: Run, row: dict) -> dict[str, str]:
    """Why the record lacks a section or figure a cell reads."""
    why: dict[str, str] = {}
    if row["precision"] is None:
        why["precision"] = "no precision section in the record (written before it existed, or failed before Trainer)"
    why.update(speed_gaps(run.get("speed")))
    if row["mfu"] is None:
        why["mfu"] = run.get("throughput", "mfu_note") or "not recorded"
    if row["device_peak_gib"] is None:
        why["device_peak_gib"] = (
            "no accelerator memory on a CPU run" if run.get("hardware", "device_type") == "cpu" else "not recorded"
        )
    return why


def _fill_prediction(row: dict, run: Run, why: dict) -> None:
    predicted = run.get("predicted_memory")
    if not predicted:
        why["predicted_gib"] = why["predicted_error"] = "no prediction in the record"
        return
    side = "device" if predicted.get("device") else "host"
    errors = predicted.get("error") or {}
    if side == "device":  # allocated against the measured allocated peak (older records: total)
        dev = predicted["device"]
        row["predicted_gib"] = dev.get("allocated_gib", dev.get("total_gib"))
        row["predicted_error"] = (errors.get("device_allocated") or errors.get("device") or {}).get("relative_error")
    else:
        row["predicted_gib"] = (predicted.get("host") or {}).get("total_gib")
        row["predicted_error"] = (errors.get("host") or {}).get("relative_error")
    row["predicted_side"] = side


def _fill_cost(row: dict, run: Run, price: float | None, why: dict) -> None:
    tokens, train_s, devices = run.get("summary", "total_trained_tokens"), row["train_s"], row["devices"]
    if price is None:
        why["cost_per_mtok"] = "no --gpu-hour-price given"
    elif not (tokens and train_s and devices):
        why["cost_per_mtok"] = "needs trained tokens, training time and devices (run not completed?)"
    else:
        row["cost_per_mtok"] = price * devices * (train_s / 3600) / (tokens / 1e6)


def _fill_against_baseline(row: dict, run: Run, base: Run | None, why: dict) -> None:
    """Speedup and memory ratio against the baseline."""
    if base is None:
        why["speedup"] = why["memory_ratio"] = "no baseline among the runs"
        return
    other = comparable.other_work(run, base) if run is not base else None
    if other:  # another model, data or task: its speed and memory are not this run's to be measured against
        why["speedup"] = why["memory_ratio"] = f"the baseline is not comparable: {other}"
        row["peak_gib"] = row_peak(run)
        return
    tps, base_tps = row["tokens_per_s"], base.get("throughput", "trained_tokens_per_s")
    if tps is not None and base_tps:
        row["speedup"] = tps / base_tps
    else:
        why["speedup"] = "no tokens/s recorded" + (" for the baseline" if not base_tps else "")
    mine, theirs, basis = memory_pair(run, base)
    row["peak_gib"], row["memory_basis"] = mine, basis
    if mine is not None and theirs:
        row["memory_ratio"] = mine / theirs
    else:
        why["memory_ratio"] = "no memory peak recorded"


def _fill_scaling(row: dict, run: Run, runs: list[Run], base: Run | None, why: dict) -> None:
    """Scaling efficiency against the single-device run of the same method."""
    single, none = same_method_single(run, runs, base)
    tps, n = row["tokens_per_s"], row["devices"]
    if single is None:
        why["scaling_efficiency"] = none
    elif tps is None or not n:
        why["scaling_efficiency"] = "no tokens/s recorded"
    else:
        row["scaling_efficiency"] = tps / (n * single.get("throughput", "trained_tokens_per_s"))
        row["scaling_reference"] = single.label


def _wall_s(run: Run) -> float | None:
    """summary.wall_s; a resumed run's every segment's (summary.run_wall_s) when its segments were timed."""
    whole = run.get("summary", "run_wall_s") if run.get("summary", "resumed_from") else None
    return whole if whole is not None else run.get("summary", "wall_s")


def _task_metric(run: Run, *, short: bool = False) -> str | None:
    ev = run.get("eval") or {}
    metric = ev.get("metric")
    after = ev.get(f"{metric}_after") if metric else None
    if after is None:
        return None
    before = ev.get(f"{metric}_before")
    if short:
        return f"{after:.1%}" + (f" ({before:.1%} before)" if before is not None else "")
    total = ((ev.get("details") or {}).get("after") or {}).get("total")
    text = f"{metric} {after:.1%}" + (f" (before {before:.1%})" if before is not None else "")
    return text + (f" of {total}" if total else "")


def loss_curve(run: Run) -> tuple[list[int], list[float]]:
    """(cumulative trained tokens at each logged step, loss logged there). steps[].trained_tokens
    is the count since the previous log (summed over ranks; finetune/training/trainer.py), so it is summed
    here; loss is Trainer's mean over those steps."""
    xs, ys, total = [], [], 0
    for step in run.get("steps", default=[]):
        total += step.get("trained_tokens") or 0
        if step.get("loss") is not None:
            xs.append(total)
            ys.append(step["loss"])
    return xs, ys


# The run record's `speed` section (docs/run_record.md) as short comparison cells: each cell's subsection and the
# fields it reads there, `?` after those a run may record as null (a record written before one of them existed, or
# with a null where a value goes, gives that cell n/a, and why).
SPEED_READS = {
    "layout": ("name", "packing_algorithm?", "pad_to_multiple_of?"),
    "loss_impl": ("resolved", "requested"),
    "attention": ("implementation", "sdpa_backends_policy"),
    "compile": ("enabled", "mode?"),
    "liger": ("layer_kernels", "fused_linear_cross_entropy"),
}
SPEED_KEYS = tuple(SPEED_READS)
SPEED_LAYOUTS = {"padded": "padded", "padding_free": "padding-free", "packing": "packing"}


def speed_gaps(sp: dict | None) -> dict[str, str]:
    """Why each speed cell the record cannot give is n/a: no speed section, or a field its cell reads missing."""
    older = "in the record (written by an older finetune)"
    if not sp:
        return dict.fromkeys(SPEED_KEYS, f"no speed section {older}")
    gaps = {}
    for key, fields in SPEED_READS.items():
        part = sp.get(key) or {}
        lacking = [
            f.rstrip("?") for f in fields if (f.rstrip("?") not in part if f.endswith("?") else part.get(f) is None)
        ]
        if lacking:
            gaps[key] = f"no speed.{key}.{', '.join(lacking)} {older}"
    return gaps


def speed_cells(sp: dict | None) -> dict:
    """layout (+ packing algorithm, bucketing), the loss that ran (`(auto)` when auto chose it),
    attention implementation/SDPA policy, compile, Liger; None where speed_gaps says why."""
    gaps = speed_gaps(sp)
    return {key: None if key in gaps else SPEED_CELLS[key](sp[key]) for key in SPEED_KEYS}


def _layout(layout: dict) -> str:
    return (
        SPEED_LAYOUTS.get(layout["name"], layout["name"])
        + (" (BFD)" if layout["packing_algorithm"] == "best_fit_decreasing" else "")
        + (f", x{layout['pad_to_multiple_of']} tokens" if layout["pad_to_multiple_of"] else "")
    )


def _attention(attn: dict) -> str:
    policy = attn["sdpa_backends_policy"]
    if attn["implementation"] != "sdpa":
        return attn["implementation"]
    return f"sdpa/{policy if isinstance(policy, str) else '+'.join(policy)}"


def _liger_kernels(liger: dict) -> tuple:
    return ("layers", liger["layer_kernels"]), ("fused loss", liger["fused_linear_cross_entropy"])


SPEED_CELLS = {
    "layout": _layout,
    "loss_impl": lambda loss: loss["resolved"] + (" (auto)" if loss["requested"] == "auto" else ""),
    "attention": _attention,
    "compile": lambda c: f"on ({c['mode'] or 'default'})" if c["enabled"] else "off",
    "liger": lambda liger: " + ".join(k for k, on in _liger_kernels(liger) if on) or "off",
}
