"""`finetune sweep` and `finetune compare` on real run records, and every kind of bad input.

The main fixture runs a real sweep (`finetune sweep`, one subprocess, as a user would) of the demo
recipe on the tiny random model over two strategies, the single-device QLoRA baseline and FSDP2
(2 processes over gloo), 2 steps, logged to W&B offline (two strategies: each launch costs ~30 s
of start-up on a 2-core machine; DDP and ZeRO are run by the demo sweep in docs/compare.md). Everything else reads the
records, the report and the W&B files it left behind. Expected values come from the run records
and are recomputed here with the definitions in docs/compare.md, never from the code under test.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import compare, dispatch
from finetune.compare import sweep as sweep_lib
from tests.compare.test_compare_columns import record
from tests.wandb_records import read_records, summarize

PRICE = 2.0  # USD per device-hour
STRATEGIES = ("qlora_baseline", "fsdp")
RAN = ("single", *STRATEGIES)  # the sweep adds the one-process LoRA run FSDP's scaling efficiency needs
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("sweep")
    out = base / "out"
    cmd = [
        sys.executable,
        "-m",
        "finetune.cli",
        "sweep",
        "--recipe",
        "demo",
        "--strategies",
        ",".join(STRATEGIES),
        "--cpu",
        "--out",
        str(out),
        "--gpu-hour-price",
        str(PRICE),
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=32",
        "--eval.exact_match=false",
        "--training.max_steps=2",
        "--training.logging_steps=1",
        "--training.warmup_steps=0",
        "--training.per_device_train_batch_size=4",
        "--run.save_model=false",
        "--logging.report_to=[wandb]",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(base), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        cmd, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"sweep timed out\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-6000:]}\n{stderr[-4000:]}"
    records = {name: json.loads((out / name / "run.json").read_text()) for name in RAN}
    return {"out": out, "stdout": stdout, "records": records, "report": out / "report"}


def _table_rows(markdown: str) -> list[list[str]]:
    """The full table (under "## All columns"; the headline table comes first)."""
    full = markdown.split("## All columns", 1)[1]
    lines = [line for line in full.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]


def test_sweep_runs_each_strategy_for_real_with_the_same_batch_and_seed(sweep):
    recs = sweep["records"]
    for name, rec in recs.items():
        assert rec["summary"]["status"] == "completed", (name, rec["summary"])
        assert rec["recipe"] == "demo" and rec["run_name"] == f"demo-{name}"
        assert rec["batch"]["effective"] == 4, (name, rec["batch"])  # the recipe's 4 x 1 x 1 process, kept
        assert rec["config"]["training"]["seed"] == 42
        assert rec["config"]["model"] == recs["qlora_baseline"]["config"]["model"]
    base, fsdp = recs["qlora_baseline"], recs["fsdp"]
    assert base["strategy"]["name"] == "single" and base["strategy"]["method"] == "qlora"
    assert base["config"]["method"]["quant_type"] == "nf4" and base["batch"]["per_device"] == 4
    assert fsdp["strategy"]["name"] == "fsdp" and fsdp["strategy"]["world_size"] == 2
    assert fsdp["strategy"]["method"] == "lora" and fsdp["batch"]["per_device"] == 2
    # FSDP2 really engaged (not Accelerate's silent fall-back to DDP on CPU): sharded DTensor parameters.
    ev = fsdp["strategy"]["evidence"]
    assert fsdp["strategy"]["distributed_type"] == "FSDP" and ev["dtensor_params"] == ev["params"] > 0, ev
    assert all(rec["config"]["method"]["lora_r"] == 16 for rec in recs.values())  # LoRA settings: the recipe's
    for name in RAN:
        assert (sweep["out"] / "logs" / f"{name}.log").stat().st_size > 0


def test_report_table_equals_the_records_and_derived_columns(sweep):
    recs = sweep["records"]
    md = (sweep["report"] / "report.md").read_text()
    header, *rows = _table_rows(md)
    assert len(rows) == 3
    col = {title: i for i, title in enumerate(header)}
    by_run = {row[col["run"]].removesuffix(" [baseline]"): row for row in rows}
    assert by_run.keys() == {f"demo-{n}" for n in RAN}
    assert by_run["demo-qlora_baseline"][col["run"]] == "demo-qlora_baseline [baseline]"
    base = recs["qlora_baseline"]
    for name, rec in recs.items():
        row = by_run[f"demo-{name}"]
        tp, mem, s = rec["throughput"], rec["memory"]["max"], rec["summary"]
        assert row[col["devices (world size)"]] == str(rec["strategy"]["world_size"])
        assert row[col["effective batch (sequences/step)"]] == str(rec["batch"]["effective"])
        assert row[col["trained tokens/s (all devices)"]] == f"{tp['trained_tokens_per_s']:,.1f}"
        assert row[col["trained tokens/s per device"]] == f"{tp['trained_tokens_per_s_per_device']:,.1f}"
        assert row[col["host peak RSS, GiB (max over ranks)"]] == f"{mem['host_peak_rss_gib']:.2f}"
        assert row[col["final train loss (mean over training)"]] == f"{s['train_loss']:.4f}"
        assert row[col["MFU"]] == "n/a" and row[col["peak device memory, GiB (allocated, max over ranks)"]] == "n/a"
        speedup = tp["trained_tokens_per_s"] / base["throughput"]["trained_tokens_per_s"]
        assert row[col["speedup vs baseline (tokens/s)"]] == f"{speedup:.2f}x"
        ratio = mem["host_peak_rss_gib"] / base["memory"]["max"]["host_peak_rss_gib"]
        assert row[col["memory ratio vs baseline"]] == f"{ratio:.2f} (host)"
        cost = PRICE * rec["strategy"]["world_size"] * s["train_s"] / 3600 / (s["total_trained_tokens"] / 1e6)
        assert row[col["cost per 1M trained tokens, USD (training time)"]] == f"{cost:,.4g}"
    # Issue 27 item 4: the sweep named no one-process LoRA run, so it added `single` and FSDP's scaling
    # efficiency is had: its tokens/s over 2 x the single run's (docs/compare.md).
    assert "(added: the single-device reference for scaling efficiency)" in sweep["stdout"]
    single = recs["single"]
    assert single["strategy"]["world_size"] == 1 and single["strategy"]["method"] == "lora"
    scaling = recs["fsdp"]["throughput"]["trained_tokens_per_s"] / (2 * single["throughput"]["trained_tokens_per_s"])
    assert by_run["demo-fsdp"][col["scaling efficiency (vs same-method single device)"]] == f"{scaling:.0%}"
    assert "no single-device lora run among the runs" not in md
    assert "demo-fsdp" in sweep["stdout"] and "speedup" in sweep["stdout"]  # the console table


def test_wandb_comparison_holds_the_record_numbers_and_the_plots(sweep):
    recs = sweep["records"]
    files = list((sweep["report"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((sweep["report"]).rglob("*.wandb"))
    wb = summarize(read_records(files[0]))
    assert wb["run"].run_group == "demo" and wb["run"].job_type == "comparison"
    logged = {k: v for h in wb["history"] for k, v in h.items()}  # nested keys read back as a/b/c
    assert logged["comparison/table/_type"] == "table-file" and logged["comparison/table/nrows"] == 3
    for plot, png in (("loss", "loss_vs_tokens"), ("throughput", "throughput"), ("memory", "memory")):
        assert logged[f"comparison/{plot}/_type"] == "image-file"
        digest = hashlib.sha256((sweep["report"] / f"{png}.png").read_bytes()).hexdigest()
        assert logged[f"comparison/{plot}/sha256"] == digest  # the very PNG of the report
    table = json.loads((files[0].parent / "files" / logged["comparison/table/path"]).read_text())
    col = {c: i for i, c in enumerate(table["columns"])}
    assert len(table["data"]) == 3
    for row in table["data"]:
        name = row[col["run"]].removesuffix(" [baseline]").removeprefix("demo-")
        rec = recs[name]
        assert row[col["trained tokens/s (all devices)"]] == rec["throughput"]["trained_tokens_per_s"]
        assert row[col["host peak RSS, GiB (max over ranks)"]] == rec["memory"]["max"]["host_peak_rss_gib"]
        assert row[col["final train loss (mean over training)"]] == rec["summary"]["train_loss"]
        assert row[col["wall time, s"]] == rec["summary"]["wall_s"]
        assert row[col["speedup vs baseline (tokens/s)"]] == pytest.approx(
            rec["throughput"]["trained_tokens_per_s"] / recs["qlora_baseline"]["throughput"]["trained_tokens_per_s"]
        )


def test_plots_are_real_png_images_and_embedded_in_the_html(sweep):
    from matplotlib import image

    report = sweep["report"]
    page = (report / "report.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == 3
    for name in ("loss_vs_tokens", "throughput", "memory"):
        data = (report / f"{name}.png").read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, (name, len(data))
        pixels = image.imread(report / f"{name}.png")
        assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, pixels.shape
        colors = {tuple(p) for p in pixels[::4, ::4].reshape(-1, pixels.shape[2]).round(2).tolist()}
        assert len(colors) > 20, f"{name}.png looks blank ({len(colors)} colours)"
        assert base64.b64encode(data).decode() in embedded
    assert "![Loss against trained tokens](loss_vs_tokens.png)" in (report / "report.md").read_text()


def test_loss_plot_x_axis_is_cumulative_trained_tokens(sweep):
    from finetune.compare.table import load_runs, loss_curve

    (run,) = load_runs([sweep["out"] / "fsdp"])
    steps = sweep["records"]["fsdp"]["steps"]
    xs, ys = loss_curve(run)
    assert xs == [steps[0]["trained_tokens"], steps[0]["trained_tokens"] + steps[1]["trained_tokens"]]
    assert ys == [steps[0]["loss"], steps[1]["loss"]]


# --- bad input: clear message, exit code, no traceback, nothing written -------------------------


@pytest.fixture(autouse=True)
def _no_wandb_in_process(monkeypatch):
    """The sweep's records say report_to wandb; in-process compares below must not create W&B runs
    (and never online, whatever the developer's environment holds)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")


def _compare(capsys, *args) -> tuple[int, str, str]:
    try:
        code = dispatch.main(["compare", *map(str, args)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _copy_run(sweep, name: str, dest: Path, edit=None) -> Path:
    run = dest / name
    run.mkdir(parents=True)
    rec = copy.deepcopy(sweep["records"][name])
    if edit:
        edit(rec)
    (run / "run.json").write_text(json.dumps(rec))
    return run


def test_directory_without_run_json_is_refused(sweep, tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    code, _, err = _compare(capsys, sweep["out"] / "fsdp", empty, tmp_path / "missing", "--out", tmp_path / "r")
    assert code == 2
    assert f"{empty}: no run.json in this directory" in err and f"{tmp_path / 'missing'}: no such file" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda r: r.update(schema=0), "run record schema 0 is not supported (this finetune reads schema 1)"),
        (lambda r: r.pop("schema"), "run record schema None is not supported"),
        (lambda r: (r.pop("throughput"), r.pop("steps")), "schema-1 record without throughput, steps"),
        (lambda r: r.update(summary="done"), "summary: expected an object, got str"),
    ],
)
def test_older_or_incomplete_records_are_refused(sweep, tmp_path, capsys, edit, expected):
    old = _copy_run(sweep, "fsdp", tmp_path, edit)
    code, _, err = _compare(capsys, old, sweep["out"] / "qlora_baseline", "--out", tmp_path / "r")
    assert code == 2 and f"{old / 'run.json'}: {expected}" in err, err
    assert not (tmp_path / "r").exists()


def test_invalid_json_names_file_and_line(tmp_path, capsys):
    run = tmp_path / "broken"
    run.mkdir()
    (run / "run.json").write_text('{"schema": 1,\n  "run_name": }\n')
    code, _, err = _compare(capsys, run)
    assert code == 2 and f"{run / 'run.json'}: not valid JSON (line 2" in err


def test_different_models_or_data_are_reported_with_a_warning(sweep, tmp_path, capsys):
    other = _copy_run(
        sweep,
        "fsdp",
        tmp_path,
        lambda r: (
            r["config"]["model"].update(name_or_path="other/model"),
            r["config"]["data"].update(demo_train_size=999),
            r["inputs"].update(weights="0" * 32, data="1" * 32),  # other weights and other data: their content
        ),
    )
    code, out, _ = _compare(capsys, sweep["out"] / "qlora_baseline", other, "--out", tmp_path / "r")
    assert code == 0
    # by the content fingerprints the runs record (issue 46): a copy of the same model elsewhere would be the same
    assert "warning: not comparable: inputs.weights differs between runs" in out and "'000000000000'" in out
    assert "warning: not comparable: inputs.data differs" in out
    assert "not comparable: inputs.weights" in (tmp_path / "r" / "report.md").read_text()


def _renamed(name: str, status: str | None = None, error: str | None = None):
    def edit(rec):
        rec["run_name"] = name
        if status:
            rec["summary"].update(status=status, error=error)
        if status == "running":  # what a record holds mid-run: no end-of-run figures yet
            rec["summary"].update(train_loss=None, wall_s=None, train_s=None)
            rec["throughput"] = rec["memory"] = None

    return edit


def test_no_baseline_among_the_runs_is_said_in_the_columns(sweep, tmp_path, capsys):
    other = _copy_run(sweep, "fsdp", tmp_path, _renamed("fsdp-again"))
    code, out, _ = _compare(capsys, sweep["out"] / "fsdp", other, "--out", tmp_path / "r")
    assert code == 0
    assert "baseline: no baseline: none of the runs is a single-device QLoRA run" in out
    md = (tmp_path / "r" / "report.md").read_text()
    header, *rows = _table_rows(md)
    i = header.index("speedup vs baseline (tokens/s)")
    assert [r[i] for r in rows] == ["n/a", "n/a"]
    assert "speedup vs baseline (tokens/s): no baseline among the runs (demo-fsdp, fsdp-again)" in md


def test_explicit_baseline_and_bad_baseline(sweep, tmp_path, capsys):
    out_dir = sweep["out"]
    code, out, _ = _compare(
        capsys, out_dir / "qlora_baseline", out_dir / "fsdp", "--baseline", out_dir / "fsdp", "--out", tmp_path / "r"
    )
    assert code == 0 and "demo-fsdp [baseline]" in out and "1.00x" in out
    code, _, err = _compare(capsys, out_dir / "fsdp", "--baseline", out_dir / "qlora_baseline", "--out", tmp_path / "s")
    assert code == 2 and "not among the runs compared" in err and not (tmp_path / "s").exists()


def test_running_and_failed_runs_are_included_and_marked(sweep, tmp_path, capsys):
    a = _copy_run(sweep, "fsdp", tmp_path / "a", _renamed("still-running", "running"))
    b = _copy_run(sweep, "fsdp", tmp_path / "b", _renamed("crashed", "failed", "RuntimeError: boom"))
    code, out, _ = _compare(capsys, sweep["out"] / "qlora_baseline", a, b, "--out", tmp_path / "r")
    assert code == 0
    assert "warning: still-running: status running; its figures are partial or missing" in out
    assert "crashed failed: RuntimeError: boom" in out
    html = (tmp_path / "r" / "report.html").read_text()
    assert '<tr class="running">' in html and '<tr class="failed">' in html
    header, *rows = _table_rows((tmp_path / "r" / "report.md").read_text())
    running = next(r for r in rows if r[0] == "still-running")
    assert running[header.index("status")] == "running"
    assert running[header.index("trained tokens/s (all devices)")] == "n/a"


def test_existing_report_directory_is_never_overwritten(sweep, tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("mine")
    code, _, err = _compare(capsys, sweep["out"] / "fsdp", "--out", out)
    assert code == 2 and "exists and is not empty; nothing was changed" in err
    assert (out / "report.md").read_text() == "mine"


def test_negative_price_is_refused(sweep, tmp_path, capsys):
    code, _, err = _compare(capsys, sweep["out"] / "fsdp", "--gpu-hour-price", "-1", "--out", tmp_path / "r")
    assert code == 2 and "--gpu-hour-price: must be a non-negative number" in err


# --- sweep planning refusals (nothing runs) -----------------------------------------------------


def _sweep(capsys, tmp_path, *args) -> tuple[int, str]:
    try:
        code = dispatch.main(["sweep", "--recipe", "demo", "--cpu", "--out", str(tmp_path / "sw"), *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


def test_sweep_refuses_unknown_strategy_and_uneven_batch_before_running(tmp_path, capsys):
    code, err = _sweep(capsys, tmp_path, "--strategies", ",,")  # before: "give at least one", naming none
    assert code == 2 and "--strategies: none given; name one or more of single, ddp" in err and "fsdp_offload" in err
    code, err = _sweep(capsys, tmp_path, "--strategies", "ddp,zero9")
    assert code == 2 and "unknown strategy 'zero9'; allowed: single, ddp" in err and "qlora_baseline" in err
    code, err = _sweep(
        capsys, tmp_path, "--strategies", "qlora_baseline,ddp", "--training.per_device_train_batch_size=3"
    )
    assert code == 2 and "ddp: the recipe's effective batch 3" in err and "cannot be kept with 2 processes" in err
    code, err = _sweep(capsys, tmp_path, "--strategies", "ddp", "--run.strategy=fsdp")
    assert code == 2 and "--run.strategy: set by the sweep" in err
    for flag in ("--baseline-strategy", "--baseline"):  # its name, and the old one kept
        code, err = _sweep(capsys, tmp_path, "--strategies", "ddp,fsdp", flag, "zero2")
        assert code == 2 and "--baseline-strategy zero2: name one of the strategies (ddp, fsdp)" in err
    assert not (tmp_path / "sw" / "ddp").exists()


def test_sweep_plan_keeps_recipe_values_and_takes_only_the_strategy(tmp_path):
    from finetune.config.recipe import load_recipe

    plans = {
        p.strategy: p
        for p in sweep_lib.plan(
            "ddp",
            ["qlora_baseline", "single", "zero3_offload"],
            ["--training.gradient_accumulation_steps=2"],
            cpu=True,
            out=tmp_path,
        )
    }
    # recipes/ddp.yaml: 4 per device x 2 accumulation x 2 processes = 16 sequences per step, kept everywhere.
    want = {"qlora_baseline": (1, 8), "single": (1, 8), "zero3_offload": (2, 4)}
    for name, plan in plans.items():
        cfg, _ = load_recipe("ddp", plan.args)
        assert (plan.world_size, cfg.training.args["per_device_train_batch_size"]) == want[name]
        assert cfg.training.args["gradient_accumulation_steps"] == 2 and cfg.training.lr_scaling == "linear"
        assert cfg.run.output_dir == str(tmp_path / name)
    assert load_recipe("ddp", plans["qlora_baseline"].args)[0].method.name == "qlora"
    assert load_recipe("ddp", plans["single"].args)[0].method.name == "lora"
    z3 = load_recipe("ddp", plans["zero3_offload"].args)[0]
    assert (z3.run.strategy, z3.run.offload, z3.method.name) == ("zero3", "optimizer+params", "lora")
    assert plans["zero3_offload"].command()[-len(plans["zero3_offload"].args) - 1] == "--cpu"


def test_shipped_strategy_list():
    assert set(sweep_lib.strategy_names()) == {
        "single",
        "qlora_baseline",
        "ddp",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload",
        "fsdp",
        "fsdp_offload",
    }


@dataclasses.dataclass
class _StandIn(sweep_lib.PlannedRun):
    """A planned run whose training process is replaced by a short script (real runs are the
    fixture's): leaves a given record (or none) in the run directory and exits with a given code."""

    record: dict | None = None
    exit_code: int = 0

    def command(self) -> list[str]:
        src = self.run_dir.parent / f"{self.strategy}.source.json"
        if self.record is not None:
            src.write_text(json.dumps(self.record))
        script = (
            "import os, shutil, sys; os.makedirs(sys.argv[2], exist_ok=True); "
            "print('error: model.name_or_path: no such model', file=sys.stderr) if sys.argv[3] != '0' else None; "
            "shutil.copy(sys.argv[1], os.path.join(sys.argv[2], 'run.json')) if os.path.exists(sys.argv[1]) else None; "
            "sys.exit(int(sys.argv[3]))"
        )
        return [sys.executable, "-c", script, str(src), str(self.run_dir), str(self.exit_code)]


def test_sweep_reports_failed_runs_goes_on_and_exits_non_zero(sweep, tmp_path, tiny_model_dir, capsys):
    """Four planned runs: one dies before writing a record, one records a crash, one completes, one
    completes with another batch than planned. The sweep runs all four in order, reports three
    failures with their errors, compares, and exits 1."""
    out = tmp_path / "sw"
    plans = sweep_lib.plan(
        "demo",
        ["single", "qlora_baseline", "fsdp", "zero2"],
        [f"--model.name_or_path={tiny_model_dir}", "--training.per_device_train_batch_size=4"],
        cpu=True,
        out=out,
    )
    out.mkdir()
    crashed = copy.deepcopy(sweep["records"]["qlora_baseline"])
    crashed["summary"].update(status="failed", error="RuntimeError: boom")
    other_batch = copy.deepcopy(sweep["records"]["fsdp"])
    other_batch["run_name"] = "demo-zero2"
    other_batch["batch"]["effective"] = 8
    given = {
        "single": (None, 2),
        "qlora_baseline": (crashed, 1),
        "fsdp": (sweep["records"]["fsdp"], 0),
        "zero2": (other_batch, 0),
    }
    stand_ins = [
        _StandIn(
            **{f.name: getattr(p, f.name) for f in dataclasses.fields(p)},
            record=given[p.strategy][0],
            exit_code=given[p.strategy][1],
        )
        for p in plans
    ]
    code = compare.run_sweep(stand_ins, out=out, baseline=None, price=None)
    stdout = capsys.readouterr().out
    assert code == 1
    assert [line for line in stdout.splitlines() if line.startswith("=== [")] == [
        "=== [1/4] single ===",
        "=== [2/4] qlora_baseline ===",
        "=== [3/4] fsdp ===",
        "=== [4/4] zero2 ===",
    ]
    assert "sweep: 3 of 4 runs failed: single, qlora_baseline, zero2" in stdout
    assert "demo-single failed: exit 2: error: model.name_or_path: no such model" in stdout
    assert "demo-qlora_baseline [baseline] failed: exit 1: RuntimeError: boom" in stdout
    assert "its status is failed, so the comparisons against it may rest on partial figures" in stdout
    assert "demo-zero2 failed: ran with effective batch 8 on 2 processes, planned 4 on 2: not comparable" in stdout
    assert (out / "logs" / "single.log").read_text().startswith("error: model.name_or_path")
    header, *rows = _table_rows((out / "report" / "report.md").read_text())
    status = {r[0].removesuffix(" [baseline]"): r[header.index("status")] for r in rows}
    assert status == {
        "demo-single": "failed",
        "demo-qlora_baseline": "failed",
        "demo-fsdp": "completed",
        "demo-zero2": "failed",
    }


@dataclasses.dataclass
class _CtrlC(_StandIn):
    """A run during which the user presses Ctrl-C: it sends SIGINT to the sweep alone (a terminal's Ctrl-C reaches the
    foreground job; the sweep's runs are in sessions of their own), then, as `finetune train` does when SIGINT is
    relayed to it, leaves its record `interrupted` and exits 75. Never relayed: it exits 1 after 30 s."""

    def command(self) -> list[str]:
        src = self.run_dir.parent / f"{self.strategy}.source.json"
        src.write_text(json.dumps(self.record))
        script = (
            "import json, os, signal, sys, time\n"
            "def stop(*_):\n"
            "    rec = json.load(open(sys.argv[1]))\n"
            "    rec['summary'].update(status='interrupted', error='preempted by SIGINT at step 1')\n"
            "    os.makedirs(sys.argv[2], exist_ok=True)\n"
            "    json.dump(rec, open(os.path.join(sys.argv[2], 'run.json'), 'w'))\n"
            "    sys.exit(75)\n"
            "signal.signal(signal.SIGINT, stop)\n"
            "print('step 1/8', flush=True)\n"
            "os.kill(os.getppid(), signal.SIGINT)\n"
            "time.sleep(30)\n"
            "sys.exit(1)\n"
        )
        return [sys.executable, "-c", script, str(src), str(self.run_dir)]


def test_a_sweep_stopped_by_ctrl_c_compares_what_ran_and_says_what_did_not(tmp_path, tiny_model_dir, capsys):
    """Before: Ctrl-C during the second run ended the sweep with a KeyboardInterrupt traceback, no comparison and no
    word on what finished; the run in progress went on alone. Now the run is told to stop (one SIGINT relayed), the
    sweep starts no other run, compares the runs that ran, names the completed ones (with the command that compares
    them) and the ones not run, and exits 130."""
    out = tmp_path / "sw"
    plans = sweep_lib.plan(
        "demo", ["single", "ddp", "zero2"], [f"--model.name_or_path={tiny_model_dir}"], cpu=True, out=out
    )
    out.mkdir()

    def rec(p):
        r = record(
            f"demo-{p.strategy}",
            strategy=p.strategy,
            method="lora",
            world=p.world_size,
            tps=900.0,
            device_gib=None,
            host_gib=0.6,
        )
        r["batch"]["effective"] = p.effective
        return r

    kinds = {"single": _StandIn, "ddp": _CtrlC, "zero2": _StandIn}
    stand_ins = [
        kinds[p.strategy](**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}, record=rec(p)) for p in plans
    ]
    try:
        code = compare.run_sweep(stand_ins, out=out, baseline=None, price=None)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the sweep with a KeyboardInterrupt (a traceback), nothing compared")
    stdout = capsys.readouterr().out
    assert code == 130, stdout
    assert "=== [3/3]" not in stdout and not (out / "zero2").exists()
    assert "sweep: SIGINT: ddp is told to stop" in stdout
    assert (
        "sweep: stopped by SIGINT during ddp (exit 75: preempted by SIGINT at step 1); "
        "1 of 3 run(s) completed" in stdout
    )
    assert f"alone: finetune compare {out / 'single'}\n" in stdout
    assert "=== ddp STOPPED: exit 75: preempted by SIGINT at step 1" in stdout and "ddp FAILED" not in stdout
    assert "left to run: ddp, zero2 (the same sweep command with --strategies ddp,zero2 and another --out)" in stdout
    header, *rows = _table_rows((out / "report" / "report.md").read_text())
    assert {r[0]: r[header.index("status")] for r in rows} == {"demo-single": "completed", "demo-ddp": "interrupted"}


def test_a_sweep_adds_the_single_device_run_scaling_efficiency_needs_or_reuses_one(tmp_path):
    """Issue 27 item 4: `finetune sweep --strategies qlora_baseline,ddp,zero2,fsdp` (the README's) named no
    one-process LoRA run, so no LoRA row had a scaling efficiency. The sweep adds `single` (the recipe's
    method, one process) first; a one-process run of that method among the strategies is reused."""

    def planned(names):
        return [(p.strategy, p.world_size, p.added) for p in sweep_lib.plan("demo", names, [], cpu=True, out=tmp_path)]

    readme = planned(["qlora_baseline", "ddp", "zero2", "fsdp"])
    assert readme[0] == ("single", 1, "the single-device reference for scaling efficiency")
    assert [s for s, _, added in readme if added is None] == ["qlora_baseline", "ddp", "zero2", "fsdp"]
    assert planned(["single", "ddp"]) == [("single", 1, None), ("ddp", 2, None)]  # reused, not added
    assert planned(["qlora_baseline"]) == [("qlora_baseline", 1, None)]  # nothing to scale
