"""Resuming under another launch, without a launch: the plan's refusals and arithmetic
(finetune/checkpointing/resume_plan.py), the data order it relies on (replayed with accelerate's own
samplers), checkpoints moved aside, RNG streams, the record's `resumes` and the preflight refusal
before any process starts. The launches (2 -> 1 and 1 -> 2 per strategy) are in
tests/training/test_strategies.py."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest

from finetune.checkpointing import checkpoints, resume, resume_plan
from finetune.checkpointing import provenance as checkpoint_facts
from finetune.checkpointing.provenance import Written
from finetune.checkpointing.resume_plan import ResumeRequest, plan
from finetune.config.sections import TRAINING_DEFAULTS, TrainingArgs
from finetune.errors import ConfigError, UserError
from tests.conftest import continue_record, save_record

LORA = {"name": "lora", "lora_r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
MODEL = {"name_or_path": "/models/tiny", "revision": None, "config_sha256": "a" * 64}
DATA = {
    "train_rows": 64,
    "fingerprint": "f" * 64,
    "seed": 42,
    "data_seed": None,
    "sampling": "random",
    "drop_last": False,
    "packing": False,
}
TWO_RANK_FILES = ["optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"]


def written(strategy="zero2", world=2, per_device=4, accum=1, step=3, files=TWO_RANK_FILES, **kw) -> Written:
    w = Written(
        checkpoint=f"/runs/x/checkpoint-{step}",
        step=step,
        world_size=world,
        source="marker",
        files=list(files) + (["latest"] if str(strategy).startswith("zero") else []),
        strategy=strategy,
        offload="none",
        per_device=per_device,
        grad_accum=accum,
        effective=None if None in (per_device, accum) else world * per_device * accum,
        method=dict(LORA),
        model=dict(MODEL),
        data=dict(DATA),
    )
    for key, value in kw.items():
        setattr(w, key, value)
    return w


def launch(strategy="zero2", world=1, per_device=4, accum=1, explicit=None, training=None, **kw) -> ResumeRequest:
    base = ResumeRequest(
        strategy=strategy,
        offload="none",
        world_size=world,
        per_device=per_device,
        grad_accum=accum,
        explicit=explicit or {},
        method=dict(LORA),
        model=dict(MODEL),
        data={k: DATA[k] for k in ("seed", "data_seed", "sampling", "drop_last", "packing")},
        training=TrainingArgs.of(training or {}),
    )
    for key, value in kw.items():
        setattr(base, key, value)
    return base


def refusals(w: Written, la: ResumeRequest) -> list[str]:
    with pytest.raises(ConfigError) as err:
        plan(w, la)
    assert "nothing was loaded" in err.value.source
    return err.value.problems


# --- the effective batch: accumulation recomputed ------------------------------------------------


@pytest.mark.parametrize(
    "old, new, explicit, want",
    [
        ((2, 4, 1), (1, 4), {}, (4, 2)),  # 2 ranks x 4 x 1 -> 1 process: accumulation 2 (the case)
        ((1, 4, 2), (2, 4), {}, (4, 1)),  # 1 -> 2
        ((2, 4, 1), (2, 4), {}, (4, 1)),  # same layout
        ((2, 4, 1), (4, 4), {"per_device_train_batch_size": 2}, (2, 1)),  # 2 -> 4 with a smaller per-device batch
        ((2, 4, 1), (1, 4), {"per_device_train_batch_size": 2}, (2, 4)),
        ((4, 2, 1), (1, 8), {}, (2, 4)),  # the checkpoint's per-device batch wins over the recipe's (8)
        ((2, 4, 2), (4, 4), {}, (4, 1)),
    ],
)
def test_accumulation_is_recomputed_to_keep_the_effective_batch(old, new, explicit, want):
    N, B, A = old
    p = plan(written(world=N, per_device=B, accum=A), launch(world=new[0], per_device=new[1], explicit=explicit))
    assert (p.per_device, p.grad_accum) == want
    assert p.world_size * p.per_device * p.grad_accum == N * B * A == p.effective
    assert p.reshard == ("universal" if new[0] != N else "none")
    assert p.layout_changed == ((new[0], *want) != old)


def test_effective_batch_that_cannot_be_kept_is_refused_naming_the_counts_that_can():
    (msg,) = refusals(written(world=2, per_device=4), launch(world=3))
    assert "checkpoint-3 trained at effective batch 8 = 2 rank(s) x 4 per device x accumulation 1" in msg, msg
    assert "3 process(es) x 4 per device cannot make 8 (8/12 is not a whole accumulation)" in msg, msg
    assert "--num_processes 1 or 2" in msg and "--training.per_device_train_batch_size" in msg, msg
    assert resume_plan.allowed_world_sizes(8, 4) == [1, 2]
    assert resume_plan.allowed_world_sizes(16, 2) == [1, 2, 4, 8]
    assert resume_plan.allowed_world_sizes(8, 3) == []  # 3 per device never makes 8


def test_an_explicit_accumulation_that_contradicts_the_effective_batch_is_refused():
    (msg,) = refusals(written(world=2), launch(world=1, explicit={"gradient_accumulation_steps": 1}))
    assert "--training.gradient_accumulation_steps=1 contradicts" in msg and "recomputed, here 2" in msg, msg
    p = plan(written(world=2), launch(world=1, explicit={"gradient_accumulation_steps": 2}))  # agrees: fine
    assert p.grad_accum == 2


# --- strategy family, method, model --------------------------------------------------------------


def test_ddp_on_one_process_is_single_and_one_process_on_many_is_ddp():
    p = plan(written("ddp", world=2), launch("single", world=1))
    assert (p.strategy, p.grad_accum, p.reshard) == ("single", 2, "replicated")
    cfg = resume_plan.applied(p, _cfg("ddp"))
    assert cfg.run.strategy == "single" and cfg.training.args["gradient_accumulation_steps"] == 2
    p = plan(written("single", world=1, accum=2, files=["optimizer.pt", "rng_state.pth"]), launch("ddp", world=2))
    assert (p.strategy, p.grad_accum) == ("ddp", 1)
    cfg = resume_plan.applied(p, _cfg("demo"))
    assert cfg.run.strategy == "ddp"
    # a recipe of another family keeps its own strategy (the plan refused a mismatch already)
    cfg = resume_plan.applied(plan(written(), launch()), _cfg("zero2"))
    assert cfg.run.strategy == "zero2"


def test_the_plan_builds_a_new_configuration_and_leaves_the_one_it_was_given():
    """The resume plan decides before the configuration this launch runs with is built: applied, it
    gives a new configuration whose typed training view has the plan's batch layout; the configuration
    it was given, and the typed view read from it, stay as they were (it used to edit them in place)."""
    given = _cfg("ddp", ["--training.gradient_accumulation_steps=1"])
    before = given.training.typed
    assert (before.per_device_train_batch_size, before.gradient_accumulation_steps) == (
        given.training.args["per_device_train_batch_size"],
        1,
    )
    p = plan(written("ddp", world=2, per_device=4, accum=1), launch("single", world=1, per_device=4))
    now = resume_plan.applied(p, given)
    assert (now.training.typed.per_device_train_batch_size, now.training.typed.gradient_accumulation_steps) == (4, 2)
    assert now.run.strategy == "single" and now.training.args["gradient_accumulation_steps"] == 2
    assert given.training.args["gradient_accumulation_steps"] == 1 and given.run.strategy == "ddp"
    assert given.training.typed is before and before.gradient_accumulation_steps == 1
    # a field the recipe leaves out reads as its default: ours where we choose one, else transformers'
    assert TrainingArgs.of({}).ddp_timeout == TRAINING_DEFAULTS["ddp_timeout"] and TrainingArgs.of({}).data_seed is None


def test_another_family_method_and_model_are_refused_together_naming_what_differs():
    la = launch("fsdp", world=2, method={**LORA, "lora_r": 8}, model={**MODEL, "config_sha256": "b" * 64})
    found = refusals(written("zero3"), la)
    assert len(found) == 3, found
    family, method, model = found
    assert "checkpoint-3 was written by zero3 (2 rank(s)); this launch sets up fsdp" in family, family
    assert "launch with accelerate_configs/zero3.yaml (any --num_processes)" in family, family
    assert "another method (lora_r: 16 in the checkpoint, 8 now)" in method, method
    assert "another model (config_sha256: 'aaaa" in model, model
    refusals(written("zero2"), launch("zero3"))  # ZeRO stages are families of their own
    refusals(written("ddp"), launch("fsdp"))
    assert plan(written("zero2"), launch("zero2", offload="optimizer")).reshard == "universal"  # offload may change


def test_a_moved_copy_of_the_same_base_resumes_and_other_weights_are_refused_by_content():
    """The base folder moved (--model.name_or_path=NEW --allow-config-change): its content fingerprint is the one the
    checkpoint recorded, so the name is no other model (before: refused by name, with no way to resume)."""
    same = {"weights": "w" * 32, "weight_files": {"model.safetensors": "w" * 32}}
    moved = {**MODEL, "name_or_path": "/elsewhere/tiny"}
    assert plan(written("zero2", inputs=dict(same)), launch("zero2", model=moved, inputs=dict(same))).step == 3
    other = {"weights": "v" * 32, "weight_files": {"model.safetensors": "v" * 32}}
    (found,) = refusals(written("zero2", inputs=dict(same)), launch("zero2", model=moved, inputs=other))
    assert "the base weights changed (fingerprint wwwwwwwwwwww -> vvvvvvvvvvvv" in found, found
    (found,) = refusals(written("zero2"), launch("zero2", model=moved))  # no fingerprints: compared by name
    assert "another model (name_or_path: '/models/tiny' in the checkpoint, '/elsewhere/tiny' now)" in found, found


def test_layout_dependent_data_order_is_refused_only_when_the_layout_changes():
    breaking = [
        {"dataloader_drop_last": True},
        {"train_sampling_strategy": "group_by_length"},
        {"train_sampling_strategy": "batch_rebalance"},
        {"ignore_data_skip": True},
        {"auto_find_batch_size": True},
        {"accelerator_config": {"even_batches": False}},
        {"accelerator_config": {"split_batches": True}},
    ]
    for training in breaking:
        (msg,) = refusals(written(world=2), launch(world=1, training=training))
        assert "the layout changes (2 -> 1 process(es))" in msg, msg
        plan(written(world=2), launch(world=2, training=training))  # the same layout: Trainer's own resume
    assert "dataloader_drop_last" in refusals(written(world=2), launch(world=1, training=breaking[0]))[0]


def test_another_seed_is_refused_and_other_data_is_refused_once_built():
    (msg,) = refusals(written(), launch(world=2, data={**launch().data, "seed": 7}))
    assert "training.seed is 7 but checkpoint-3 was trained with 42" in msg and "--training.seed=42" in msg, msg
    p = plan(written(), launch(world=1))
    resume_plan.check_data(p, rows=64, fingerprint="f" * 64)
    with pytest.raises(
        UserError, match=r"the training data differs .*\(64 rows, fingerprint ffffffffffff; now 63 rows"
    ):
        resume_plan.check_data(p, rows=63, fingerprint="e" * 64)


def test_a_checkpoint_without_its_layout_resumes_only_at_its_world_size():
    old = written(
        world=2,
        strategy=None,
        per_device=None,
        accum=None,
        effective=None,
        method=None,
        model=None,
        data=None,
        source="marker (world size only)",
    )
    (msg,) = refusals(old, launch(world=1))
    assert "does not record its batch layout" in msg and "--num_processes 2" in msg, msg
    p = plan(old, launch(world=2, accum=1))
    assert (p.grad_accum, p.position, p.reshard) == (1, None, "none")


# --- data position: samples, and Trainer's arithmetic at the new layout ----------------------------


@pytest.mark.parametrize("rows, step, want", [(64, 3, (0, 24)), (64, 11, (1, 24)), (64, 8, (1, 0)), (60, 9, (1, 8))])
def test_position_is_counted_in_samples(rows, step, want):
    w = written(step=step, data={**DATA, "train_rows": rows})
    for la in (launch(world=1), launch(world=2), launch(world=4, explicit={"per_device_train_batch_size": 2})):
        p = plan(w, la)
        assert (p.position["epoch"], p.position["samples_into_epoch"]) == want
        assert p.position["samples_per_epoch"] == rows


def _order(rows, B, N, A, max_steps, resume_at=0, drop_last=False):
    """Rows per optimizer step, as accelerate 1.15's samplers hand them out and transformers 5.23
    Trainer's resume arithmetic skips them (Trainer.set_initial_training_values, _init_training_state,
    _run_epoch); an independent replay of what the plan relies on."""
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
    from torch.utils.data import BatchSampler

    def per_rank(r, epoch):
        sampler = SeedableRandomSampler(range(rows), data_seed=42)
        sampler.set_epoch(epoch)
        batches = BatchSampler(sampler, B, drop_last)
        return batches if N == 1 else BatchSamplerShard(batches, N, r, even_batches=True)

    len_dl = len(per_rank(0, 0))
    per_epoch = math.ceil(len_dl / A)
    skip = (resume_at % per_epoch) * A
    steps = []
    for epoch in range(resume_at // per_epoch, math.ceil(max_steps / per_epoch)):
        first = epoch == resume_at // per_epoch
        its = [
            iter(list(SkipBatchSampler(per_rank(r, epoch), skip) if first and skip else per_rank(r, epoch)))
            for r in range(N)
        ]
        for u in range(skip // A if first else 0, per_epoch):
            n = A if u < per_epoch - 1 else (len_dl % A or A)
            steps.append(sorted(i for it in its for _ in range(n) for i in next(it, [])))
            if resume_at + len(steps) == max_steps:
                return steps
    return steps


@pytest.mark.parametrize(
    "rows, old, new, steps, at",
    [
        (64, (4, 2, 1), (4, 1, 2), 5, 3),  # the tests' case: 2 ranks -> 1 process
        (64, (4, 1, 2), (4, 2, 1), 5, 3),  # 1 -> 2
        (64, (2, 4, 1), (2, 1, 4), 24, 11),  # 4 -> 1 in the second of three epochs
        (64, (4, 2, 2), (4, 4, 1), 12, 5),  # across an epoch boundary
        (64, (4, 2, 1), (2, 4, 1), 12, 5),  # per-device batch 4 -> 2 on 4 processes
    ],
)
def test_keeping_the_effective_batch_keeps_the_rows_of_every_step(rows, old, new, steps, at):
    """(per-device B, processes N, accumulation A): interrupted at step `at` and resumed under the
    other layout, every later step trains the rows of the uninterrupted run, none twice in an epoch."""
    reference = _order(rows, *old, steps)
    resumed = reference[:at] + _order(rows, *new, steps, resume_at=at)
    assert resumed == reference
    per_epoch = math.ceil(rows / (old[0] * old[1] * old[2]))
    for e in range(0, steps, per_epoch):
        epoch_rows = [i for s in resumed[e : e + per_epoch] for i in s]
        assert len(epoch_rows) == len(set(epoch_rows))
    w = written(step=at, world=old[1], per_device=old[0], accum=old[2], data={**DATA, "train_rows": rows})
    p = plan(w, launch(world=new[1], explicit={"per_device_train_batch_size": new[0]}))
    assert p.grad_accum == new[2]


def test_control_drop_last_loses_the_position_which_is_why_it_is_refused():
    reference = _order(62, 4, 2, 1, 14, drop_last=True)
    resumed = reference[:9] + _order(62, 4, 1, 2, 14, resume_at=9, drop_last=True)
    assert resumed != reference  # the epoch has 7 steps at 2 ranks, 8 at one
    refusals(written(step=9, data={**DATA, "train_rows": 62}), launch(world=1, training={"dataloader_drop_last": True}))


# --- RNG streams ----------------------------------------------------------------------------------


def test_rng_streams_follow_the_rank_number():
    assert [resume_plan.rng_source_file(r, 2) for r in range(3)] == ["rng_state_0.pth", "rng_state_1.pth", None]
    assert [resume_plan.rng_source_file(r, 1) for r in range(2)] == ["rng_state.pth", None]
    assert (plan(written(world=2), launch(world=1)).rng, plan(written(world=2), launch(world=1)).rng_ranks) == (
        "partial",
        [0],
    )
    assert plan(written(world=2), launch(world=2)).rng == "restored"
    one = written("ddp", world=1, accum=2, files=["rng_state.pth"])
    assert (plan(one, launch("ddp", world=2)).rng, plan(one, launch("ddp", world=2)).rng_ranks) == ("partial", [0])
    assert plan(written(world=2, files=[]), launch(world=1)).rng == "fresh"


def test_rng_restore_continues_the_saved_stream(tmp_path):
    import numpy as np
    import torch

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
        tmp_path / "rng_state_1.pth",
    )
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    assert resume_plan.restore_rng(tmp_path, rank=1, old_world_size=2) == "rng_state_1.pth"
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    assert resume_plan.restore_rng(tmp_path, rank=2, old_world_size=2) is None  # no old rank 2: keeps its state


# --- checkpoints moved aside, never deleted ---------------------------------------------------------


def _checkpoint(run_dir: Path, step: int, complete=True) -> Path:
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (ckpt / "rng_state_1.pth").write_bytes(b"x" * 100)
    if complete:
        checkpoints.write_marker(ckpt, step=step, world_size=2, run={"world_size": 2})
    return ckpt


def test_newer_checkpoints_are_moved_aside_not_deleted(tmp_path):
    for step, complete in ((3, True), (5, True), (6, False)):
        _checkpoint(tmp_path, step, complete)
    (tmp_path / "checkpoint-5.universal").mkdir()
    (tmp_path / "checkpoint-5.superseded-1").mkdir()  # an earlier resume's
    files_before = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    moved = checkpoints.move_aside_newer(tmp_path, 3)
    assert moved == [("checkpoint-5", "checkpoint-5.superseded-2"), ("checkpoint-6", "checkpoint-6.superseded-1")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-3",
        "checkpoint-5.superseded-1",
        "checkpoint-5.superseded-2",
        "checkpoint-5.universal.superseded-2",
        "checkpoint-6.superseded-1",
    ]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files_before  # nothing deleted
    assert checkpoints.checkpoints(tmp_path) == [tmp_path / "checkpoint-3"]
    assert checkpoints.read_marker(tmp_path / "checkpoint-3")["run"] == {"world_size": 2}
    newest = _checkpoint(tmp_path, 8)
    (tmp_path / "checkpoint-3.universal").mkdir()
    assert checkpoints.rotate(tmp_path, 1, newest) == [tmp_path / "checkpoint-3"]
    assert not (tmp_path / "checkpoint-3.universal").exists()  # derived data goes with its checkpoint
    assert (tmp_path / "checkpoint-5.superseded-2").is_dir()  # superseded ones are never rotated out


# --- the record -------------------------------------------------------------------------------------


def test_resumes_has_one_entry_per_segment_and_an_old_record_is_migrated(tmp_path):
    from finetune.telemetry.record import RunRecord

    old = RunRecord(tmp_path / "run.json", run_name="r", recipe="zero2", config={})
    old.set("strategy", {"name": "zero2", "world_size": 2, "offload": "none"})
    old.set(
        "batch",
        {
            "per_device": 4,
            "grad_accum": 1,
            "data_parallel_size": 2,
            "effective": 8,
            "input_tokens_per_step": None,
            "trained_tokens_per_step": None,
        },
    )
    old.set("steps", [{"step": s, "loss": 1.0} for s in range(1, 6)])
    old.update("summary", status="interrupted")  # written before `resumes` existed: no such section
    save_record(old)
    ckpt = _checkpoint(tmp_path, 3)
    p = plan(written(world=2, step=3), launch(world=1))
    rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="zero2", config={})
    continue_record(rec, tmp_path, ckpt, p)
    rec.set("resumes", resume.noted(rec.view, superseded=["checkpoint-5.superseded-1"]))
    segments = rec.view.get("resumes")
    assert [(s["step"], s["world_size"], s["grad_accum"], s["from"]) for s in segments] == [
        (0, 2, 1, None),
        (3, 1, 2, str(ckpt)),
    ]
    last = segments[-1]
    assert (last["reshard"], last["rng"], last["from_world_size"], last["effective"]) == ("universal", "partial", 2, 8)
    assert last["position"] == {"epoch": 0, "samples_into_epoch": 24, "samples_per_epoch": 64}
    assert last["superseded"] == ["checkpoint-5.superseded-1"] and last["steps_discarded"] == 2
    assert rec.view.get("summary", "resume_history") == [{k: last[k] for k in resume.HISTORY_KEYS}]
    rec.set("resumes", resume.noted(rec.view, universal_cache="c.universal", conversion_s=0.7))
    assert rec.view.get("resumes")[-1]["conversion_s"] == 0.7
    assert resume.keep_previous_record(tmp_path).name == "run.before-resume1.json"  # what the resume replaces
    save_record(rec)
    assert [s["step"] for s in json.loads((tmp_path / "run.before-resume1.json").read_text())["steps"]] == [
        1,
        2,
        3,
        4,
        5,
    ]
    again = RunRecord(tmp_path / "run.json", run_name="r", recipe="zero2", config={})
    continue_record(again, tmp_path, ckpt, plan(written(world=1, accum=2, step=3), launch(world=2)))
    assert [s["world_size"] for s in again.view.get("resumes")] == [2, 1, 2]
    assert again.view.get("summary", "resumes") == 2


def test_the_preemption_command_says_another_gpu_count_is_fine(monkeypatch, tmp_path):
    monkeypatch.setattr(
        "sys.argv", ["/x/finetune/train.py", "--recipe", "zero2", "--training.gradient_accumulation_steps=2"]
    )
    cmd = resume.resume_command(tmp_path, effective=8, per_device=4)
    assert "--training.gradient_accumulation_steps" not in cmd  # recomputed on resume for any count
    assert f"--run.output_dir={tmp_path.resolve()} --resume" in cmd
    assert "on another number of GPUs too: add --num_processes M with M in {1, 2}" in cmd, cmd


def test_the_resume_command_quotes_what_the_user_typed(monkeypatch, tmp_path):
    """A run directory or override with spaces, `#` or quotes: the printed command, pasted into a
    shell, gives train.py the same arguments (it was joined with spaces: `#` started a comment)."""
    import shlex

    run_dir = tmp_path / "my runs #2" / "it's"
    prompt = "--data.system_prompt=Answer: briefly #1"
    monkeypatch.setattr("sys.argv", ["/x/finetune/train.py", "--recipe", "demo", prompt])
    monkeypatch.setenv("FINETUNE_ACCELERATE_CONFIG", str(tmp_path / "a b.yaml"))
    words = shlex.split(resume.resume_command(run_dir))
    assert words[words.index("--config_file") + 1] == str(tmp_path / "a b.yaml")
    assert words[-3:] == [prompt, f"--run.output_dir={run_dir.resolve()}", "--resume"]


# --- facts written into the marker ---------------------------------------------------------------------


def test_data_fingerprint_follows_the_rows_not_the_chunking():
    import datasets
    import pyarrow as pa

    rows = [{"input_ids": list(range(i, i + 5)), "labels": [1] * 5} for i in range(6)]
    one = checkpoint_facts.data_fingerprint(datasets.Dataset.from_list(rows))
    table = pa.concat_tables([pa.Table.from_pylist(rows[:2]), pa.Table.from_pylist(rows[2:])])
    assert checkpoint_facts.data_fingerprint(datasets.Dataset(table)) == one
    assert checkpoint_facts.data_fingerprint(datasets.Dataset.from_list(rows[::-1])) != one  # the order counts
    assert checkpoint_facts.data_fingerprint(datasets.Dataset.from_list(rows[:5])) != one


def _cfg(recipe: str, overrides=()):
    from finetune.config.recipe import load_recipe

    return load_recipe(recipe, list(overrides))[0]


def _fake_run(tmp_path: Path, tiny: Path, strategy: str, world: int, **facts) -> Path:
    """A run directory whose checkpoint-3 says it was written by `strategy` on `world` ranks."""
    cfg = _cfg(strategy, [f"--model.name_or_path={tiny}", "--training.per_device_train_batch_size=4"])
    run = {
        "world_size": world,
        "strategy": strategy,
        "offload": "none",
        "per_device": 4,
        "grad_accum": 1,
        "effective": 4 * world,
        "method": checkpoint_facts.method_identity(cfg.method),
        "model": checkpoint_facts.model_identity(cfg.model),
        "data": {**DATA, "train_rows": 800},
        **facts,
    }
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    for name in ["trainer_state.json", "latest", *[f"rng_state_{r}.pth" for r in range(world)]]:
        (ckpt / name).write_text("{}")
    checkpoints.write_marker(ckpt, step=3, world_size=world, run=run)
    return tmp_path / "run"


@pytest.fixture
def tiny(tmp_path) -> Path:
    """A model directory (config.json is all the plan reads)."""
    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return path


def test_finetune_train_refuses_another_family_before_any_process_starts(tmp_path, tiny, monkeypatch):
    from finetune import preflight
    from finetune.launch import accelerate as launcher

    monkeypatch.setenv("FINETUNE_CPU_DISTRIBUTED", "1")
    run_dir = _fake_run(tmp_path, tiny, "zero3", 2)
    args = [f"--model.name_or_path={tiny}", "--training.per_device_train_batch_size=4", f"--run.output_dir={run_dir}"]
    fsdp = launcher.launch_command("fsdp", args, "accelerate_configs/cpu/fsdp.yaml", 1, resume="auto")
    with pytest.raises(ConfigError) as err:
        preflight.check_launch(fsdp, resume_check=resume_plan.preflight_problems)
    assert any(
        "checkpoint-3 was written by zero3 (2 rank(s)); this launch sets up fsdp" in p for p in err.value.problems
    )
    zero3 = launcher.launch_command("zero3", args, "accelerate_configs/cpu/zero3.yaml", 1, resume="auto")
    preflight.check_launch(zero3, resume_check=resume_plan.preflight_problems)  # 2 -> 1 under zero3: fine
    three = launcher.launch_command("zero3", args, "accelerate_configs/cpu/zero3.yaml", 3, resume="auto")
    with pytest.raises(ConfigError, match="cannot make 8"):
        preflight.check_launch(three, resume_check=resume_plan.preflight_problems)


def test_finetune_train_accepts_ddp_resumed_on_one_process_as_single(tmp_path, tiny, monkeypatch):
    from finetune import preflight
    from finetune.launch import accelerate as launcher

    monkeypatch.setenv("FINETUNE_CPU_DISTRIBUTED", "1")
    run_dir = _fake_run(tmp_path, tiny, "ddp", 2)
    args = [f"--model.name_or_path={tiny}", "--training.per_device_train_batch_size=4", f"--run.output_dir={run_dir}"]
    one = launcher.launch_command("ddp", args, "accelerate_configs/cpu/ddp.yaml", 1, resume="auto")
    preflight.check_launch(one, resume_check=resume_plan.preflight_problems)
    with pytest.raises(ConfigError, match="meant for strategy 'ddp'.* sets up 'single'"):  # control: a fresh run
        preflight.check_launch(
            launcher.launch_command("ddp", args[:2], "accelerate_configs/cpu/ddp.yaml", 1),
            resume_check=resume_plan.preflight_problems,
        )


def test_universal_cache_counts_only_when_built_from_this_very_checkpoint(tmp_path):
    from finetune.checkpointing import universal

    ckpt = _checkpoint(tmp_path, 3)
    cache = tmp_path / "checkpoint-3.universal"
    assert universal.cache_dir(ckpt) == cache and universal.current(ckpt) is None
    cache.mkdir()
    stamp = checkpoints.read_marker(ckpt)["completed"]
    (cache / universal.MARKER).write_text(json.dumps({"source_completed": stamp}))
    assert universal.current(ckpt) == cache
    assert universal.convert(ckpt) == (cache, None)  # reused: nothing converted
    (cache / universal.MARKER).write_text(json.dumps({"source_completed": "2020-01-01T00:00:00+00:00"}))
    assert universal.current(ckpt) is None  # built from an older checkpoint-3: rebuilt on use


def test_a_folder_in_the_universal_caches_place_that_finetune_did_not_build_is_not_deleted(tmp_path):
    """The conversion replaced whatever stood at checkpoint-N.universal (shutil.rmtree), built or not."""
    from finetune.checkpointing import universal

    ckpt = _checkpoint(tmp_path, 3)
    (ckpt / "latest").write_text("global_step3")
    mine = tmp_path / "checkpoint-3.universal"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="is no universal checkpoint finetune built .* nothing was changed"):
        universal.convert(ckpt)
    assert [p.name for p in mine.iterdir()] == ["notes.md"]


def test_deepspeed_offload_change_goes_through_the_universal_checkpoint_even_at_the_same_world_size():
    assert plan(written("zero2", world=2), launch("zero2", world=2, offload="optimizer")).reshard == "universal"
    assert plan(written("zero2", world=2), launch("zero2", world=2)).reshard == "none"
    assert plan(written("fsdp", world=2), launch("fsdp", world=2, offload="optimizer+params")).reshard == "none"
    old = written(
        world=2, strategy=None, per_device=None, accum=None, effective=None, method=None, model=None, data=None
    )  # a checkpoint without its layout, resumed as it was: drop_last is Trainer's own business
    same = plan(old, launch(world=2, training={"dataloader_drop_last": True}))  # no ConfigError: not a layout change
    assert (same.world_size, same.reshard) == (2, "none")


def test_after_finetune_train_the_resume_command_is_finetune_train_as_typed(monkeypatch, tmp_path):
    """Ctrl-C on `finetune train ...` printed the long `FINETUNE_CPU_DISTRIBUTED=1 accelerate launch
    --config_file ... train.py ...` form; the user's own command, with --resume, is the one to repeat."""
    import shlex

    from finetune.cli import dispatch

    seen = {}
    monkeypatch.setattr(dispatch, "train", lambda *a: seen.setdefault("typed", os.environ[resume.TYPED_ENV]) and 0)
    typed = ["--recipe", "demo", "--cpu", "--run.name=my run #2", "--overwrite", "--resume", "x/checkpoint-2"]
    dispatch.main(["train", *typed, "--training.gradient_accumulation_steps", "2"])
    assert resume.TYPED_ENV not in os.environ  # put back once the command returns
    monkeypatch.setenv(resume.TYPED_ENV, seen["typed"])
    monkeypatch.setenv("FINETUNE_CPU_DISTRIBUTED", "1")
    run_dir = tmp_path / "my run #2"
    command = resume.resume_command(run_dir, effective=8, per_device=4)
    first, hint = command.split("\n")
    assert shlex.split(first) == [
        *["finetune", "train", "--recipe", "demo", "--cpu", "--run.name=my run #2"],
        *[f"--run.output_dir={run_dir.resolve()}", "--resume"],
    ]
    assert "add --num-processes M with M in {1, 2}" in hint
