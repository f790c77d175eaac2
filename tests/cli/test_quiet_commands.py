"""Issue 15 item 12: bitsandbytes' CPU-kernel notice ("Failed to load CPU gemm_4bit_forward from
kernels-community: No module named 'kernels'") printed on every command on a CPU with AVX512-BF16.
bitsandbytes is imported by peft on `import peft`, which transformers imports with
TrainingArguments (no switch in either: finetune/__init__.py); the notice is held back unless a
QLoRA run on CPU can use it. Each command runs in a fresh process, as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.compare.test_compare_columns import record
from tests.conftest import REPO

NOTICE = "gemm_4bit_forward"


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.fixture(scope="module")
def notice_shows_here():
    """The control: bitsandbytes prints the notice on import on a CPU with AVX512-BF16 when the
    `kernels` package is missing (bitsandbytes/backends/cpu/ops.py); elsewhere this test could not
    fail, so it is skipped. (Seen here: `python -c "import peft"` prints it.)"""
    import importlib.util

    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16() or importlib.util.find_spec("kernels") is not None:
        pytest.skip("bitsandbytes prints no CPU-kernel notice on this machine; nothing to hold back")


COMMANDS = """
import sys
from finetune.cli import main
for argv in {commands!r}:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    print("AFTER", argv[0], "EXIT", code, "BNB", "bitsandbytes" in sys.modules, flush=True)
"""


def test_commands_print_no_bitsandbytes_notice(notice_shows_here, tmp_path):
    """compare --help, recipes, a comparison and plan, one after another in one process. None of them imports
    bitsandbytes now: plan did, through transformers' TrainingArguments, until it read config.json itself
    (issue 47); it stays in the list so that a plan that brings it back is held to the notice check."""
    dirs = []
    for rec in (
        record("base", strategy="single", method="qlora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0),
        record("ddp", strategy="ddp", method="lora", world=2, tps=2400.0, device_gib=6.0, host_gib=2.0),
    ):
        (tmp_path / rec["run_name"]).mkdir()
        (tmp_path / rec["run_name"] / "run.json").write_text(json.dumps(rec))
        dirs.append(str(tmp_path / rec["run_name"]))
    commands = [
        ["compare", "--help"],
        ["recipes"],
        ["compare", *dirs, "--out", str(tmp_path / "report")],
        ["plan", "--recipe", "demo", "--method.name=lora"],
    ]
    proc = _run(COMMANDS.format(commands=commands), tmp_path)
    out = proc.stdout
    for line in ("AFTER recipes EXIT 0 BNB False", "AFTER plan EXIT 0 BNB False"):
        assert line in out, out[-3000:] + proc.stderr[-3000:]
    assert out.count("AFTER compare EXIT 0 BNB False") == 2, out[-3000:] + proc.stderr[-3000:]
    assert NOTICE not in proc.stderr + out, proc.stderr[-3000:]
