"""Issue 43 items 1-2: a rank imports an optional package only where its run uses it, and a DeepSpeed op build is
announced when it happens, whatever files the cache holds (finetune/training/rank_imports.py). What each launched
strategy had imported at its first step: tests/training/test_strategies.py
test_a_rank_imports_only_the_optional_packages_its_run_uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from finetune.config.recipe import load_recipe
from finetune.training import rank_imports
from tests.conftest import REPO


def _unused(*overrides: str, recipe: str = "demo", env: dict | None = None) -> set[str]:
    cfg, _ = load_recipe(recipe, list(overrides))
    return set(rank_imports.unused(cfg, env or {}))


def test_what_a_run_does_not_use_is_decided_from_its_configuration_and_launcher(tmp_path):
    assert _unused() == {"bitsandbytes", "deepspeed"}  # the demo recipe: LoRA, one process
    assert _unused("--method.name=full") == {"bitsandbytes", "deepspeed"}
    assert _unused("--method.name=qlora") == {"deepspeed"}  # 4-bit weights: bitsandbytes
    assert _unused("--training.optim=paged_adamw_8bit") == {"deepspeed"}  # bitsandbytes' optimizer
    assert _unused("--training.optim=adamw_torch") == {"bitsandbytes", "deepspeed"}
    for recipe in ("ddp", "fsdp", "fsdp_offload"):
        assert "deepspeed" in _unused(recipe=recipe), recipe
    for recipe in ("zero2", "zero3_offload", "zero2_tp", "zero3_sp"):
        assert "deepspeed" not in _unused(recipe=recipe), recipe
    assert "deepspeed" not in _unused(env={"ACCELERATE_USE_DEEPSPEED": "true"})  # the launcher's config set it up
    # a checkpoint saved quantized loads through transformers' quantizer: bitsandbytes stays
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "bitsandbytes" in _unused(f"--model.name_or_path={folder}")
    config = {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}}
    (folder / "config.json").write_text(json.dumps(config))
    assert "bitsandbytes" not in _unused(f"--model.name_or_path={folder}")


IMPORT_RUN = """
import json, sys
from finetune.training import rank_imports
kept_out = rank_imports.keep_out({argv!r})
import finetune.training.run, transformers.trainer, peft  # everything a rank imports before its process group
print(json.dumps({{"kept_out": kept_out, "loaded": rank_imports.loaded()}}))
"""


def _import_run(*argv: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_RUN.format(argv=["--recipe", "demo", *argv])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_lora_run_imports_no_bitsandbytes_and_a_qlora_run_does():
    """At the run's import, as finetune/train.py does it. Before: bitsandbytes in every rank, imported by peft
    (which transformers' Trainer imports). The control: the QLoRA command line, where peft's import brings it."""
    lora = _import_run()
    assert lora["kept_out"] == ["bitsandbytes", "deepspeed"], lora
    assert "bitsandbytes" not in lora["loaded"] and "deepspeed" not in lora["loaded"], lora
    qlora = _import_run("--method.name=qlora")
    assert qlora["kept_out"] == ["deepspeed"] and "bitsandbytes" in qlora["loaded"], qlora


def test_a_command_line_the_run_will_refuse_keeps_nothing_out(capsys):
    def kept_out():
        return {name for name, module in sys.modules.items() if module is None}

    before = kept_out()
    assert rank_imports.keep_out(["--recipe"]) == []  # argparse prints its usage and exits
    assert rank_imports.keep_out(["--recipe", "demo", "--no-such-flag"]) == []
    assert rank_imports.keep_out(["--recipe", "no-such-recipe"]) == []
    assert rank_imports.keep_out(["--recipe", "demo", "--method.name=lorra"]) == []
    assert kept_out() == before
    assert capsys.readouterr() == ("", "")  # the run says what is wrong, once


class SlowBuilder:
    """An op builder whose load() takes `seconds` (a build) or returns at once (a cached op)."""

    def __init__(self, seconds: float, compatible: bool = True):
        self.seconds, self.compatible, self.loads = seconds, compatible, 0

    def is_compatible(self):
        return self.compatible

    def load(self):
        self.loads += 1
        time.sleep(self.seconds)


def test_an_op_load_that_builds_is_announced_whatever_the_cache_holds(tmp_path, monkeypatch, capsys):
    """Before: the notice was skipped when any compiled file existed, so an op built for another Python environment
    was rebuilt silently (25-63 s). Now the op is loaded through DeepSpeed's own builder and a load that outlasts
    the notice delay is said to be a build, on rank 0."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"another environment's build")
    building = SlowBuilder(1.0)
    rank_imports.load_ops(["deepspeed_shm_comm"], notice_s=0.2, builder_for=lambda name: building)
    err = capsys.readouterr().err
    assert building.loads == 1
    assert err.count("DeepSpeed is compiling its deepspeed_shm_comm op") == 1 and str(tmp_path) in err, err

    cached = SlowBuilder(0.0)  # the control: a load that returns at once says nothing
    rank_imports.load_ops(["deepspeed_shm_comm"], notice_s=0.2, builder_for=lambda name: cached)
    time.sleep(0.4)
    assert cached.loads == 1 and capsys.readouterr().err == ""

    incompatible = SlowBuilder(0.0, compatible=False)  # left to DeepSpeed, which does without it
    rank_imports.load_ops(["deepspeed_shm_comm"], notice_s=0.2, builder_for=lambda name: incompatible)
    assert incompatible.loads == 0

    monkeypatch.setenv("RANK", "1")  # the other ranks wait for the same build silently
    rank_imports.load_ops(["cpu_adam"], notice_s=0.2, builder_for=lambda name: SlowBuilder(0.6))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", sorted(rank_imports.OP_BUILDERS))
def test_each_op_is_loaded_with_the_builder_deepspeed_uses(name):
    """deepspeed/comm/torch.py build_shm_op and deepspeed/ops/adam/cpu_adam.py load these builders' ops."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(rank_imports.OP_BUILDERS[name])
    assert builder is not None and builder.name == name


GC_PROBE = """
import gc, json
from finetune.errors import imports_without_gc
states = []
try:
    with imports_without_gc():
        states.append(gc.isenabled())
        made = [[] for _ in range(5000)]
        raise ValueError("an import failed")
except ValueError:
    pass
print(json.dumps({"inside": states[0], "after": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_imports_run_without_the_collector_which_is_on_again_after_them_with_what_they_made_frozen():
    """finetune/errors.py imports_without_gc, also when an import raises (a fresh process: freezing is for good). The
    ranks' own state at their first step: tests/training/test_strategies.py
    test_a_rank_trains_with_the_garbage_collector_on_and_its_imports_frozen."""
    out = subprocess.run([sys.executable, "-c", GC_PROBE], cwd=REPO, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["inside"] is False and got["after"] is True, got
    assert got["frozen"] >= 5000, got  # the lists made inside, and what Python had before


TEARDOWN_PROBE = """
import logging, logging.handlers, sys
from finetune.errors import exit_without_teardown
returned = exit_without_teardown()
log = logging.getLogger("probe")
log.addHandler(logging.handlers.MemoryHandler(100, target=logging.FileHandler(sys.argv[1])))  # writes on close only
log.warning("written before the process ended")
returned.append(7)
sys.exit(returned[0])
"""


def test_an_entry_point_that_returned_ends_with_its_code_and_its_log_handlers_closed(tmp_path):
    """finetune/errors.py exit_without_teardown: os._exit skips the interpreter's teardown, not the exit functions;
    logging's own (registered before it: importing finetune imports logging) is run by it, so a buffering handler
    still writes its records."""
    log = tmp_path / "probe.log"
    out = subprocess.run([sys.executable, "-c", TEARDOWN_PROBE, str(log)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 7, out.stderr
    assert log.read_text() == "written before the process ended\n", out.stderr
