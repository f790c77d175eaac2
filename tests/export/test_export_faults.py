"""Damaged saves injected into real runs (finetune/training/fault_injection.py export_* drills; docs/faults.md
"Drills"), each caught by the run's own check and named: the run ends `failed` with the problem in run.json
`export.check` and `summary.error`, the trained weights in a complete checkpoint of the final step, exit non-zero.
And the recipe route to a merged model (`run.export: merged`) with the stream check, and a missing shard in
`finetune export`'s own folder. Every run: the tiny random Llama on the demo data, 2 steps; the runs go two at a time
(tests/training/test_faults.py in_lanes): one module fixture runs them, each test raises its own run's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, launch_train, short_demo
from tests.training.test_faults import LANES_TIMEOUT, in_lanes, outcome_of

pytestmark = pytest.mark.integration


def _args(tiny_model_dir, *extra) -> list[str]:
    return short_demo(tiny_model_dir, 2, "--training.per_device_train_batch_size=4", *extra)


def _single(tmp_path, tiny_model_dir, fault: str | None, *extra):
    env = {"FINETUNE_FAULT_INJECT": fault} if fault else {}
    return launch_train(
        _args(tiny_model_dir, *extra),
        run_dir=tmp_path / "run",
        cwd=REPO,
        config_file="accelerate_configs/single_gpu.yaml",
        env=env,
        timeout=420,
    )


def _assert_caught(run, *named: str) -> dict:
    """The run failed on the check, every `named` text among its problems, the weights in checkpoint-2."""
    from finetune.checkpointing import checkpoints

    assert run.returncode != 0, run.explain()
    rec = run.record
    summary, check = rec["summary"], rec["export"]["check"]
    assert summary["status"] == "failed" and "ExportCheckFailed: the saved model failed its check" in summary["error"]
    assert check["passed"] is False, check
    for text in named:
        assert any(text in p for p in check["problems"]), (text, check["problems"])
    ckpt = run.run_dir / "checkpoint-2"
    assert summary["checkpoint"] == str(ckpt) and checkpoints.problem(ckpt) is None, summary
    assert f"the trained weights are saved in the complete checkpoint {ckpt}" in summary["error"]
    return check


def _ungathered(tmp_path, tiny_model_dir):
    """ZeRO-3 with the adapters partitioned (stage3_param_persistence_threshold 0: as a real model's adapters, above
    the shipped 1e5 elements, are): peft's own save_pretrained without gathering writes empty tensors (DeepSpeed
    #7900) and warns; the check names every one, and the reload fails too."""
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "zero3.json").write_text(json.dumps(ds))
    config = (REPO / "accelerate_configs" / "cpu" / "zero3.yaml").read_text()
    (tmp_path / "zero3.yaml").write_text(config.replace("ds_configs/zero3.json", str(tmp_path / "zero3.json")))
    run = launch_train(
        [*_args(tiny_model_dir)[2:], "--recipe", "zero3"],
        run_dir=tmp_path / "run",
        cwd=REPO,
        config_file=str(tmp_path / "zero3.yaml"),
        env={"FINETUNE_CPU_DISTRIBUTED": "1", "FINETUNE_FAULT_INJECT": "export_ungathered@rank0,step2"},
        timeout=600,
    )
    check = _assert_caught(
        run,
        "empty tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: shape [0], the trained one is "
        "[16, 64]",
        "model/ does not load: ",
    )
    assert sum(p.startswith("empty tensor") for p in check["problems"]) == 28, check["problems"]
    assert run.record["strategy"]["evidence"]["zero_stage"] == 3


def _truncated(tmp_path, tiny_model_dir):
    """A full fine-tune whose model.safetensors is cut to half: caught; then `finetune export RUN`, as after any run
    that ended without a good model/, exports the newest complete checkpoint instead, checked."""
    run = _single(tmp_path, tiny_model_dir, "export_truncated@rank0,step2", "--method.name=full")
    _assert_caught(run, "model.safetensors: cannot be read", "model/ does not load: ")
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "export", str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model failed its check in the run (run.json export.check); exporting the newest complete checkpoint" in (
        proc.stdout
    )
    found = json.loads((run.run_dir / "export" / "export.json").read_text())
    assert found["step"] == 2 and found["source"] == f"{run.run_dir / 'checkpoint-2'} (safetensors)", found
    assert found["check"]["passed"] and found["check"]["reference"] == "checkpoint-2 (transformers)", found["check"]


