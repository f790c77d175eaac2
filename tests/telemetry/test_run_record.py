"""The run record's batch, LR, token and memory figures, checked against independent computations
on real 2-process runs (DDP, ZeRO-2, FSDP2 over gloo: the session's strategy runs,
tests/training/strategy_runs.py) and single-process runs of two model sizes."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.modeling.bundled import save_tiny_llama
from tests.training.strategy_runs import APPLIED_LR, ROWS, SHAPES, STEPS

pytestmark = pytest.mark.integration


def independent_token_counts(run_dir: Path, tokenizer_dir: Path) -> tuple[int, int]:
    """(input tokens, trained tokens) of the whole tokenized training set of that run."""
    from transformers import AutoTokenizer

    from finetune.data.build import build_datasets

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = SimpleNamespace(
        path=str(run_dir / "data" / "train.jsonl"),
        format="auto",
        split="train",
        max_length=128,
        eval_fraction=0.0,
        train_on_prompt=False,
        system_prompt=None,
        chat_template=True,
        packing=False,
        on_bad_rows="error",
        max_samples=None,
    )
    train = build_datasets(cfg, tokenizer, seed=42).train
    assert len(train) == ROWS
    inputs = sum(len(ids) for ids in train["input_ids"])
    trained = sum(sum(1 for x in labels[1:] if x != -100) for labels in train["labels"])  # what the shifted loss scores
    return inputs, trained


@pytest.mark.parametrize("name", list(SHAPES))
def test_batch_lr_tokens_and_memory_per_rank(name, strategy_runs, tiny_model_dir):
    """Each strategy's run (linear, sqrt and no LR scaling; 2 x 2 or 4 x 1 per rank): the batch as configured,
    the rule's factor, the optimizer at the applied rate under the linear decay, and one epoch's tokens
    equal to the whole tokenized training set counted here."""
    per_device, accum, rule, reference, base_lr = SHAPES[name]
    res = strategy_runs(name)
    rec = res.record
    effective = per_device * accum * 2
    assert rec["strategy"]["world_size"] == 2 and rec["strategy"]["name"] == name
    assert rec["batch"] == {
        **rec["batch"],
        "per_device": per_device,
        "grad_accum": accum,
        "data_parallel_size": 2,
        "effective": effective,
    }
    factor = {"linear": effective / (reference or 1), "sqrt": math.sqrt(effective / (reference or 1)), "none": 1.0}
    assert rec["lr"]["rule"] == rule and rec["lr"]["factor"] == pytest.approx(factor[rule])
    assert rec["lr"]["applied"] == pytest.approx(base_lr * factor[rule]) == APPLIED_LR
    # The optimizer ran at the applied rate: the LR Trainer logs for step k is the one its update used
    # (transformers Trainer reads it before the scheduler steps), linear decay from the applied rate with no
    # warmup (get_linear_schedule_with_warmup: (STEPS - (k - 1)) / STEPS).
    steps = rec["steps"]
    assert len(steps) == ROWS // effective == STEPS
    want = [APPLIED_LR * (STEPS - (k - 1)) / STEPS for k in range(1, STEPS + 1)]
    assert [s["lr"] for s in steps] == pytest.approx(want), [s["lr"] for s in steps]

    # One epoch over rows divisible by the global batch: every row trained exactly once, so the
    # totals counted on each rank and summed must equal the whole tokenized set, whatever the order.
    inputs, trained = independent_token_counts(res.run_dir, tiny_model_dir)
    assert rec["summary"]["total_input_tokens"] == inputs
    assert rec["summary"]["total_trained_tokens"] == trained
    assert sum(s["trained_tokens"] for s in steps) == trained

    mem = rec["memory"]
    assert [r["rank"] for r in mem["per_rank"]] == [0, 1]
    assert [r["rank"] for r in mem["loading"]["per_rank"]] == [0, 1]
    for entry in mem["per_rank"] + mem["loading"]["per_rank"]:
        assert entry["host_peak_rss_gib"] > 0.1
    assert mem["max"]["host_peak_rss_gib"] == max(r["host_peak_rss_gib"] for r in mem["per_rank"])
    # each rank's lifetime peak in `nodes` is read after the meter's last window closes: never below a
    # peak that window or loading saw (both rounded from byte counts, which keeps their order)
    for rank in rec["nodes"]["ranks"]:
        for section in (mem["per_rank"], mem["loading"]["per_rank"]):
            assert rank["host_peak_rss_gib"] >= section[rank["rank"]]["host_peak_rss_gib"], (rank, section)
    tp = rec["throughput"]
    assert tp["trained_tokens_per_s_per_device"] == pytest.approx(tp["trained_tokens_per_s"] / 2, rel=1e-3)


def test_host_memory_peak_grows_with_the_model(tmp_path, tokenizer, launch):
    """Full fine-tuning (weights, gradients, Adam states in host memory) of a ~3M and a ~31M
    parameter model: the larger one must show a clearly larger training and loading peak."""
    models = {
        label: save_tiny_llama(tmp_path / f"model-{label}", tokenizer, layers=layers, hidden=hidden)
        for label, layers, hidden in (("small", 2, 64), ("large", 4, 512))
    }

    def train(label: str):
        return launch(
            [
                "--recipe",
                "demo",
                f"--model.name_or_path={models[label]}",
                "--method.name=full",
                "--data.demo_train_size=16",
                "--eval.exact_match=false",
                "--training.max_steps=2",
            ],
            run_dir=tmp_path / label,
            cwd=tmp_path,
            timeout=300,
        )

    # both runs at once (one process each): each peak is its own process's high-water mark
    with ThreadPoolExecutor(len(models)) as pool:
        results = dict(zip(models, pool.map(train, models)))
    peaks = {}
    for label, res in results.items():
        assert res.returncode == 0, res.explain()
        peaks[label] = res.record["memory"]
        peaks[label]["params"] = res.record["parameters"]["total"]
    extra_bytes = (peaks["large"]["params"] - peaks["small"]["params"]) * 4 * 4  # fp32 weights, grads, 2 Adam states
    grown = (peaks["large"]["max"]["host_peak_rss_gib"] - peaks["small"]["max"]["host_peak_rss_gib"]) * 2**30
    assert grown > 0.5 * extra_bytes, (grown, extra_bytes)
    # Loading peaks are recorded for both, but not compared: safetensors weights are memory-mapped
    # and only become resident when first touched (in training), so at the start of training
    # the loading peak is dominated by imports (~0.56 GiB either way) and does not order reliably.
    for label in peaks:
        assert peaks[label]["loading"]["max"]["host_peak_rss_gib"] > 0.1
