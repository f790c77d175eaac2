"""Derived comparison columns on hand-written records: the cases the CPU runs cannot produce
(device memory, a recorded memory prediction, a same-method single-device run to scale against).
Expected values are worked out by hand from the numbers written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.compare import plots
from finetune.compare import table as comparison


def record(
    name: str,
    *,
    strategy: str,
    method: str,
    world: int,
    tps: float,
    device_gib: float | None,
    host_gib: float,
    train_s: float = 100.0,
    tokens: int = 50_000,
    predicted: dict | None = None,
) -> dict:
    return {
        "schema": 1,
        "run_name": name,
        "recipe": "demo",
        "config": {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "logging": {"report_to": []}},
        "hardware": {"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3"},
        "strategy": {"name": strategy, "method": method, "world_size": world, "offload": "none"},
        "batch": {"effective": 16},
        "lr": {"applied": 2e-4},
        "memory": {"max": {"device_peak_allocated_gib": device_gib, "host_peak_rss_gib": host_gib}},
        "predicted_memory": predicted,
        "throughput": {"trained_tokens_per_s": tps, "trained_tokens_per_s_per_device": tps / world, "mfu": 0.3},
        "steps": [{"step": 1, "loss": 2.0, "trained_tokens": 1000}, {"step": 2, "loss": 1.5, "trained_tokens": 1200}],
        "summary": {
            "status": "completed",
            "train_loss": 1.7,
            "eval_loss": None,
            "total_trained_tokens": tokens,
            "wall_s": train_s + 30,
            "train_s": train_s,
        },
        "eval": {},
    }


PREDICTED = {
    "strategy": "ddp",
    "method": "lora",
    "world_size": 2,
    "device": {
        "components_gib": {"weights": 2.0, "gradients": 0.5, "optimizer": 1.0, "activations": 3.0},
        "allocated_gib": 6.5,
        "reserved_gib": 6.9,
        "total_gib": 7.4,
    },
    "host": {"components_gib": {"process": 1.0}, "total_gib": 1.0},
    "assumptions": {},
    "error": {
        "device_allocated": {"predicted_gib": 6.5, "measured_gib": 6.0, "relative_error": 0.0833},
        "device_reserved": {"predicted_gib": 6.9, "measured_gib": 7.0, "relative_error": -0.0143},
        "host": {"predicted_gib": 1.0, "measured_gib": 2.0, "relative_error": -0.5},
    },
}
# the shape records had before issue 13 (device total compared with allocated): still read
PREDICTED_BEFORE_13 = {
    **PREDICTED,
    "device": {"components_gib": PREDICTED["device"]["components_gib"], "total_gib": 6.5},
    "error": {
        "device": {"predicted_gib": 6.5, "measured_gib": 6.0, "relative_error": 0.0833},
        "host": PREDICTED["error"]["host"],
    },
}


@pytest.fixture
def runs(tmp_path) -> list[comparison.Run]:
    recs = [
        record("base", strategy="single", method="qlora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0),
        record("lora1", strategy="single", method="lora", world=1, tps=1500.0, device_gib=8.0, host_gib=3.0),
        record(
            "ddp", strategy="ddp", method="lora", world=2, tps=2400.0, device_gib=6.0, host_gib=2.0, predicted=PREDICTED
        ),
        record("zero3", strategy="zero3", method="full", world=2, tps=900.0, device_gib=None, host_gib=6.0),
    ]
    return _write(tmp_path, recs)


def test_derived_columns(runs):
    table = comparison.build_table(runs, gpu_hour_price=3.0)
    rows = {row["run"].removesuffix(" [baseline]"): row for row in table.rows}
    assert table.baseline.label == "base"
    ddp = rows["ddp"]
    assert ddp["speedup"] == pytest.approx(2.4)  # 2400 / 1000
    assert ddp["memory_ratio"] == pytest.approx(1.5) and ddp["memory_basis"] == "device"  # 6 / 4 GiB
    assert ddp["scaling_efficiency"] == pytest.approx(0.8)  # 2400 / (2 x 1500), the single LoRA run
    assert ddp["scaling_reference"] == "lora1"
    # 3 USD x 2 devices x 100/3600 h / 0.05 M tokens
    assert ddp["cost_per_mtok"] == pytest.approx(3 * 2 * (100 / 3600) / 0.05)
    assert ddp["predicted_gib"] == 6.5 and ddp["predicted_error"] == pytest.approx(0.0833)
    # No device figure on one side: the ratio falls to host RSS and says so (6 / 3 GiB).
    assert rows["zero3"]["memory_ratio"] == pytest.approx(2.0) and rows["zero3"]["memory_basis"] == "host"
    assert rows["zero3"]["scaling_efficiency"] is None
    assert table.notes[3]["scaling_efficiency"] == "no single-device full run among the runs"
    assert rows["base"]["scaling_efficiency"] == pytest.approx(1.0)
    assert table.cell(2, "memory_ratio") == "1.50 (device)" and table.cell(2, "mfu") == "30.0%"
    assert rows["base"]["predicted_gib"] is None and table.notes[0]["predicted_gib"] == "no prediction in the record"


def test_no_price_means_no_cost(runs):
    table = comparison.build_table(runs)
    assert all(row["cost_per_mtok"] is None for row in table.rows)
    assert table.notes[0]["cost_per_mtok"] == "no --gpu-hour-price given"


def test_a_prediction_written_before_issue_13_is_still_read(tmp_path):
    rec = record(
        "old",
        strategy="ddp",
        method="lora",
        world=2,
        tps=2400.0,
        device_gib=6.0,
        host_gib=2.0,
        predicted=PREDICTED_BEFORE_13,
    )
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run.json").write_text(json.dumps(rec))
    row = comparison.build_table(comparison.load_runs([tmp_path / "old"])).rows[0]
    assert row["predicted_gib"] == 6.5 and row["predicted_error"] == pytest.approx(0.0833)


def test_memory_plot_draws_predicted_components_beside_measured(runs, tmp_path):
    table = comparison.build_table(runs)
    path = plots.memory_plot(table, tmp_path / "memory.png")
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plots.memory_figure(table)  # the figure memory_plot saves
    device_ax, host_ax = fig.axes[:2]
    labels = device_ax.get_legend_handles_labels()[1]
    # the components in the plan's groups (weights, gradients, activations; "optimizer" is no planner name)
    assert labels == [
        "measured peak allocated",
        "predicted: weights",
        "predicted: gradients",
        "predicted: other (batch, workspaces, ...)",
        "predicted: activations",
    ]
    # measured: 4, 8, 6 GiB and the CPU-less zero3 run's missing figure drawn as 0; predicted: ddp's components
    heights = sorted(round(p.get_height(), 3) for p in device_ax.patches)
    assert heights == sorted([4.0, 8.0, 6.0, 0.0, 2.0, 0.5, 1.0, 3.0])
    assert "Peak host memory" in host_ax.get_title()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_loss_curve_accumulates_trained_tokens(runs):
    assert comparison.loss_curve(runs[0]) == ([1000, 2200], [2.0, 1.5])


def test_loss_plot_draws_equal_curves_once_naming_every_run(runs):
    import matplotlib.pyplot as plt

    runs[3].record["steps"][1]["loss"] = 1.5 * (1 + 1e-3)  # zero3 differs, far beyond the 1e-5 tolerance
    runs[2].record["steps"][1]["loss"] = 1.5 * (1 + 1e-7)  # ddp: reduction-order noise, the same curve
    fig = plots.loss_figure(comparison.build_table(runs))
    (ax,) = fig.axes
    assert ax.get_legend_handles_labels()[1] == ["base [baseline] = lora1 = ddp (same losses)", "zero3"]
    assert [list(line.get_xdata()) for line in ax.lines] == [[1000, 2200], [1000, 2200]]
    plt.close(fig)


def _write(tmp_path: Path, recs: list[dict]) -> list[comparison.Run]:
    paths = []
    for rec in recs:
        (tmp_path / rec["run_name"]).mkdir()
        (tmp_path / rec["run_name"] / "run.json").write_text(json.dumps(rec))
        paths.append(tmp_path / rec["run_name"])
    return comparison.load_runs(paths)


def _with(
    rec: dict, policy: str | None = "bf16-mixed", effective: int = 16, lr: float = 2e-4, max_length: int = 512
) -> dict:
    rec["batch"]["effective"], rec["lr"]["applied"] = effective, lr
    rec["config"]["data"]["max_length"] = max_length
    if policy is not None:
        rec["precision"] = {
            "policy": policy,
            "requested": policy,
            "family": "torch",
            "load_dtype": "bfloat16",
            "param_dtype": None,
            "compute_dtype": None,
            "optimizer_state_dtype": None,
            "master_weights": None,
            "reduce_dtype": None,
            "observed_compute_dtype": None,
            "warning": None,
            "evidence": None,
        }
    return rec


def test_runs_that_differ_in_precision_batch_lr_or_sequence_length_are_marked_not_comparable(tmp_path):
    base = dict(method="lora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0)
    runs = _write(
        tmp_path,
        [
            _with(record("ref", strategy="single", **base)),
            _with(record("same", strategy="ddp", **{**base, "world": 2})),
            _with(record("true", strategy="zero2", **base), policy="bf16-true"),
            _with(record("batch_lr", strategy="fsdp", **base), effective=32, lr=4e-4),
            _with(record("seq", strategy="single", **base), max_length=256),
            _with(record("old", strategy="single", **base), policy=None),
        ],
    )  # a record from before `precision`
    table = comparison.build_table(runs)
    assert table.baseline is None  # no QLoRA run: the reference is the first run
    rows = {row["run"]: row for row in table.rows}
    assert rows["ref"]["comparable"] == "reference" and rows["same"]["comparable"] == "yes"
    assert rows["true"]["comparable"] == "no: precision.policy"
    assert rows["true"]["differences"] == ["precision.policy 'bf16-true' != 'bf16-mixed'"]
    assert rows["batch_lr"]["comparable"] == "no: batch.effective, lr.applied"
    assert rows["seq"]["comparable"] == "no: data.max_length"
    assert rows["old"]["comparable"] == "no: precision.policy" and rows["old"]["precision"] is None
    i = {row["run"]: n for n, row in enumerate(table.rows)}
    assert table.cell(i["true"], "train_loss") == "1.7000 (not comparable)"  # the losses are marked in the table
    assert table.cell(i["same"], "train_loss") == "1.7000"
    assert table.cell(i["true"], "precision") == "bf16-true" and table.cell(i["old"], "precision") == "n/a"
    warned = [w for w in table.warnings if w.startswith("not comparable")]
    assert warned == [
        "not comparable: data.max_length differs between runs (512: ref, same, true, batch_lr, old; 256: seq)",
        "not comparable: precision.policy differs between runs ('bf16-mixed': ref, same, batch_lr, seq; "
        "'bf16-true': true; None: old)",
        "not comparable: batch.effective differs between runs (16: ref, same, true, seq, old; 32: batch_lr)",
        "not comparable: lr.applied differs between runs (0.0002: ref, same, true, seq, old; 0.0004: batch_lr)",
    ]


def test_runs_of_one_recipe_and_policy_are_comparable_and_warn_nothing(tmp_path):
    base = dict(method="lora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0)
    runs = _write(
        tmp_path,
        [_with(record("a", strategy="single", **base)), _with(record("b", strategy="zero3", **{**base, "world": 2}))],
    )
    table = comparison.build_table(runs)
    assert [row["comparable"] for row in table.rows] == ["reference", "yes"]
    assert not [w for w in table.warnings if w.startswith("not comparable")]


SPEED = {
    "layout": {"name": "packing", "packing_algorithm": "best_fit_decreasing", "pad_to_multiple_of": 256},
    "loss_impl": {
        "requested": "auto",
        "resolved": "chunked",
        "reason": None,
        "chunk_tokens": 256,
        "compact": True,
        "logits_materialised": False,
    },
    "attention": {
        "implementation": "sdpa",
        "sdpa_backends_policy": "auto",
        "sdpa_backends_enabled": ["flash", "efficient", "math"],
        "sdpa_priority": ["flash", "efficient", "math", "cudnn"],
    },
    "compile": {"enabled": True, "mode": "max-autotune", "backend": "inductor"},
    "liger": {"layer_kernels": True, "fused_linear_cross_entropy": False, "version": "0.8.5"},
}


def test_speed_columns_show_the_record_and_say_when_it_is_missing(runs):
    runs[1].record["speed"] = SPEED
    runs[2].record["speed"] = {
        **SPEED,
        "layout": {"name": "padding_free", "packing_algorithm": None, "pad_to_multiple_of": None},
        "loss_impl": {**SPEED["loss_impl"], "requested": "standard", "resolved": "standard"},
        "attention": {**SPEED["attention"], "sdpa_backends_policy": ["flash", "math"]},
        "compile": {"enabled": False, "mode": None, "backend": None},
        "liger": {"layer_kernels": False, "fused_linear_cross_entropy": False, "version": None},
    }
    table = comparison.build_table(runs)
    cells = [
        {k: table.cell(i, k) for k in ("layout", "loss_impl", "attention", "compile", "liger")}
        for i in range(len(runs))
    ]
    assert cells[1] == {
        "layout": "packing (BFD), x256 tokens",
        "loss_impl": "chunked (auto)",
        "attention": "sdpa/auto",
        "compile": "on (max-autotune)",
        "liger": "layers",
    }
    assert cells[2] == {
        "layout": "padding-free",
        "loss_impl": "standard",
        "attention": "sdpa/flash+math",
        "compile": "off",
        "liger": "off",
    }
    assert cells[0]["loss_impl"] == "n/a" and "no speed section" in table.notes[0]["loss_impl"]
    from finetune.compare.report import markdown

    assert "packing (BFD), x256 tokens" in markdown(table, {}, Path("."))  # the full table (the console: headline)


def test_a_speed_section_without_a_field_its_cell_reads_gives_n_a_and_says_which(runs):
    """A record of an older layout: speed without one field (layout.name) or subsection (compile). Before: KeyError
    'layout' from `finetune compare`, a traceback; now that cell alone is n/a, with the missing field named."""
    runs[1].record["speed"] = {**SPEED, "layout": {"packing_algorithm": None, "pad_to_multiple_of": None}}
    runs[1].record["speed"].pop("compile")
    runs[2].record["speed"] = {**SPEED, "loss_impl": {**SPEED["loss_impl"], "resolved": None}}  # null: no value
    table = comparison.build_table(runs)
    assert [table.cell(1, k) for k in ("layout", "loss_impl", "compile")] == ["n/a", "chunked (auto)", "n/a"]
    assert [table.cell(2, k) for k in ("layout", "loss_impl")] == ["packing (BFD), x256 tokens", "n/a"]
    assert table.notes[2]["loss_impl"] == "no speed.loss_impl.resolved in the record (written by an older finetune)"
    assert table.notes[1]["layout"] == "no speed.layout.name in the record (written by an older finetune)"
    assert table.notes[1]["compile"] == "no speed.compile.enabled, mode in the record (written by an older finetune)"


# --- issue 27 item 4: the report leads with the answer -----------------------------------------------------

# every component name the planner writes for a ZeRO-2 LoRA run on a GPU and one on CPU (finetune/planning/memory.py)
MANY = [
    "frozen_weights", "lora_adapters", "master_weights", "optimizer_states", "cublas_workspaces", "batch",
    "activations", "autocast_weight_copies", "loss_buffers", "head_grad", "block_backward_temporaries",
    "rotary_and_targets", "ipg_bucket", "accumulated_grad_partition",
]  # fmt: skip


def six_runs(tmp_path) -> list[comparison.Run]:
    """A five-strategy sweep with its single-device reference, as the README's sweep leaves it."""
    predicted = {**PREDICTED, "device": {**PREDICTED["device"], "components_gib": {n: 0.1 for n in MANY}}}
    recs = [
        record("demo-qlora_baseline", strategy="single", method="qlora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0),
        record("demo-single", strategy="single", method="lora", world=1, tps=1500.0, device_gib=8.0, host_gib=3.0),
        record("demo-ddp", strategy="ddp", method="lora", world=2, tps=2400.0, device_gib=6.0, host_gib=2.0, predicted=predicted),
        record("demo-zero2", strategy="zero2", method="lora", world=2, tps=2300.0, device_gib=5.0, host_gib=2.0, predicted=predicted),
        record("demo-fsdp", strategy="fsdp", method="lora", world=2, tps=2000.0, device_gib=4.5, host_gib=2.0),
        record("demo-zero3_offload", strategy="zero3", method="lora", world=2, tps=600.0, device_gib=2.0, host_gib=9.0),
    ]  # fmt: skip
    recs[-1]["strategy"]["offload"] = "optimizer+params"
    return _write(tmp_path, recs)


def test_the_console_table_leads_with_the_answer_within_120_columns(tmp_path):
    from finetune.compare import report

    table = comparison.build_table(six_runs(tmp_path), gpu_hour_price=2.5)
    text = report.console_table(table)
    lines = text.splitlines()
    table_lines = lines[: lines.index("")]  # the notes below are whole lines, however long
    assert max(len(line) for line in table_lines) <= 120, max(table_lines, key=len)
    assert "scaling efficiency of demo-ddp: against demo-single" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    for name in ("tok/s", "speedup", "dev GiB", "mem ratio", "scaling", "$/1M tok", "comparable"):
        assert name in lines[header], lines[header]
    same = " ".join(lines[:header])  # said once, above the table
    assert same.startswith("same for every run:") and "eff.batch 16" in same and "lr 0.0002" in same
    assert "MFU 30.0%" in same and "mem ratio" not in same and "strategy" not in same
    rows = {line.split()[0]: line for line in lines[header + 2 : header + 8]}
    # 2400/1000; 6/4 GiB; 2400 / (2 x 1500); 2.5 USD x 2 devices x 100/3600 h / 0.05 M tokens = 2.778
    assert rows["demo-ddp"].split()[1:] == ["ddp", "2,400.0", "2.40x", "6.00", "1.50", "80%", "2.778", "yes"]
    # control: the full table, as the console printed it before, is far wider than 120 columns
    cols = table.columns
    full = max(sum(len(table.cell(i, c.key)) + 2 for c in cols) for i in range(len(table.rows)))
    assert full > 200


def test_markdown_and_html_put_the_headline_first_and_the_full_table_below(tmp_path):
    from finetune.compare import report

    table = comparison.build_table(six_runs(tmp_path), gpu_hour_price=2.5)
    md = report.markdown(table, {}, tmp_path)
    tables = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    first = [c.strip() for c in tables[0].strip("|").split(" | ")]
    assert first == report.headline_titles(table) and len(first) == 9
    assert "peak memory per device, GiB (device allocated)" in first
    assert md.index("**Same for every run:**") < md.index(tables[0]) < md.index("## All columns")
    full = [c.strip() for c in md.split("## All columns")[1].splitlines()[2].strip("|").split(" | ")]
    assert full == [c.title for c in table.columns]  # every column, below
    page = report.html_page(table, {})
    assert page.index('<table class="headline">') < page.index("<h2>All columns</h2>")
    assert page.index("Same for every run:") < page.index('<table class="headline">')


def test_the_memory_plot_legend_groups_the_components(tmp_path):
    table = comparison.build_table(six_runs(tmp_path))
    fig = plots.memory_figure(table)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert len(labels) <= 8 and len(MANY) == 14, labels
    assert labels[0] == "measured peak allocated"
    assert sorted(labels[1:]) == sorted(
        f"predicted: {g}"
        for g in ("weights", "master weights", "optimizer states", "gradients", "activations", "loss buffers")
        + ("other (batch, workspaces, ...)",)
    )
    # the grouped bars hold every component: 14 x 0.1 GiB stacked for ddp
    ddp_bars = [p for p in fig.axes[0].patches if abs(p.get_x() + p.get_width() / 2 - (2 + 0.19)) < 0.01]
    assert sum(p.get_height() for p in ddp_bars) == pytest.approx(1.4)
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    handles = fig.axes[0].get_legend_handles_labels()[0]
    rgb = [mcolors.to_rgb((h.patches[0] if hasattr(h, "patches") else h).get_facecolor()) for h in handles]
    assert len(set(rgb)) == len(rgb) and len(set(rgb[0])) == 1, rgb  # the measured bar grey, each entry its own
    greys = [label for label, c in zip(labels[1:], rgb[1:]) if max(c) - min(c) < 0.1]
    assert greys == [], greys  # no component is told from the measured bar by shade alone
    plt.close(fig)


def test_unreadable_runs_are_named_and_the_readable_ones_compared(tmp_path, capsys):
    """Before: one unreadable run.json among good runs refused the whole comparison (exit 2)."""
    from finetune.cli import dispatch

    good = [
        record(n, strategy=s, method="qlora", world=w, tps=t, device_gib=2.0, host_gib=3.0)
        for n, s, w, t in (("base", "single", 1, 1000.0), ("ddp", "ddp", 2, 1800.0))
    ]
    paths = [p.parent for p in (_write_file(tmp_path, r["run_name"], json.dumps(r)) for r in good)]
    broken = _write_file(tmp_path, "broken", '{"schema": 1, "run_name": "broken", "steps": [')
    missing = tmp_path / "gone"
    code = dispatch.main(["compare", *map(str, paths), str(broken.parent), str(missing), "--out", str(tmp_path / "r")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"warning: left out of the comparison: {broken}: not valid JSON (line 1" in err
    assert f"warning: left out of the comparison: {missing}: no such file or directory" in err
    page = (tmp_path / "r" / "report.md").read_text()
    assert f"left out (unreadable): {broken}: not valid JSON" in page and "| ddp" in page and "| base" in page
    # fewer than two readable: exit 2, every problem named, nothing written
    with pytest.raises(SystemExit) as e:
        dispatch.main(["compare", str(paths[0]), str(broken.parent), "--out", str(tmp_path / "r2")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{broken}: not valid JSON" in err and "1 readable run(s) of 2" in err
    assert not (tmp_path / "r2").exists()


def test_one_run_named_several_ways_is_compared_once_and_said(tmp_path, capsys, monkeypatch):
    """Before: `finetune compare single ./single/ single/run.json` compared one run as three ("demo-single (2)",
    "(3)"), silently. Now it is counted once, by its resolved run.json, and a warning names the arguments."""
    from finetune.cli import dispatch

    rec = record("demo-single", strategy="single", method="lora", world=1, tps=1000.0, device_gib=2.0, host_gib=3.0)
    other = record("demo-ddp", strategy="ddp", method="lora", world=2, tps=1800.0, device_gib=2.0, host_gib=3.0)
    for r in (rec, other):
        _write_file(tmp_path, r["run_name"], json.dumps(r))
    monkeypatch.chdir(tmp_path)
    code = dispatch.main(["compare", "demo-single", "./demo-single/", "demo-single/run.json", "demo-ddp", "--out", "r"])
    out, err = capsys.readouterr()
    assert code == 0, err
    said = (
        "demo-single, ./demo-single/ and demo-single/run.json name the same run demo-single "
        f"({tmp_path / 'demo-single' / 'run.json'}): compared once"
    )
    assert f"warning: {said}" in err
    page = (tmp_path / "r" / "report.md").read_text()
    assert said in page and "(2)" not in out + page
    rows = [line.split(" | ")[0] for line in page.split("## All columns", 1)[1].splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| demo-single", "| demo-ddp"]  # after the header: one row per run


def _write_file(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "run.json").write_text(text)
    return tmp_path / name / "run.json"


def test_a_scaling_efficiency_above_100_percent_is_said_to_be_noise(tmp_path):
    from finetune.compare import report

    runs = six_runs(tmp_path)
    ddp = next(r for r in runs if r.label == "demo-ddp")
    ddp.record["throughput"]["trained_tokens_per_s"] = 3450.0  # 3450 / (2 x 1500) = 115%
    lines = report.console_table(comparison.build_table(runs)).splitlines()
    assert "scaling efficiency of demo-ddp: against demo-single; 115% is above 100%: within run-to-run noise" in lines
    assert "scaling efficiency of demo-zero2: against demo-single" in lines  # 77%: said as it is


@pytest.mark.parametrize(
    "edit, named",
    [
        (
            lambda r: r["summary"].update(train_loss="1.7"),
            'summary.train_loss: expected a number or null, got str "1.7"',
        ),
        (lambda r: r["throughput"].update(trained_tokens_per_s="2400"), "throughput.trained_tokens_per_s: expected"),
        (lambda r: r.update(run_name=None), "run_name: expected a string, got null"),
        (lambda r: r.update(run_name=7), "run_name: expected a string, got int 7"),
        (lambda r: r.update(eval={"metric": "exact_match", "exact_match_after": "80%"}), "eval.exact_match_after"),
        (lambda r: r["steps"][1].update(loss="x"), 'steps[1].loss: expected a number or null, got str "x"'),
        (lambda r: r["batch"].update(effective=True), "batch.effective: expected an integer, got bool true"),
    ],
)
def test_a_record_with_a_value_of_another_type_is_left_out_naming_the_field(tmp_path, capsys, edit, named):
    """A run.json edited by hand or damaged: a string where a number goes, a null name. Before: a traceback from
    the table's arithmetic or formatting (TypeError, ValueError), exit 1; now the run is left out, the file and the
    field named, the others compared."""
    from finetune.cli import dispatch

    good = [
        record(n, strategy=s, method="qlora", world=w, tps=t, device_gib=2.0, host_gib=3.0)
        for n, s, w, t in (("base", "single", 1, 1000.0), ("ddp", "ddp", 2, 1800.0))
    ]
    bad = record("edited", strategy="ddp", method="qlora", world=2, tps=2400.0, device_gib=2.0, host_gib=3.0)
    edit(bad)
    paths = [_write_file(tmp_path, f"r{i}", json.dumps(r)) for i, r in enumerate([*good, bad])]
    code = dispatch.main(["compare", *(str(p.parent) for p in paths), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"warning: left out of the comparison: {paths[2]}: {named}" in err, err
    assert "the file was edited or damaged" in err and "Traceback" not in err
    page = (tmp_path / "r" / "report.md").read_text()
    assert "| base" in page and "| ddp" in page and "| edited" not in page


def test_compare_and_sweep_with_an_out_folder_under_a_file_say_so_before_anything_runs(tmp_path, capsys):
    """Before: `finetune compare ... --out notes.txt/report` wrote nothing but ended in a NotADirectoryError
    traceback (exit 1); a sweep found out only after every run, at its comparison."""
    from finetune.cli import dispatch

    good = [
        record(n, strategy=s, method="qlora", world=w, tps=t, device_gib=2.0, host_gib=3.0)
        for n, s, w, t in (("base", "single", 1, 1000.0), ("ddp", "ddp", 2, 1800.0))
    ]
    paths = [str(_write_file(tmp_path, r["run_name"], json.dumps(r)).parent) for r in good]
    user_file = tmp_path / "notes.txt"
    user_file.write_text("the user's")
    for argv in (
        ["compare", *paths, "--out", str(user_file / "report")],
        ["compare", *paths, "--out", str(user_file)],
        ["sweep", "--recipe", "demo", "--strategies", "single", "--cpu", "--out", str(user_file / "sweep")],
    ):
        with pytest.raises(SystemExit) as e:
            dispatch.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{user_file} is a file, not a folder; nothing was changed" in err, err
        assert "Traceback" not in err and user_file.read_text() == "the user's"