def _zeroed(tmp_path, tiny_model_dir):
    run = _single(tmp_path, tiny_model_dir, "export_zeroed@rank0,step2")
    zeroed = next(line for line in run.stdout.splitlines() if "[fault injection] tensor" in line).split()[3]
    check = _assert_caught(run, f"tensor {zeroed} differs from the trained one: norm 0 saved (all zeros)")
    assert check["kind"] == "reload", check


def _merged_and_shards(tmp_path, tiny_model_dir):
    """`run.export: merged` with `run.verify_export: stream`: model/ read tensor by tensor against the live model, then
    the merged folder in RUN/export, checked by `finetune export`, named in the summary; then `finetune export` of the
    same run into shards, with the last shard deleted before its check: caught, named, the earlier export untouched."""
    run = _single(tmp_path, tiny_model_dir, None, "--run.export=merged", "--run.verify_export=stream")
    assert run.returncode == 0, run.explain()
    exported = run.record["export"]
    assert exported["check"]["kind"] == "stream" and exported["check"]["passed"], exported["check"]
    assert exported["check"]["tensors"] == 28 and exported["check"]["max_tensor_rel_diff"] == 0.0
    merged = exported["merged"]
    assert merged["folder"] == str(run.run_dir / "export") and merged["merged"] and merged["check"]["passed"], merged
    assert f"merged model    {run.run_dir / 'export'}   (export/ verified, reload check" in run.stdout, run.explain()
    before = {p.name: p.read_bytes() for p in (run.run_dir / "export").iterdir()}
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "export", str(run.run_dir), "--merge", "--max-shard-size", "2MB"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "FINETUNE_FAULT_INJECT": "export_missing_shard@rank0,step0"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    deleted = next(line for line in proc.stdout.splitlines() if "[fault injection]" in line).split()[2]
    assert f"{deleted}: listed in model.safetensors.index.json, missing" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in (run.run_dir / "export").iterdir()} == before
    kept = json.loads((run.run_dir / "export.unverified" / "export.json").read_text())
    assert kept["check"]["passed"] is False and len(kept["files"]) > 2, kept


UNGATHERED = "test_an_adapter_saved_without_gathering_zero3_partitions_is_caught"
TRUNCATED = "test_a_truncated_weights_file_is_caught"
ZEROED = "test_a_tensor_zeroed_after_the_save_is_caught_and_named"
MERGED = "test_a_recipe_merges_at_the_end_and_the_stream_check_passes"


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_model_dir):
    def at(scenario):
        return lambda d: scenario(d, tiny_model_dir)

    # one 2-rank launch (its rendezvous port alone), the lanes about equally long
    lanes = [
        [(TRUNCATED, at(_truncated)), (UNGATHERED, at(_ungathered))],
        [(MERGED, at(_merged_and_shards)), (ZEROED, at(_zeroed))],
    ]
    return in_lanes(request, tmp_path_factory, lanes)


@LANES_TIMEOUT
def test_an_adapter_saved_without_gathering_zero3_partitions_is_caught(runs, request):
    outcome_of(runs, request)  # _ungathered


@LANES_TIMEOUT
def test_a_truncated_weights_file_is_caught(runs, request):
    outcome_of(runs, request)  # _truncated


@LANES_TIMEOUT
def test_a_tensor_zeroed_after_the_save_is_caught_and_named(runs, request):
    outcome_of(runs, request)  # _zeroed


@LANES_TIMEOUT
def test_a_recipe_merges_at_the_end_and_the_stream_check_passes(runs, request):
    outcome_of(runs, request)  # _merged_and_shards
