"""End to end: finetune/train.py through `accelerate launch` in a subprocess (tiny model, 3 steps),
then the run directory, run.json and the exported model checked from the outside.

Launches are module-scoped and shared: the LoRA run, and one full fine-tuning run (a GPT-2, padding-free,
with --overwrite over an earlier run's directory) that both the overwrite/export test and the
counting test read; the two one-process runs are started at once. Both exports are reloaded in one
fresh plain process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import launch_train

REPO = Path(__file__).resolve().parents[2]  # the repository root

pytestmark = pytest.mark.integration


def tiny_args(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--recipe",
        "demo",
        f"--model.name_or_path={model_dir}",
        "--data.demo_train_size=48",
        "--data.demo_heldout_size=8",
        "--eval.samples=8",
        "--eval.max_new_tokens=4",
        "--eval.batch_size=4",
        "--training.max_steps=3",
        "--training.logging_steps=1",
        "--training.per_device_train_batch_size=4",
        "--training.warmup_steps=0",
        "--training.lr_scheduler_type=constant",
        *extra,
    ]


RELOAD = """
import sys
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer
for model_dir, adapter in zip(sys.argv[1::2], sys.argv[2::2]):
    M = AutoPeftModelForCausalLM if adapter == "adapter" else AutoModelForCausalLM
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = M.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    print(model_dir, "NEW_TOKENS", out.shape[1] - ids["input_ids"].shape[1], "CLASS", type(model).__name__)
"""


def reload_and_generate(exports: dict[Path, bool]) -> dict[Path, str]:
    """Load each exported model (dir -> is a LoRA adapter) in one fresh plain process and generate
    greedily; dir -> what it printed."""
    argv = [x for d, adapter in exports.items() for x in (str(d), "adapter" if adapter else "full")]
    proc = subprocess.run([sys.executable, "-c", RELOAD, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(" NEW_TOKENS ")[0]: line for line in proc.stdout.splitlines() if " NEW_TOKENS " in line}
    return {d: lines[str(d)] for d in exports}


def _build_gpt2(model_dir: Path, tokenizer):
    """A tiny random GPT-2 (Conv1D, n_head/n_embd) saved with the tokenizer; returns the model as built."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=512,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_model_dir, tokenizer) -> SimpleNamespace:
    """The module's two runs, started at once: each is one process (distributed type NO: no port, no
    process group), which on its own leaves the other core idle while it imports. `lora`: the LoRA
    run; `gpt2`: the GPT-2 fully fine-tuned padding-free with --overwrite into the directory of an
    earlier run; `gpt2_model`: that model as built."""
    from concurrent.futures import ThreadPoolExecutor

    base = tmp_path_factory.mktemp("e2e")
    model = _build_gpt2(base / "tiny-gpt2", tokenizer)
    gpt2_dir = base / "runs" / "gpt2"
    (gpt2_dir / "checkpoint-99").mkdir(parents=True)  # an earlier run of this directory (finetune's marker)
    (gpt2_dir / "checkpoint-99" / "trainer_state.json").write_text("{}")
    (gpt2_dir / ".finetune-run").touch()
    (gpt2_dir / "run.json").write_text('{"run_name": "earlier"}')
    lora_args = tiny_args(
        tiny_model_dir,
        "--training.lr_scaling=linear",
        "--training.lr_reference_batch_size=2",
        "--training.learning_rate=1e-3",
    )
    gpt2_args = [
        "--recipe",
        "demo",
        f"--model.name_or_path={base / 'tiny-gpt2'}",
        "--method.name=full",
        "--data.padding_free=true",
        "--data.train_on_prompt=true",
        "--data.demo_train_size=12",
        "--eval.exact_match=false",
        "--training.max_steps=-1",
        "--training.num_train_epochs=1",
        "--training.per_device_train_batch_size=4",
        "--training.logging_steps=2",
        "--overwrite",
    ]
    with ThreadPoolExecutor(2) as pool:
        lora = pool.submit(launch_train, lora_args, run_dir=base / "runs" / "lora", cwd=base)
        gpt2 = pool.submit(launch_train, gpt2_args, run_dir=gpt2_dir, cwd=base)
        return SimpleNamespace(lora=lora.result(), gpt2=gpt2.result(), gpt2_model=model)


@pytest.fixture(scope="module")
def lora_run(launched):
    return launched.lora


@pytest.fixture(scope="module")
def gpt2_run(launched):
    """(the GPT-2 launch, the model as built)."""
    return launched.gpt2, launched.gpt2_model


@pytest.fixture(scope="module")
def reloaded(lora_run, gpt2_run) -> dict[Path, str]:
    """Both exports reloaded in one fresh plain process: export dir -> what it printed."""
    assert lora_run.returncode == 0, lora_run.explain()
    assert gpt2_run[0].returncode == 0, gpt2_run[0].explain()
    return reload_and_generate({lora_run.run_dir / "model": True, gpt2_run[0].run_dir / "model": False})


