"""The commands that do not train, each in one process as users run them: what they import (issue 43: `--help`,
`recipes`, `plan` and `compare` no torch; `doctor --quick` torch, accelerate, DeepSpeed's op builder and bitsandbytes for its
checks, not transformers or peft), and bitsandbytes' CPU-kernel notice (issue 15 item 12: "Failed to load CPU
gemm_4bit_forward from kernels-community: No module named 'kernels'", printed on import on a CPU with AVX512-BF16)
held back wherever a command imports bitsandbytes (finetune/held_back.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.compare.test_compare_columns import record
from tests.conftest import REPO

NOTICE = "gemm_4bit_forward"
WATCHED = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "wandb", "matplotlib")


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


COMMANDS = """
import json, sys
from finetune.cli import main
for argv in {commands!r}:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    loaded = [name for name in {watched!r} if sys.modules.get(name) is not None]
    print("AFTER", json.dumps({{"command": argv[0], "exit": code, "loaded": loaded}}), flush=True)
"""


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> tuple[dict, str]:
    """--help, compare --help, recipes, plan, a comparison, then doctor --quick, one after another in one process, in
    that order (each command's imports stay for the next): command -> what was imported after it, and the output."""
    tmp_path = tmp_path_factory.mktemp("commands")
    dirs = []
    for rec in (
        record("base", strategy="single", method="qlora", world=1, tps=1000.0, device_gib=4.0, host_gib=3.0),
        record("ddp", strategy="ddp", method="lora", world=2, tps=2400.0, device_gib=6.0, host_gib=2.0),
    ):
        (tmp_path / rec["run_name"]).mkdir()
        (tmp_path / rec["run_name"] / "run.json").write_text(json.dumps(rec))
        dirs.append(str(tmp_path / rec["run_name"]))
    argvs = [
        ["--help"],
        ["compare", "--help"],
        ["recipes"],
        ["plan", "--recipe", "demo", "--method.name=lora"],
        ["compare", *dirs, "--out", str(tmp_path / "report")],
        ["doctor", "--quick", "--out", str(tmp_path / "doctor")],
    ]
    proc = _run(COMMANDS.format(commands=argvs, watched=WATCHED), tmp_path)
    after = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("AFTER ")]
    assert len(after) == len(argvs), proc.stdout[-3000:] + proc.stderr[-3000:]
    return after, proc.stdout + proc.stderr


def test_commands_that_do_not_train_import_no_torch(commands):
    after, out = commands
    assert [a["exit"] for a in after] == [0, 0, 0, 0, 0, 0], out[-3000:]
    # --help, compare --help, recipes, plan (it reads the model's config.json itself, issue 47)
    assert [a["loaded"] for a in after[:4]] == [[], [], [], []], after
    assert after[4]["loaded"] == ["matplotlib"], after  # the comparison draws its figures
    # doctor --quick: torch for the CUDA/GPU lines and the 4-bit round trip (with bitsandbytes), DeepSpeed's op
    # builder for CPU Adam; versions from the packages' metadata (before: transformers and peft imported for them)
    assert after[5]["loaded"] == ["torch", "bitsandbytes", "deepspeed", "matplotlib"], after


@pytest.fixture(scope="module")
def notice_shows_here():
    """Machine-dependent: bitsandbytes prints the notice on import only on a CPU with AVX512-BF16 when the
    `kernels` package is missing (bitsandbytes/backends/cpu/ops.py); elsewhere the next test could not fail and is
    skipped. test_the_notice_is_held_on_any_cpu holds bitsandbytes' own message everywhere."""
    import importlib.util

    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16() or importlib.util.find_spec("kernels") is not None:
        pytest.skip("bitsandbytes prints no CPU-kernel notice on this machine; nothing to hold back")


def test_commands_print_no_bitsandbytes_notice(notice_shows_here, commands):
    """doctor --quick imports bitsandbytes (its 4-bit round trip): the notice was printed then, and is held back."""
    after, out = commands
    assert "bitsandbytes" in after[5]["loaded"], after  # the control: the import that prints it happened
    assert NOTICE not in out, out[-3000:]


HELD = """
import logging, sys
if sys.argv[1] == "finetune":
    import finetune  # installs the filters, as every command's process does
# what bitsandbytes logs on import where it applies (bitsandbytes/backends/cpu/ops.py), from its own logger
logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
    "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you "
    "already `pip install kernels` and the kernels >= 0.11.1"
)
"""


@pytest.mark.parametrize("finetune_imported", [True, False])
def test_the_notice_is_held_on_any_cpu(finetune_imported):
    """The variant of the test above that runs on every CPU: bitsandbytes' message, logged by its own logger in a
    process that imported finetune, is not printed; the control, a process without finetune, prints it."""
    proc = subprocess.run(
        [sys.executable, "-c", HELD, "finetune" if finetune_imported else "plain"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert (NOTICE in proc.stderr) is not finetune_imported, proc.stderr
