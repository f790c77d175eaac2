"""compare picks a comparable reference (issue 46): a run is measured (speedup, memory ratio, scaling efficiency)
only against a run of the same work, the same model, data and task by their content fingerprints (run.json
`inputs`), else it says why there is none; a run's exact match is in the headline; a resumed run's wall time is the
whole run's. Run records on disk, compared through `finetune compare` as users run it (`finetune compare runs/*`).
Before: the 1-step run on other data, first in name order, was the scaling reference: 539% "within run-to-run noise".
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.cli import dispatch
from tests.compare.test_compare_columns import record

WEIGHTS, TOKENIZER, TEMPLATE = "a1" * 16, "b2" * 16, "c3" * 16  # xxh3-128 fingerprints: 32 hex digits
DATA, OTHER_DATA = "d4" * 16, "e5" * 16


def fingerprinted(rec: dict, data: str = DATA, steps: int = 40) -> dict:
    rec["inputs"] = {
        "algorithm": "xxh3_128",
        **{"weights": WEIGHTS, "tokenizer": TOKENIZER, "chat_template": TEMPLATE, "data": data},
        "settings": "f6" * 16,
    }
    rec["config"]["data"] = {"path": "shards/*.jsonl" if data == DATA else "other.jsonl", "max_length": 512}
    rec["throughput"]["steps_measured"] = steps
    return rec


def write(runs_dir: Path, recs: list[dict]) -> list[str]:
    for rec in recs:
        (runs_dir / rec["run_name"]).mkdir(parents=True)
        (runs_dir / rec["run_name"] / "run.json").write_text(json.dumps(rec))
    return sorted(str(p) for p in runs_dir.iterdir())  # runs/*: name order


def compare(tmp_path, paths: list[str], capsys) -> str:
    assert dispatch.main(["compare", *paths, "--out", str(tmp_path / "report")]) == 0
    return capsys.readouterr().out


def test_the_scaling_reference_is_a_run_of_the_same_work_not_the_first_single_run(tmp_path, capsys):
    lora = dict(strategy="single", method="lora", world=1, device_gib=8.0, host_gib=3.0)
    paths = write(
        tmp_path / "runs",
        [
            fingerprinted(record("a-quick-try", tps=300.0, **lora), data=OTHER_DATA, steps=0),  # 1 step, other data
            fingerprinted(record("demo-ddp", strategy="ddp", method="lora", world=2, tps=3234.0, device_gib=6.0, host_gib=2.0)),
            fingerprinted(record("demo-single", tps=1500.0, **lora)),
        ],
    )  # fmt: skip
    out = compare(tmp_path, paths, capsys)
    assert "scaling efficiency of demo-ddp: against demo-single" in out, out  # 3234 / (2 x 1500) = 108%
    assert "539%" not in out and "against a-quick-try" not in out, out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "108%" in report, report


def test_with_no_run_of_the_same_work_it_says_why_there_is_no_reference(tmp_path, capsys):
    paths = write(
        tmp_path / "runs",
        [
            fingerprinted(record("a-quick-try", strategy="single", method="lora", world=1, tps=300.0, device_gib=8.0, host_gib=3.0), data=OTHER_DATA),
            fingerprinted(record("demo-ddp", strategy="ddp", method="lora", world=2, tps=3234.0, device_gib=6.0, host_gib=2.0)),
        ],
    )  # fmt: skip
    out = compare(tmp_path, paths, capsys)
    said = "no single-device lora run of the same work: a-quick-try trained another data (inputs.data)"
    assert said in out, out
    assert "scaling efficiency of demo-ddp" not in out, out


def test_a_baseline_of_other_work_gives_no_speedup_and_says_why(tmp_path, capsys):
    paths = write(
        tmp_path / "runs",
        [
            fingerprinted(record("base", strategy="single", method="qlora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0), data=OTHER_DATA),
            fingerprinted(record("ddp", strategy="ddp", method="lora", world=2, tps=2400.0, device_gib=6.0, host_gib=2.0)),
        ],
    )  # fmt: skip
    out = compare(tmp_path, paths, capsys)
    assert "speedup vs baseline (tokens/s): the baseline is not comparable: base trained another data" in out, out
    row = next(line for line in out.splitlines() if line.startswith("ddp "))
    assert "2.40x" not in row, row  # 2400 / 1000: not a speedup of the same work


def test_the_same_weights_under_another_path_are_the_same_model(tmp_path, capsys):
    """By their fingerprints: a copy of the model elsewhere is the same model (by names it was `not comparable`)."""
    lora = dict(method="lora", device_gib=8.0, host_gib=3.0)
    single = fingerprinted(record("single", strategy="single", world=1, tps=1500.0, **lora))
    ddp = fingerprinted(record("ddp", strategy="ddp", world=2, tps=2400.0, **lora))
    ddp["config"]["model"]["name_or_path"] = "/copies/of/m"
    out = compare(tmp_path, write(tmp_path / "runs", [single, ddp]), capsys)
    assert "not comparable" not in out and "scaling efficiency of ddp: against single" in out, out


def test_exact_match_is_in_the_headline_and_a_resumed_run_counts_every_segment(tmp_path, capsys):
    lora = dict(method="lora", device_gib=8.0, host_gib=3.0)
    recs = [
        fingerprinted(record("single", strategy="single", world=1, tps=1500.0, train_s=60.0, **lora)),
        fingerprinted(record("ddp", strategy="ddp", world=2, tps=2400.0, **lora)),
    ]
    for rec, (before, after) in zip(recs, [(0.0, 0.81), (0.0, 0.79)]):
        rec["eval"] = {"metric": "exact_match", "exact_match_before": before, "exact_match_after": after}
    recs[1]["summary"].update(run_wall_s=330.0, resumed_from="runs/ddp/checkpoint-2", resumes=1)  # 130 s this launch
    compare(tmp_path, write(tmp_path / "runs", recs), capsys)
    report = (tmp_path / "report" / "report.md").read_text()
    headline = report[report.index("| run |") :].split("\n\n")[0]
    assert "exact match (before)" in headline.splitlines()[0], headline
    assert "| 81.0% (0.0% before) |" in headline and "| 79.0% (0.0% before) |" in headline, headline
    full = report[report.index("## All columns") :]
    assert "| 330 |" in full and "| 130 |" not in full, full  # the resumed run's wall time: every segment's