def test_lora_run_writes_run_directory_record_and_reloadable_adapter(lora_run, tiny_model_dir, reloaded):
    res = lora_run
    run_dir = res.run_dir
    assert res.returncode == 0, res.explain()
    rec = res.record

    assert rec["schema"] == 1 and rec["recipe"] == "demo" and rec["run_name"]
    datetime.fromisoformat(rec["created"])
    assert rec["versions"]["torch"] and rec["versions"]["transformers"] and rec["versions"]["python"]
    assert rec["hardware"]["device_type"] == "cpu"
    assert rec["strategy"]["name"] == "single" and rec["strategy"]["method"] == "lora"
    assert rec["strategy"]["world_size"] == 1 and rec["strategy"]["distributed_type"] == "NO"

    # 4 sequences per step, 1 process, no accumulation; linear scaling against a reference of 2
    assert rec["batch"]["effective"] == 4
    assert rec["lr"] == {"base": 1e-3, "rule": "linear", "reference_batch": 2, "factor": 2.0, "applied": 2e-3}
    # The optimizer really ran at the applied rate (constant schedule, no warm-up).
    assert [s["step"] for s in rec["steps"]] == [1, 2, 3]
    assert all(s["lr"] == pytest.approx(2e-3) for s in rec["steps"])
    assert all(math.isfinite(s["loss"]) and s["trained_tokens"] > 0 for s in rec["steps"])

    summary = rec["summary"]
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["total_trained_tokens"] == sum(s["trained_tokens"] for s in rec["steps"])
    assert rec["batch"]["trained_tokens_per_step"] == pytest.approx(summary["total_trained_tokens"] / 3, abs=0.1)

    mem = rec["memory"]
    assert [r["rank"] for r in mem["per_rank"]] == [0]
    assert mem["max"]["host_peak_rss_gib"] > 0.1 and mem["loading"]["max"]["host_peak_rss_gib"] > 0.1
    assert mem["max"]["device_peak_allocated_gib"] is None  # a CPU run has no accelerator memory
    tp = rec["throughput"]
    assert tp["warmup_steps_excluded"] == 1 and tp["steps_measured"] == 2 and tp["trained_tokens_per_s"] > 0
    assert tp["mfu"] is None and "not in the peak-FLOPS table" in tp["mfu_note"]
    assert (run_dir / "trainer_state.json").is_file()

    assert 0.0 <= rec["eval"]["exact_match_before"] <= 1.0 and 0.0 <= rec["eval"]["exact_match_after"] <= 1.0
    assert rec["eval"]["details"]["after"]["total"] == 8  # generate ran under the chunked loss's forward

    speed = rec["speed"]  # docs/speed.md: the defaults, read back from the live objects
    assert speed["layout"] == {"name": "padded", "packing_algorithm": None, "pad_to_multiple_of": None}
    assert speed["loss_impl"] == {
        "requested": "auto",
        "resolved": "chunked",
        "reason": None,
        "chunk_tokens": 1024,
        "compact": True,
        "logits_materialised": False,
    }  # vocabulary 49,152
    assert speed["attention"]["implementation"] == "sdpa" and speed["attention"]["sdpa_backends_policy"] == "auto"
    assert {"flash", "math"} <= set(speed["attention"]["sdpa_backends_enabled"])  # auto leaves the CPU's as they are
    assert speed["compile"]["enabled"] is False and speed["liger"]["fused_linear_cross_entropy"] is False

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["model"]["name_or_path"] == str(tiny_model_dir)
    assert resolved["training"]["max_steps"] == 3 and resolved["run"]["output_dir"] == str(run_dir)
    assert len((run_dir / "data" / "train.jsonl").read_text().splitlines()) == 48
    assert len((run_dir / "data" / "heldout.jsonl").read_text().splitlines()) == 8
    adapter = json.loads((run_dir / "model" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and (run_dir / "model" / "adapter_model.safetensors").is_file()
    table = {line.split()[0] + " " + line.split()[1]: line for line in res.stdout.splitlines() if len(line.split()) > 2}
    assert str(run_dir) in table["run directory"] and str(run_dir / "model") in table["LoRA adapter"]
    # the precision policy read from the live run (CPU default: auto = 32-true)
    assert "precision 32-true from auto (fp32 params, fp32 states, fp32 compute)" in " ".join(res.stdout.split())
    assert rec["precision"]["policy"] == "32-true" and rec["precision"]["observed_compute_dtype"] == "float32"

    out = reloaded[run_dir / "model"]
    assert "NEW_TOKENS 5 " in out and "PeftModel" in out


def test_full_finetune_with_overwrite_exports_a_model_that_reloads(gpt2_run, reloaded):
    res, model = gpt2_run
    run_dir = res.run_dir
    assert res.returncode == 0, res.explain()
    assert not (run_dir / "checkpoint-99").exists()  # --overwrite replaced the earlier run's files
    rec = res.record
    # the record is this run's (the earlier one's run.json named "earlier"); the directory is the one asked for
    assert (
        rec["run_name"] != "earlier" and rec["strategy"]["method"] == "full" and rec["summary"]["status"] == "completed"
    )
    assert rec["parameters"]["trainable"] == rec["parameters"]["total"]
    assert (run_dir / "model" / "model.safetensors").is_file()
    out = reloaded[run_dir / "model"]
    assert "NEW_TOKENS 5 " in out and "CLASS GPT2LMHeadModel" in out


def test_bad_data_row_fails_the_run_with_file_and_row_in_the_record(tmp_path, tiny_model_dir):
    """Through the `finetune train` console entry point (which runs accelerate launch). The bad row
    is past the first 100, which preflight checks before launching (tests/preflight/test_preflight.py), so
    it is found by the launched process while reading the data."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n' * 120 + '{"instruction": "c"}\n')
    run_dir = tmp_path / "runs" / "bad"
    cmd = [
        sys.executable,
        "-m",
        "finetune.cli",
        "train",
        "--recipe",
        "demo",
        f"--model.name_or_path={tiny_model_dir}",
        f"--data.path={data}",
        "--eval.exact_match=false",
        f"--run.output_dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.jsonl row 121" in proc.stderr and "output" in proc.stderr
    assert "Traceback" not in proc.stderr.split("error:")[-1]
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["summary"]["status"] == "failed"
    assert "row 121" in rec["summary"]["error"]


def test_gpt2_padding_free_full_run_counts_examples_and_flops_of_the_live_model(gpt2_run, tokenizer):
    """Issue 15 items 1, 2, 8, 10, 13 in one launch. A GPT-2 (Conv1D, n_head/n_embd: the old FLOPs
    arithmetic crashed after training and the run was recorded `failed`), padding-free batches
    (one row per batch: examples were counted as rows), first labels trained (train_on_prompt:
    label 0 of a row is never scored), one epoch over 12 examples in 3 steps of 4, logged at step
    2 (step 3 is the tail entry). Expected values from the tokenized examples and the model."""
    from finetune.data.build import build_datasets

    res, model = gpt2_run
    run_dir = res.run_dir
    assert res.returncode == 0, res.explain()
    rec = res.record
    assert rec["summary"]["status"] == "completed" and rec["summary"]["steps"] == 3, rec["summary"]

    cfg = SimpleNamespace(
        path=str(run_dir / "data" / "train.jsonl"),
        format="auto",
        split="train",
        max_length=512,
        eval_fraction=0.0,
        train_on_prompt=True,
        system_prompt=None,
        chat_template=True,
        packing=False,
        on_bad_rows="error",
        max_samples=None,
    )
    train = build_datasets(cfg, tokenizer, seed=42).train
    lengths = [len(ids) for ids in train["input_ids"]]
    assert len(lengths) == 12 and any(labels[0] != -100 for labels in train["labels"])  # label 0 is trained data
    steps = rec["steps"]
    assert [(s["step"], s["window_steps"], s["examples"]) for s in steps] == [(2, 2, 8), (3, 1, 4)], steps
    assert steps[-1]["loss"] is None and steps[0]["loss"] is not None  # the tail entry
    summary = rec["summary"]
    assert summary["total_input_tokens"] == sum(lengths) == sum(s["input_tokens"] for s in steps)
    trained = sum(sum(1 for x in labels[1:] if x != -100) for labels in train["labels"])
    assert summary["total_trained_tokens"] == trained == rec["data"]["train_trained_tokens"]
    assert summary["steps_counted"] == 3

    tp = rec["throughput"]
    assert "N = matmul weights of the live model" in tp["flops_convention"] and tp["mfu"] is None  # a CPU
    n = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "wte" not in name and "wpe" not in name
    )
    n += model.get_output_embeddings().weight.numel()  # the tied LM head multiplies too
    attention = 12 * 2 * 64  # 12 L H Q
    assert 6 * n + attention * min(lengths) <= tp["flops_per_token"] <= 6 * n + attention * max(lengths), tp
    assert rec["parameters"]["total"] == rec["parameters"]["trainable"] == sum(p.numel() for p in model.parameters())
    assert "excludes data loading" in tp["scope"]
    assert all(s["data_loading_s"] > 0 and 0 < s["data_loading_share"] < 1 for s in steps), steps
    from finetune.telemetry import meter

    if meter.vmhwm() is not None and meter.reset_vmhwm():
        assert rec["memory"]["host_peak_method"] == "vmhwm"
    assert rec["memory"]["max"]["host_peak_rss_gib"] > 0.1
