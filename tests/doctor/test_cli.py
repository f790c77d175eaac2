"""`finetune doctor` as typed: --quick on this machine, the report files and the exit code that
follows the problems in them, and options refused (exit 2) before anything is written; the
console and HTML renderings of a report."""

from __future__ import annotations

import json
import os
import sys

import pytest

from finetune.doctor import report
from tests.conftest import REPO, run_process_group


def doctor(*args, tmp_path, timeout=300):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "PYTHONUNBUFFERED": "1"}
    return run_process_group(
        [sys.executable, "-m", "finetune.cli", "doctor", *args], cwd=REPO, env=env, timeout=timeout, merge_stderr=True
    )


def test_quick_writes_the_report_and_its_exit_code_follows_its_problems(tmp_path):
    out = tmp_path / "doc"
    code, stdout, _ = doctor("--quick", "--out", str(out), tmp_path=tmp_path)
    result = json.loads((out / "doctor.json").read_text())
    assert result["mode"] == "quick" and result["strategies"] is None and result["links"] is None
    names = [x["name"] for x in result["lines"]]
    for name in (
        "torch",
        "deepspeed",
        "CUDA",
        "host RAM",
        "disk",
        "accelerate default config",
        "W&B",
        "DeepSpeed CPU Adam",
        "bitsandbytes 4-bit",
    ):
        assert name in names, names
    problems = [x for x in result["lines"] if x["status"] == "problem"]
    assert code == (1 if problems else 0) and result["ok"] == (not problems), stdout
    assert all(x["fix"] for x in problems)
    assert f"wrote {out / 'doctor.json'}" in stdout and (out / "doctor.html").read_text().startswith("<!DOCTYPE html>")
    assert f"none at {tmp_path / 'hf_home' / 'accelerate' / 'default_config.yaml'}" in stdout  # HF_HOME is read


def test_an_out_directory_the_doctor_did_not_make_is_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    code, stdout, _ = doctor("--quick", "--out", str(out), tmp_path=tmp_path)
    assert code == 2 and f"--out {out}: exists and was not made by finetune doctor" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategies", "zero4"], "error: --strategies: unknown zero4"),
        # before: an empty list ran every strategy (the default)
        (["--strategies", ",,"], "error: --strategies ',,': none given; name one or more of single, ddp, zero2,"),
        (["--strategies", ""], "error: --strategies '': none given; name one or more of single, ddp, zero2,"),
        (
            ["--quick", "--override", "zero2:training.learning_rate=1"],
            "error: --strategies, --override and --offload apply",
        ),
        (["--override", "zero2"], "error: --override 'zero2': expected STRATEGY:section.key=value"),
        (["--quick", "--recipe", "zero5"], "--recipe 'zero5': no such file, and no recipe of that name"),
        (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        # before: caught only when ddp's run started, after the environment, the links and single's run (exit 1)
        (
            ["--strategies", "ddp", "--override", "ddp:nosuch.key=1"],
            "error: --override: 1 problem:\n  - ddp (recipe ddp): nosuch: unknown section; allowed: model, method,",
        ),
        (
            ["--strategies", "ddp", "--override", "ddp:training.lr_scaling=bogus"],
            "  - ddp (recipe ddp): training.lr_scaling: got 'bogus'; allowed: none, linear, sqrt",
        ),
    ],
)
def test_bad_options_stop_before_anything_is_written(tmp_path, args, message):
    code, stdout, _ = doctor(*args, "--out", str(tmp_path / "doc"), tmp_path=tmp_path)
    assert code == 2 and message in stdout and not (tmp_path / "doc").exists()


def sample() -> tuple[dict, list[report.Line]]:
    all_lines = [
        report.ok("environment", "torch", "2.13.0"),
        report.skipped("environment", "CUDA", "no CUDA"),
        report.problem("strategies", "zero2 losses", "step 2 loss differs", "finetune compare a b"),
        report.ok("strategies", "zero2 run", "completed in 15 s"),
    ]
    strategies = {
        "description": "10 steps",
        "reference": "single",
        "runs": [
            {
                "name": "single",
                "world_size": 1,
                "engaged": "PeftModelForCausalLM",
                "precision": "32-true (float32 seen)",
                "losses": [10.77, 10.5],
                "memory_text": "host RSS 0.66 / 0.65 GiB (+2%)",
                "seconds": 12.0,
                "returncode": 0,
            },
            {
                "name": "zero2",
                "world_size": 2,
                "engaged": "DeepSpeedEngine ZeRO-2",
                "precision": "32-true (float32 seen)",
                "losses": [10.77, 10.4],
                "comparison": {"max_loss_rel": 9.5e-3, "tolerance": {"loss": 1e-5}},
                "memory_text": "n/a",
                "seconds": 15.0,
                "returncode": 0,
            },
            {"name": "fsdp", "world_size": 2, "returncode": 1, "seconds": 3.0},
        ],
    }
    return report.build(
        "full", "test machine", all_lines, strategies, None, {"total": 30.0}, ["finetune", "doctor"]
    ), all_lines


def test_console_and_page_show_the_table_the_problem_and_its_fix(tmp_path):
    result, all_lines = sample()
    text = report.console(result, all_lines)
    assert "single    1      PeftModelForCausalLM" in text
    assert "9.5e-03 (tol 1e-05)" in text and "did not run (exit 1)" in text
    assert "zero2 run" not in text  # ok strategy lines are in the table, not repeated
    assert text.endswith(
        "1 problem(s) (2 ok, 1 skipped; total 30 s):\n  - strategies / zero2 losses: step 2 loss "
        "differs\n    fix: finetune compare a b"
    )
    paths = report.write(result, all_lines, tmp_path)
    page = paths["html"].read_text()
    assert '<tr class="failed"><td>problem</td><td>zero2 losses</td>' in page and "finetune compare a b" in page
    assert "<td>10.770000</td><td>10.400000</td>" in page  # the per-step loss table
    assert json.loads(paths["json"].read_text())["problems"][0]["fix"] == "finetune compare a b"
