"""Issue 29: our per-micro-batch work neither reads the device on the host nor runs a collective; the
ranks agree once per optimizer step. Counted with tests/training/sync_counter.py (host reads and
torch.distributed collectives, attributed to whose code made them), per optimizer step, with the
guard as it was before (TodaysGuard) as the control: it must fail the same bound.

In-process (one rank, CPU): the count does not grow with gradient accumulation. Launched (2 ranks
over gloo, finetune/train.py as users launch it: the session's DDP and ZeRO-2 runs of
tests/training/strategy_runs.py, and the control's own launch): one collective per optimizer step.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_SCRIPT, run_process_group
from tests.training.strategy_runs import COUNTED, CPU_ENV, counts_dir, sync_count_env
from tests.training.strategy_runs import STEPS as STRATEGY_STEPS
from tests.training.sync_counter import SyncCounter, TodaysGuard, per_step

STEPS = 3


def _rows(n: int = 48) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        length = rng.randint(8, 30)
        prompt = rng.randint(2, length - 3)
        ids = [rng.randint(5, 1000) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _count(tiny_model_dir, tmp_path, *, accumulation: int, cls=None, pass_scored: bool = True) -> list:
    """Per optimizer step counts of a ResilientTrainer (or `cls`) with the chunked loss, padding-free."""
    import datasets
    from transformers import TrainerCallback

    from finetune.config.sections import MethodConfig, ModelConfig
    from finetune.config.validate import build_config
    from finetune.data import collate
    from finetune.modeling import loss
    from finetune.modeling.load import load_model, load_tokenizer
    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import Kept, Sinks
    from finetune.training import arguments
    from finetune.training.resilience import ResilientTrainer
    from finetune.training.signals import Stops

    mcfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32")
    model = load_model(mcfg, MethodConfig(name="lora", lora_dropout=0.0))
    assert loss.install(model, "chunked")["compact"]
    args = arguments.build(
        output_dir=str(tmp_path / f"out-{accumulation}"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        logging_steps=100,  # no log window inside the counted steps
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_nan_inf_filter=False,  # as finetune/training/arguments.py for_run sets it
    )
    data = build_config({"data": {"padding_free": True}}).data
    trainer = (cls or ResilientTrainer)(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(_rows()),
        data_collator=collate.make_collator(data, mcfg, load_tokenizer(mcfg).pad_token_id),
        sinks=Sinks(Kept(RunRecord(tmp_path / "run.json", run_name="t", recipe="t", config={}))),
        stops=Stops(),
    )
    trainer._pass_scored = pass_scored
    counter = SyncCounter()

    class Spans(TrainerCallback):
        def on_train_begin(self, *a, **k):
            counter.counts.clear()

        def on_step_end(self, *a, **k):
            counter.mark()

    trainer.add_callback(Spans())
    try:
        with counter:
            trainer.train()
    finally:
        trainer.stops.restore()  # the stop-signal handlers the trainer installed: this process's again
    assert len(counter.spans) == STEPS
    # the last step's agreement: one rank, nothing non-finite, no signal; another step's is refused
    assert trainer.agreement_of(STEPS).rows == [[0.0] * 5]
    with pytest.raises(RuntimeError, match="did not agree on optimizer step 4"):
        trainer.agreement_of(STEPS + 1)
    return counter.spans


def test_our_code_reads_the_host_once_per_optimizer_step_whatever_the_accumulation(tiny_model_dir, tmp_path):
    """One host read per step (the agreement) at 1 and 3 micro-batches per step; the meter counts on
    the host from the CPU batch and the chunked loss gets its scored count from there. Controls: the
    old guard reads every micro-batch's loss (1 + 3 per step), and the loss without the host count
    reads its nonzero() every micro-batch."""
    for accumulation in (1, 3):
        spans = _count(tiny_model_dir, tmp_path, accumulation=accumulation)
        assert per_step(spans, "host sync") == [1] * STEPS, spans
        assert per_step(spans, "collective") == [0] * STEPS, spans  # one process: nothing to agree with
    old = _count(tiny_model_dir, tmp_path, accumulation=3, cls=TodaysGuard)
    assert per_step(old, "host sync") == [1 + 3] * STEPS, old
    unscored = _count(tiny_model_dir, tmp_path, accumulation=3, pass_scored=False)
    assert per_step(unscored, "host sync") == [1 + 3] * STEPS, unscored


# --- launched: 2 ranks, `finetune train`'s run ------------------------------------------------------


UNUSED_WARNING = "find_unused_parameters=True was specified in DDP constructor"


def _ranks(counts: Path, steps: int) -> list[dict]:
    """Each rank's spans and callers, as tests/training/sync_counter.py count_this_rank wrote them."""
    ranks = [json.loads((counts / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert len(r["spans"]) == steps, r
    return ranks


def _ours(rank: dict, kind: str) -> list[int]:
    return [span.get(f"{kind}|finetune", 0) for span in rank["spans"]]


@pytest.mark.parametrize("recipe", COUNTED)
def test_ranks_agree_once_per_optimizer_step(strategy_runs, recipe):
    """2 micro-batches per step on each of 2 ranks (the session's DDP and ZeRO-2 runs, tests/training/
    strategy_runs.py, counted in their ranks): our code runs one collective and one host read per optimizer
    step on each rank (under ZeRO-2 before the boundary micro-batch's backward), the signal flags included;
    DDP's and DeepSpeed's own collectives are theirs (not counted here), and so is Trainer's log, save and
    evaluation window between two steps (counted apart). DDP runs without searching for unused parameters (the
    probe found every LoRA adapter used), so torch does not warn that the search found nothing."""
    run = strategy_runs(recipe)
    record = run.record
    assert record["strategy"]["name"] == recipe and record["strategy"]["world_size"] == 2, record["strategy"]
    assert record["batch"]["grad_accum"] == 2, record["batch"]
    for rank in _ranks(counts_dir(run.run_dir), STRATEGY_STEPS):
        assert _ours(rank, "collective") == [1] * STRATEGY_STEPS, rank
        assert _ours(rank, "host sync") == [1] * STRATEGY_STEPS, rank
    ddp = record["speed"]["ddp"]
    if recipe == "ddp":
        assert (ddp["find_unused_parameters"], ddp["decided_by"], ddp["unused_trainable"]) == (False, "probe", []), ddp
        assert UNUSED_WARNING not in run.stdout + run.stderr
    else:
        assert ddp["find_unused_parameters"] is None and ddp["reason"] == "not DDP", ddp


@pytest.mark.integration
def test_the_old_guard_fails_the_same_count_and_ddp_searching_for_unused_parameters_warns(tmp_path, tiny_model_dir):
    """The control: the guard of commit 0d64d44 all-gathers every micro-batch's flag (2 per step here)
    on top of the step's agreement, so the count that passes above sees 1 + 2 per step. The same
    launch gives DDP find_unused_parameters=True by the recipe (Trainer's default before issue 29):
    torch's warning, absent above, is there."""
    run_dir, counts = tmp_path / "run", tmp_path / "counts"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs/cpu/ddp.yaml"),
        str(TRAIN_SCRIPT),
        "--recipe",
        "ddp",
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=64",
        "--eval.exact_match=false",
        f"--training.max_steps={STEPS}",
        "--training.logging_steps=100",
        "--training.gradient_accumulation_steps=2",
        "--training.per_device_train_batch_size=2",
        "--training.lr_scaling=none",
        "--training.ddp_find_unused_parameters=true",
        "--run.save_model=false",
        f"--run.output_dir={run_dir}",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **CPU_ENV,
        **sync_count_env(counts, control=True),
    }
    code, out, _ = run_process_group(cmd, cwd=REPO, env=env, timeout=420, merge_stderr=True)
    assert code == 0, out[-4000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["strategy"]["name"] == "ddp" and record["strategy"]["world_size"] == 2, record["strategy"]
    for rank in _ranks(counts, STEPS):
        assert _ours(rank, "collective") == [1 + 2] * STEPS, rank
    assert record["speed"]["ddp"]["decided_by"] == "recipe" and UNUSED_WARNING in out
