"""Every strategy engaged for real (2 processes over gloo on CPU) and shown equivalent to one process.

The runs are the session's one run per strategy (tests/training/strategy_runs.py, the `strategy_runs`
fixture of tests/conftest.py; the record's and the sync count's tests read them too): the same recipe
values for every strategy, 8 sequences per optimizer step (the single-process reference: 4 x
accumulation 2), 5 steps (one epoch), checkpoints at steps 3 (resumed from by the resume tests at the
end) and 5, and the final export, which checks itself (run.json `export.check`; issue 45).

Precision: these runs take the CPU default, training.precision auto = 32-true, and every record's
`precision` section is checked to say so from the live run (assert_32_true). The same comparison in
bf16-mixed, the precision users train in on GPUs, with its own tolerance and a control:
tests/training/test_precision_equivalence.py.

Tolerance for per-step losses: 1e-5 relative. The runs are fp32 on CPU; what differs between
backends is only the order of floating-point reductions (gradient all-reduce over 2 ranks vs
accumulation in one process, DeepSpeed's flattened fp32 buffers, DeepSpeedCPUAdam vs torch
AdamW), which moves a loss by ~1e-7 relative per step (fp32 epsilon 1.2e-7); seen here: at most a
few 1e-7 over 5 steps. Real differences are far larger: a different LoRA init changed the step-3
loss by 8e-5 relative, a missing clip (grad norm ~1.2 vs clip 1.0) by ~1e-3, other data by more.
Grad norms (sensitive to clipping and loss normalisation from step 1) are compared at 1e-4.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, InPairs, kill_tree, launch_train, logged_steps, own_port, params, wanted
from tests.training.strategy_runs import (
    CPU_ENV,
    PLAIN,
    PLAIN_STEPS,
    QLORA,
    RESUME_FROM,
    ROWS,
    STEPS,
    STRATEGIES,
    TORCHRUN,
    common_args,
    resumed_args,
    shape,
    trace_env,
)

pytestmark = pytest.mark.integration

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4


@pytest.fixture(scope="session")
def runs(strategy_runs):
    """strategy -> finished Launch: the session's one run per strategy (tests/training/strategy_runs.py)."""
    return strategy_runs


def assert_32_true(rec: dict) -> None:
    """These runs take the CPU default, training.precision auto = 32-true, read from the live run:
    fp32 everywhere, no master copy, fp32 seen in step 1's forward (bf16 runs:
    tests/training/test_precision_equivalence.py)."""
    p = rec["precision"]
    assert (p["policy"], p["requested"], p["load_dtype"]) == ("32-true", "auto", "float32"), p
    assert (p["param_dtype"], p["compute_dtype"], p["optimizer_state_dtype"], p["master_weights"]) == (
        "float32",
        "float32",
        "float32",
        False,
    ), p
    assert p["observed_compute_dtype"] == "float32" and p["reduce_dtype"] in (None, "float32"), p
    family = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp2"}.get(rec["strategy"]["distributed_type"], "torch")
    assert p["family"] == family and p["evidence"]["accelerate_mixed_precision"] == "no", p
    if family == "fsdp2":  # no casts: MixedPrecisionPolicy()
        assert p["evidence"]["mp_policy"] == {
            "param_dtype": None,
            "reduce_dtype": None,
            "output_dtype": None,
            "cast_forward_inputs": True,
        }, p


def rows_per_step(trace) -> dict[int, list[int]]:
    """Recount, from the trace alone: optimizer step -> the dataset indices it trained on (all ranks
    and micro-batches), mapping each row's hash back to its index in the train dataset."""
    from pathlib import Path

    trace = Path(trace)
    order = json.loads((trace / "dataset.json").read_text())
    index = {h: i for i, h in enumerate(order)}
    assert len(index) == len(order) == ROWS, "rows must hash uniquely to be recounted"
    steps: dict[int, list[int]] = {}
    for f in trace.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            entry = json.loads(line)
            steps.setdefault(entry["step"], []).extend(index[h] for h in entry["rows"])
    return {k: sorted(v) for k, v in sorted(steps.items())}


def _steps(record: dict) -> list[dict]:
    return logged_steps(record, STEPS)


# What a run printed before issue 27 item 5 (a 3-step ZeRO-3 run on CPU: 22 deprecation warnings, DeepSpeed's
# CPU notice per process, an 80-line configuration): held back at their source (finetune/held_back.py) or fixed.
NOISE = (
    "all_gather_into_tensor` is deprecated",
    "reduce_scatter_tensor` is deprecated",
    "`past_key_values`",
    "is_gradient_checkpointing",
    "\nmodel:\n  name_or_path:",
    "built successfully",  # DeepSpeed's CPU communication op, printed by every rank (issue 43), now in third_party.log
)


@pytest.mark.parametrize("name", ["zero3", "zero3_offload"])
def test_a_deepspeed_run_prints_no_library_noise_and_no_config_dump(runs, name):
    run = runs(name)
    text = run.stdout + run.stderr
    assert [n for n in NOISE if n in text] == [], text[-4000:]
    # DeepSpeed's CPU notice: once, from the launcher's own process (accelerate launch imports DeepSpeed
    # before any rank starts; not ours to filter), no more from each rank
    assert text.count("Setting accelerator to CPU") <= 1, text[-4000:]
    assert "config.yaml (--logging.print_config=true prints it)" in text
    kept = (run.run_dir / "third_party.log").read_text()
    assert kept.count("held back from the console: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built") == 2


def expected_imports(name: str) -> dict[str, bool]:
    """The optional packages a launch's ranks import by their first step (finetune/training/rank_imports.py):
    DeepSpeed for the ZeRO runs only, bitsandbytes for the QLoRA runs only, W&B and matplotlib for none (reported
    to nothing, no figures)."""
    deepspeed = name.startswith(("zero", "qlora_zero"))
    return {"deepspeed": deepspeed, "bitsandbytes": "qlora" in name, "wandb": False, "matplotlib": False}


@pytest.mark.parametrize("name", ["single", "single_qlora", *STRATEGIES, *QLORA])
def test_a_rank_imports_only_the_optional_packages_its_run_uses(runs, name):
    """Issue 43: before, every rank of every strategy imported DeepSpeed (accelerate's model unwrapping) and
    bitsandbytes (peft's import). The controls are in the same table: the ZeRO runs show DeepSpeed, the QLoRA runs
    bitsandbytes, so the trace sees a package that is imported."""
    trace = Path(trace_env(runs(name).run_dir)["FINETUNE_SAMPLE_TRACE"])
    ranks = sorted(trace.glob("rank*.imports.json"))
    assert len(ranks) == (1 if name.startswith("single") else 2), ranks
    for path in ranks:
        loaded = json.loads(path.read_text())["packages"]
        got = {package: package in loaded for package in expected_imports(name)}
        assert got == expected_imports(name), (path.name, loaded)


@pytest.mark.parametrize("name", ["single", *STRATEGIES])
def test_a_rank_trains_with_the_garbage_collector_on_and_its_imports_frozen(runs, name):
    """Issue 43: the collector is off while a rank imports (1.1-1.5 s of CPU less per process), then what was imported
    is frozen and the collector is on again, so the run itself collects its garbage (finetune/errors.py
    imports_without_gc). Read in the rank at its first micro-batch; a bare Python process freezes nothing."""
    trace = Path(trace_env(runs(name).run_dir)["FINETUNE_SAMPLE_TRACE"])
    for path in sorted(trace.glob("rank*.imports.json")):
        start_up = json.loads(path.read_text())
        assert start_up["gc_enabled"] is True, (path.name, start_up)
        assert start_up["gc_frozen"] > 100_000, (path.name, start_up)  # torch and transformers: ~0.5 million


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_engaged_from_the_live_engine(runs, name, tiny_model_dir):
    rec = runs(name).record
    s = rec["strategy"]
    ev = s["evidence"]
    want_name = name.replace("_offload", "")
    assert s["name"] == want_name and s["world_size"] == 2 and ev["world_size"] == 2, s
    for key, value in STRATEGIES[name][2].items():
        assert ev[key] == value, (key, ev)
    if want_name == "fsdp":
        assert s["distributed_type"] == "FSDP" and s["fsdp_version"] == 2, s
        assert ev["fsdp_modules"] >= 3, ev  # the root + one unit per decoder layer (2 layers)
        assert ev["dtensor_params"] == ev["params"] > 0, ev
        assert 0.4 <= ev["local_param_fraction"] <= 0.6, ev  # each rank holds about half
        assert "Shard(dim=0)" in ev["placements"], ev
    elif want_name.startswith("zero"):
        assert s["distributed_type"] == "DEEPSPEED" and s["zero_stage"] == int(want_name[-1]), s
        assert ev["gradient_clipping"] == 1.0, ev  # pinned from the recipe, not DeepSpeed's default
        if want_name == "zero3":
            assert 0.4 <= ev["local_param_fraction"] <= 0.6, ev
    else:
        assert s["distributed_type"] == "MULTI_CPU", s
    assert s["offload"] == {
        "zero2_offload": "optimizer",
        "zero3_offload": "optimizer+params",
        "fsdp_offload": "optimizer+params",
    }.get(name, "none")
    assert rec["batch"]["effective"] == 8 and rec["batch"]["data_parallel_size"] == 2, rec["batch"]
    assert_32_true(rec)
    # who set it up: the recipe in the script (torchrun, no config) or the --config_file
    setup = s["setup"]
    if name in TORCHRUN:
        assert s["set_up_by"] == ev["set_up_by"] == "recipe" and setup["launcher"] == "torchrun", s
        assert setup["row"] == name and not setup["world_of_one"] and setup["cpu_gloo"].startswith("opt-in"), setup
    else:
        assert s["set_up_by"] == ev["set_up_by"] == "launcher-config", s
        assert (setup["launcher"], setup["config_from"]) == ("accelerate launch", "--config_file"), setup
        assert setup["config_file"] == str(REPO / STRATEGIES[name][1]) and setup["trainer_arguments"] is None, setup
    # The default loss is the chunked one under every strategy (docs/speed.md): these launches are its
    # DDP/ZeRO/FSDP2 equivalence tests (test_losses_match_single_process, the full-model exports).
    assert rec["speed"]["loss_impl"]["resolved"] == "chunked", rec["speed"]
    # DDP without the per-step search for unused parameters (issue 29; a probe found every adapter used)
    ddp = rec["speed"]["ddp"]
    assert ddp["find_unused_parameters"] is (False if want_name == "ddp" else None), ddp
    # parameter counts of the whole model, not of this rank's ZeRO-3 shards (issue 15 item 3)
    assert rec["parameters"] == _expected_parameters(STRATEGIES[name][0], tiny_model_dir), rec["parameters"]


def _expected_parameters(recipe: str, model_dir) -> dict:
    """The recipe's model counted here, in one process, unpartitioned."""
    from finetune.config.recipe import load_recipe
    from finetune.modeling.load import count_parameters, load_model

    cfg, _ = load_recipe(recipe, [f"--model.name_or_path={model_dir}", "--model.dtype=float32"])
    trainable, total = count_parameters(load_model(cfg.model, cfg.method))
    assert 0 < trainable < total
    return {"trainable": trainable, "total": total}


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_accelerate_launch_engages_the_recipes_strategy_at_world_size_one(runs, name):
    """Issue 18: `accelerate launch finetune/train.py --recipe X` (no config file, CPU, one process)
    engages the recipe's strategy, proven from the live engine; its losses and grad norms are the
    single-process reference's (the same 8 sequences per step; LR decay differs from step 2 on, which
    only affects losses after step 2)."""
    run = runs(name)
    rec, combined = run.record, run.stdout + run.stderr
    s, ev = rec["strategy"], rec["strategy"]["evidence"]
    recipe, want = PLAIN[name]
    assert rec["summary"]["status"] == "completed" and s["name"] == recipe and s["offload"] == "none", s
    assert s["world_size"] == 1 and ev["world_size"] == 1 and rec["batch"]["effective"] == 8, (s, rec["batch"])
    for key, value in want.items():
        assert ev[key] == value, (key, ev)
    if recipe == "fsdp":
        assert s["distributed_type"] == "FSDP" and ev["fsdp_modules"] >= 3 and ev["dtensor_params"] == ev["params"] > 0
    else:
        assert s["distributed_type"] == "DEEPSPEED" and s["zero_stage"] == int(recipe[-1]), s
    setup = s["setup"]
    assert s["set_up_by"] == ev["set_up_by"] == "recipe" and setup["row"] == recipe, s
    assert (setup["launcher"], setup["config_file"], setup["world_of_one"]) == ("accelerate launch", None, True), setup
    assert setup["cpu_gloo"] == "one process on a machine without CUDA" and s["cpu_distributed"] is True, setup
    assert_32_true(rec)  # the policy follows the strategy the recipe set up in the script
    argument = f"deepspeed={REPO / 'ds_configs' / (recipe + '.json')}" if recipe != "fsdp" else "fsdp=True"
    assert f"strategy {recipe} (offload none) set up by the recipe: TrainingArguments({argument})" in combined, (
        run.explain()
    )
    assert re.search(
        rf"\n  strategy +{recipe} \({s['distributed_type']}\), lora, set up by the recipe\n", run.stdout
    ), run.explain()  # the summary table
    ref, got = _steps(runs("single").record), [x for x in rec["steps"] if x.get("loss") is not None]
    assert [x["step"] for x in got] == list(range(1, PLAIN_STEPS + 1)), rec["steps"]
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * abs(a["loss"]), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=GRAD_NORM_RTOL), (a, b)
        assert (a["trained_tokens"], a["input_tokens"]) == (b["trained_tokens"], b["input_tokens"]), (a, b)


@pytest.mark.parametrize("name", [*STRATEGIES, *PLAIN])
def test_every_field_of_the_record_is_documented(runs, name):
    """docs/run_record.md names every field a 2-process run writes (the DeepSpeed and FSDP2 evidence
    included) and the run writes every field documented `always` (tests/telemetry/test_run_record_doc.py
    checks a single-process record, with controls)."""
    from tests.telemetry.run_record_doc import documented, missing_always_fields, undocumented

    rec, doc = runs(name).record, documented()
    assert undocumented(rec, doc) == []
    assert missing_always_fields(rec, doc) == []


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_losses_match_single_process(runs, name):
    ref = _steps(runs("single").record)
    got = _steps(runs(name).record)
    assert runs("single").record["strategy"]["name"] == "single"
    assert runs("single").record["batch"]["effective"] == 8
    assert_32_true(runs("single").record)
    worst = 0.0
    for a, b in zip(ref, got):
        rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst = max(worst, rel)
        assert rel <= LOSS_RTOL, f"step {a['step']}: single {a['loss']!r} vs {name} {b['loss']!r} (rel {rel:.2e})"
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=GRAD_NORM_RTOL), (a, b)
        # The same sequences per optimizer step (token counts summed over ranks / accumulation).
        assert (a["trained_tokens"], a["input_tokens"]) == (b["trained_tokens"], b["input_tokens"]), (a, b)
    # Training moved the loss: equal losses of a model that did not learn would prove little.
    assert ref[-1]["loss"] < ref[0]["loss"] - 1e-3, ref
    print(f"{name}: loss after {STEPS} steps {got[-1]['loss']:.6f}, largest relative difference {worst:.2e}")


@pytest.mark.parametrize("name", list(QLORA))
def test_qlora_shards_and_matches_single_process_qlora(runs, name):
    rec = runs(name).record
    ev = rec["strategy"]["evidence"]
    assert rec["strategy"]["method"] == "qlora" and rec["strategy"]["name"] == QLORA[name][0], rec["strategy"]
    assert ev["world_size"] == 2 and 0.4 <= ev["local_param_fraction"] <= 0.6, ev
    assert_32_true(rec)
    assert_32_true(runs("single_qlora").record)
    ref, got = _steps(runs("single_qlora").record), _steps(rec)
    plain = _steps(runs("single").record)
    assert abs(ref[0]["loss"] - plain[0]["loss"]) > 1e-4, "the 4-bit base should change the loss"
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) / abs(a["loss"]) <= LOSS_RTOL, (a, b)
    assert (runs(name).run_dir / "model" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_checkpoint_and_export_written(runs, name):
    run_dir = runs(name).run_dir
    ckpt = run_dir / f"checkpoint-{STEPS}"
    assert (ckpt / "trainer_state.json").is_file(), sorted(p.name for p in run_dir.iterdir())
    if name.startswith("zero"):
        assert (ckpt / "latest").is_file() and any(ckpt.glob("global_step*/*optim_states.pt")), sorted(ckpt.rglob("*"))
    if name.startswith("fsdp"):
        assert any(ckpt.glob("pytorch_model_fsdp_0/*.distcp")), sorted(ckpt.rglob("*"))  # SHARDED_STATE_DICT
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    assert runs(name).record["summary"]["status"] == "completed"
    # the save checked itself (run.verify_export: auto): a fresh process loaded model/ on the base, and its loss and
    # logits on the probe rows are the live model's (fp32: 1e-4 of the largest logit), every adapter tensor compared
    check = runs(name).record["export"]["check"]
    assert check["kind"] == "reload" and check["passed"] and check["problems"] == [], check
    assert check["tensors"] == 28 and check["max_tensor_rel_diff"] <= 1e-6, check  # 14 adapted layers x (A, B)
    assert check["max_logit_diff"] <= check["logit_tolerance"] <= 1e-4 * max(1.0, 2 * abs(check["reference_loss"]))
    assert abs(check["saved_loss"] - check["reference_loss"]) <= check["loss_tolerance"], check
    assert check["probe"]["rows"] == 4 and check["probe"]["trained_tokens"] > 0 and check["seconds"] > 0, check
    assert f"{run_dir / 'model'}   (model/ verified, reload check: loss " in runs(name).stdout, runs(name).explain()


RELOAD = r"""
import json, sys, torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
base, reference, *exports = sys.argv[1:]
for export in exports:
    tok = AutoTokenizer.from_pretrained(export)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), export).eval()
    ids = tok("2 + 3 =", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    got, ref = load_file(f"{export}/adapter_model.safetensors"), load_file(f"{reference}/adapter_model.safetensors")
    print(json.dumps({"export": export, "new_tokens": out.shape[1] - ids["input_ids"].shape[1],
                      "keys_equal": sorted(got) == sorted(ref),
                      "max_abs_diff": max((got[k] - ref[k]).abs().max().item() for k in ref),
                      "lora_b_norm": sum(v.norm().item() for k, v in got.items() if "lora_B" in k),
                      "world": torch.distributed.is_initialized()}))
"""
RELOADED = ("zero3", "fsdp")


@pytest.fixture(scope="module")
def reloaded(runs, tiny_model_dir) -> dict[str, dict]:
    """Each of RELOADED's exported adapters loaded on the base model in one fresh plain process (no
    process group) and compared with the single-process run's: name -> what the process measured."""
    exports = {str(runs(name).run_dir / "model"): name for name in RELOADED}
    reference = runs("single").run_dir / "model"
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD, str(tiny_model_dir), str(reference), *exports],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"export"')]
    return {exports[r["export"]]: r for r in results}


@pytest.mark.parametrize("name", RELOADED)
def test_export_reloads_in_a_plain_process_and_matches_single(reloaded, name):
    result = reloaded[name]
    assert result["new_tokens"] == 4 and result["world"] is False, result
    assert result["keys_equal"], result
    assert result["lora_b_norm"] > 0, result  # trained adapters (LoRA B starts at zero)
    assert result["max_abs_diff"] < 1e-5, result  # the gathered adapter equals the single-process one


# `finetune export --merge` of each strategy's run (issue 45): DDP from model/, ZeRO-2, ZeRO-3 and FSDP2 from their final
# checkpoint (the ZeRO partitions consolidated to their fp32 masters, FSDP2's sharded DCP read without a process group).
# The merged folder must load with plain transformers where peft cannot be imported and compute what the base + the
# run's own model/ adapter computes through peft, to 1e-4 in fp32: one process checks every folder with peft blocked,
# another computes the references; neither is the export's own check (its figures are asserted too).
MERGED = {"ddp": None, "zero2": STEPS, "zero3": STEPS, "fsdp": STEPS}
MERGED_LOGITS = r"""
import json, sys
if sys.argv[1] == "merged":
    sys.modules["peft"] = None  # import peft raises ImportError; transformers sees it as not installed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
kind, base, out, *folders = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(base)
tok.pad_token = tok.pad_token or tok.eos_token
ids = tok(["2 + 3 =", "Sort: d b a c"], return_tensors="pt", padding=True)
logits = {}
for folder in folders:
    if kind == "merged":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        from peft import PeftModel
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), folder)
    logits[folder] = model.eval()(**ids).logits.detach()
torch.save({"logits": logits, "peft": sys.modules.get("peft") is not None}, out)
"""


@pytest.fixture(scope="module")
def merged(runs, tmp_path_factory, tiny_model_dir):
    """name -> (the export command's Launch-like result, its folder, the max logit difference measured here)."""
    import torch

    base = tmp_path_factory.mktemp("merged")
    done = {}
    for name, step in MERGED.items():
        out = base / name
        checkpoint = ["--checkpoint", str(step)] if step else []
        proc = subprocess.run(
            [sys.executable, "-m", "finetune.cli", "export", str(runs(name).run_dir), "--merge", "--dtype", "fp32"]
            + checkpoint
            + ["--out", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        assert proc.returncode == 0, f"{name}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        done[name] = (proc, out)
    for kind, folders in (
        ("merged", [str(o) for _, o in done.values()]),
        ("adapter", [str(runs(n).run_dir / "model") for n in done]),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", MERGED_LOGITS, kind, str(tiny_model_dir), str(base / f"{kind}.pt"), *folders],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = (torch.load(base / f"{k}.pt") for k in ("merged", "adapter"))
    assert got["peft"] is False and want["peft"] is True
    return {
        name: (
            proc,
            out,
            (got["logits"][str(out)] - want["logits"][str(runs(name).run_dir / "model")]).abs().max().item(),
        )
        for name, (proc, out) in done.items()
    }


@pytest.mark.parametrize("name", list(MERGED))
def test_merged_export_loads_without_peft_and_computes_the_base_plus_adapter(merged, name):
    proc, out, diff = merged[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"finetune export: {out} written and verified" in proc.stdout, proc.stdout
    assert diff <= 1e-4, diff  # measured here, in other processes than the export's own check
    found = json.loads((out / "export.json").read_text())
    check = found["check"]
    assert found["merged"] and found["dtype"] == "float32" and found["files"] == ["model.safetensors"], found
    assert found["source"].endswith(
        {"ddp": "model (safetensors)", "zero2": "fp32 masters)", "zero3": "fp32 masters)", "fsdp": "consolidated)"}[
            name
        ]
    ), found
    assert check["passed"] and check["reference"] == "the base + adapter (peft)", check
    assert check["max_logit_diff"] <= check["logit_tolerance"] and check["tensors"] == 20, check  # the tied head once
    assert found["write"]["peak_rss_gib"] > 0 and (out / "README.md").read_text().count("merged into the base") == 1
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", ".finetune-export"} <= {
        p.name for p in out.iterdir()
    }
    print(
        f"{name}: merged logits vs base + adapter (peft), largest difference {diff:.2e}; check {check['max_logit_diff']:.2e}"
    )


def test_qlora_merges_into_the_dequantized_base_it_trained_on(runs, tmp_path):
    """The one-process QLoRA run's adapter folded into its base dequantized from 4 bits as bitsandbytes held it: the
    merged model computes what the 4-bit base + adapter computes; its difference from the original base + adapter
    (the quantization error the adapter trained against) is reported beside it."""
    out = tmp_path / "qlora"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune.cli",
            "export",
            str(runs("single_qlora").run_dir),
            "--merge",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads((out / "export.json").read_text())
    check, original = found["check"], found["check"]["vs_original_base"]
    assert found["dequantized_base"] and "merged into the dequantized 4-bit base" in (out / "README.md").read_text()
    assert check["passed"] and check["reference"] == "the 4-bit base + adapter (peft), as trained", check
    assert check["max_logit_diff"] <= check["logit_tolerance"] and check["compute_dtype"] == "float32", check
    assert original["max_logit_diff"] > 3 * check["max_logit_diff"], original  # the 4 bits the adapter trained on
    print(
        f"qlora: vs the 4-bit base {check['max_logit_diff']:.2e}, vs the original base {original['max_logit_diff']:.2e}"
    )


def test_a_qlora_adapter_export_is_checked_on_the_4bit_base_it_trained_on(runs, tmp_path):
    """`finetune export RUN` of a QLoRA run (no --merge): the adapter, loaded in the check's fresh process on the
    4-bit base as the run trained it, computes what the source adapter computes there (it was loaded on the
    unquantized base and failed every time: 0.1 logits apart). Control: the same adapter on the unquantized base
    (export.json check.vs_original_base of the merge) is far outside that tolerance."""
    out = tmp_path / "qlora-adapter"
    cmd = [sys.executable, "-m", "finetune.cli", "export", str(runs("single_qlora").run_dir), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads((out / "export.json").read_text())
    check = found["check"]
    assert not found["merged"] and (out / "adapter_model.safetensors").is_file(), found
    assert check["passed"] and check["reference"] == "the 4-bit base + adapter (peft), as trained", check
    assert check["max_logit_diff"] <= check["logit_tolerance"] < 1e-3, check
    import torch
    from safetensors.torch import save_file

    from finetune.config.sections import MethodConfig
    from finetune.export import reload
    from finetune.modeling.load import quantization_config

    ids = torch.arange(3, 35).reshape(2, 16)
    save_file(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}, str(tmp_path / "probe")
    )
    ask = {"folder": str(out), "base": json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]}
    ask.update(dtype="float32", probe=str(tmp_path / "probe"))
    quantization = quantization_config(MethodConfig(name="qlora"), torch.float32).to_dict()
    four_bit = reload.fresh(ask | {"quantization": quantization}, tmp_path / "4bit", 300)
    unquantized = reload.fresh(ask, tmp_path / "unquantized", 300)
    apart = (four_bit["logits"] - unquantized["logits"]).abs().max().item()
    assert apart > 100 * check["logit_tolerance"], apart


# Full fine-tuning's consolidated export under ZeRO-3 and FSDP2, in bf16-mixed:
# tests/training/test_precision_equivalence.py::test_full_export_is_one_consolidated_model_under_zero3_and_fsdp.


def _rank_exit_codes(stderr: str) -> set[int]:
    """Exit codes of the training processes, from torchrun's failure report ('exitcode  : 2 (pid: ...)')."""
    return {int(m) for m in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)}


def test_mismatched_launch_stops_before_training(tmp_path, tiny_model_dir):
    """Recipe zero3 under the DDP config: preflight (finetune/preflight/checks.py) exits 2 with the right launch
    line before the model loads or the run directory exists. (torchrun reports each rank's exit code;
    `accelerate launch` itself always exits 1 on a failed child.) The engaged-strategy check after the
    model loads stays as the proof of what engaged: test_offload_mismatch_is_refused_with_the_launch_line."""
    run = launch_train(
        ["--recipe", "zero3", *common_args(tiny_model_dir, "zero3")],
        run_dir=tmp_path / "run",
        cwd=REPO,
        config_file="accelerate_configs/cpu/ddp.yaml",
        env=CPU_ENV,
        timeout=300,
    )
    assert run.returncode != 0 and _rank_exit_codes(run.stderr) <= {2, -15} and 2 in _rank_exit_codes(run.stderr), (
        run.explain()
    )
    assert "meant for strategy 'zero3'" in run.stderr and "sets up 'ddp'" in run.stderr, run.explain()
    assert "accelerate_configs/cpu/zero3.yaml" in run.stderr and "accelerate_configs/zero3.yaml" in run.stderr
    assert not run.run_dir.exists()  # nothing was written: preflight runs before the run directory


def test_fsdp_without_cpu_opt_in_is_refused_not_downgraded(tmp_path, tiny_model_dir):
    """Without FINETUNE_CPU_DISTRIBUTED each process would train alone: refused, exit 2."""
    run = launch_train(
        ["--recipe", "fsdp", *common_args(tiny_model_dir, "fsdp")],
        run_dir=tmp_path / "run",
        cwd=REPO,
        config_file="accelerate_configs/cpu/fsdp.yaml",
        env={"FINETUNE_CPU_DISTRIBUTED": "0"},
        timeout=300,
    )
    assert run.returncode != 0 and 2 in _rank_exit_codes(run.stderr), run.explain()
    assert "FINETUNE_CPU_DISTRIBUTED=1" in run.stderr and "would train alone" in run.stderr, run.explain()


# The shipped files: tests/test_shipped_files.py; the decision from evidence: tests/training/test_engaged_strategy.py.


# --- resume (docs/faults.md) ----------------------------------------------------------------
# A run resumed from checkpoint-k reproduces steps k+1..5 of the uninterrupted run above. fp32 on
# CPU, the same ranks, data order, RNG and reduction order: seen exactly equal (0 difference) for
# DDP, ZeRO-2, ZeRO-3 and FSDP2. The tolerance, 1e-6 relative (~8 fp32 ulps), only allows for a
# different summation order; what a broken resume does is far larger: resuming this DDP run from
# checkpoint-3 without its optimizer.pt (Trainer then silently starts Adam afresh) left step 4
# equal (its loss is computed before any resumed update) and moved steps 5 and 6 by 1.6e-3 and
# 3.9e-3 relative.
RESUME_RTOL = 1e-6


def _assert_resumed(rec: dict, ref: dict, name: str, from_step: int) -> None:
    assert rec["summary"]["status"] == "completed", rec["summary"]
    assert rec["summary"]["resumed_from"].endswith(f"checkpoint-{from_step}") and rec["summary"]["resumes"] == 1
    s = rec["strategy"]
    assert s["name"] == name and s["world_size"] == 2 and s["evidence"]["world_size"] == 2, s
    for key, want in STRATEGIES[name][2].items():
        assert s["evidence"].get(key) == want, (key, s["evidence"])
    got, want = _steps(rec), _steps(ref)  # steps 1..5, each once: 1..k kept from the interrupted run
    worst = 0.0
    for a, b in zip(want, got):
        worst = max(worst, abs(a["loss"] - b["loss"]) / abs(a["loss"]))
        assert abs(a["loss"] - b["loss"]) <= RESUME_RTOL * abs(a["loss"]), (name, a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (name, a, b)
        assert (a["trained_tokens"], a["input_tokens"]) == (b["trained_tokens"], b["input_tokens"]), (a, b)
    # the totals are whole-run, as the uninterrupted run's (issue 15 item 7), not the last segment's
    summary, want_summary = rec["summary"], ref["summary"]
    assert (summary["total_trained_tokens"], summary["total_input_tokens"]) == (
        want_summary["total_trained_tokens"],
        want_summary["total_input_tokens"],
    ), (summary, want_summary)
    assert summary["steps_counted"] == STEPS, summary
    assert math.isclose(summary["train_loss"], want_summary["train_loss"], rel_tol=1e-5), (summary, want_summary)
    tp = rec["throughput"]
    assert tp["steps_measured"] + tp["warmup_steps_excluded"] == STEPS and "earlier segments" in tp["scope"], tp
    print(
        f"{name}: resumed from step {from_step}, largest relative loss difference in steps 1-{STEPS} "
        f"(1-{from_step} before the interruption): {worst:.2e}"
    )


# --- resume under another number of processes (docs/faults.md, finetune/checkpointing/resume_plan.py) ------
# Each strategy's uninterrupted 2-rank run (above) is copied, its newest checkpoint (5) torn, and
# resumed in two segments: (A) `--resume` on ONE process skips the torn checkpoint-5, continues
# checkpoint-3 (effective batch 8 kept: accumulation recomputed, 1 -> 2 where a rank took 4 sequences
# a step, 2 -> 4 where it took 2 x 2) and is preempted by a
# SIGTERM drill after step 4 (checkpoint-4, exit 75); (B) `--resume` on TWO ranks continues that
# 1-process checkpoint-4 (accumulation back to the 2-rank run's) and trains step 5. Together: 2 -> 1 and 1 -> 2, the
# torn checkpoint skipped and moved aside, the preemption command, and the exported adapter.
#
# Tolerance: after a world-size change the resumed steps reduce in another order (all-reduce over
# 2 ranks vs accumulation in one process, DeepSpeed's flat buffers, universal-checkpoint copies),
# the same kind of difference test_losses_match_single_process allows for: LOSS_RTOL (1e-5, ~80
# fp32 ulps) on losses, GRAD_NORM_RTOL on grad norms, 1e-5 absolute on the adapter; seen: 0 for
# every strategy and direction here (at most 9e-8 when it was measured). What a broken resume does is
# far larger: not recomputing the accumulation (effective batch 4) moved step 4 by 5.2e-3 (FSDP2
# 2 -> 1); the position lost (ignore_data_skip) by 6.5e-4; the ZeRO-2 universal
# checkpoint's Adam moments zeroed moved step 5 by 4.3e-4 (2 -> 1) and the exported adapter by
# 2.8e-4 absolute (1 -> 2); a fresh optimizer (Adam state not loaded) moved step 5 by 1.9e-3.
RESHARDED = {"ddp": "replicated", "zero2": "universal", "zero3": "universal", "fsdp": "dcp"}


@pytest.fixture(scope="module")
def resumed(request, runs, tmp_path_factory, tiny_model_dir):
    """name -> {a, b: Launch; a_record; hashes_before, hashes_after_a: checkpoint-3's files; victim}; two
    strategies' segments side by side (tests/conftest.py InPairs)."""
    import hashlib
    import shutil

    base = tmp_path_factory.mktemp("resumed")

    def hashes(ckpt):
        return {
            p.relative_to(ckpt).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*"))
            if p.is_file()
        }

    def start(name: str) -> dict:
        run_dir = base / name
        shutil.copytree(runs(name).run_dir, run_dir)
        torn = run_dir / f"checkpoint-{STEPS}"
        victim = max(
            (p for p in torn.rglob("*") if p.is_file() and p.suffix != ".json"), key=lambda p: p.stat().st_size
        )
        os.truncate(victim, victim.stat().st_size // 2)
        recipe, config, _ = STRATEGIES[name]
        out = {
            "victim": victim.relative_to(torn).as_posix(),
            "size": victim.stat().st_size,
            "hashes_before": hashes(run_dir / f"checkpoint-{RESUME_FROM}"),
        }
        args = ["--recipe", recipe, *resumed_args(tiny_model_dir, name), "--resume"]
        out["a"] = launch_train(
            args,
            run_dir=run_dir,
            cwd=REPO,
            config_file=config,
            launch_args=["--num_processes", "1", *own_port()],
            env={**CPU_ENV, "FINETUNE_FAULT_INJECT": "sigterm@rank0,step4", **trace_env(base / f"{name}-a")},
            timeout=420,
        )
        out["a_record"] = out["a"].record
        out["hashes_after_a"] = hashes(run_dir / f"checkpoint-{RESUME_FROM}")
        out["checkpoint_4"] = sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "checkpoint-4").rglob("*"))
        out["b"] = (
            launch_train(
                args,
                run_dir=run_dir,
                cwd=REPO,
                config_file=config,
                launch_args=own_port(),
                env={**CPU_ENV, **trace_env(base / f"{name}-b")},
                timeout=420,
            )
            if (run_dir / "checkpoint-4").is_dir()
            else None
        )
        return out

    return InPairs(start, wanted(request, "resumed", lambda item: params(item, "name")))


def _process_counts(per_device: int) -> str:
    """The process counts M whose M x per_device sequences divide the effective batch 8, as the hint writes them."""
    return "{" + ", ".join(str(m) for m in range(1, 9) if 8 % (m * per_device) == 0) + "}"


def _assert_steps_match(rec: dict, ref: dict, upto: int) -> float:
    got, want = _steps_upto(rec, upto), _steps(ref)[:upto]
    worst = 0.0
    for a, b in zip(want, got):
        worst = max(worst, abs(a["loss"] - b["loss"]) / abs(a["loss"]))
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * abs(a["loss"]), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=GRAD_NORM_RTOL), (a, b)
        assert (a["lr"], a["trained_tokens"], a["input_tokens"]) == (b["lr"], b["trained_tokens"], b["input_tokens"])
    return worst


def _steps_upto(record: dict, upto: int) -> list[dict]:
    return logged_steps(record, upto)


def _segments(rec: dict) -> list[tuple]:
    return [
        (s["step"], s["world_size"], s["strategy"], s["grad_accum"], s["effective"], s.get("reshard"))
        for s in rec["resumes"]
    ]


@pytest.mark.parametrize("name", list(RESHARDED))
def test_two_ranks_resumed_on_one_process_keep_the_effective_batch_and_the_losses(runs, resumed, name):
    from finetune.checkpointing import checkpoints

    ref, r = runs(name), resumed(name)
    a, rec = r["a"], r["a_record"]
    run_dir = a.run_dir
    per_device, accumulation = shape(name)[:2]  # on each of the 2 ranks; one process: accumulation x 2
    # preempted after step 4 (the drill), with the resume command and the hint for another GPU count
    assert a.returncode != 0 and _rank_exit_codes(a.stderr) == {75}, a.explain()
    assert f"skipping checkpoint {run_dir / 'checkpoint-5'}: file {r['victim']}" in a.stderr, a.explain()
    assert "preempted: SIGTERM on rank(s) [0]; stopped after step 4" in a.stdout, a.explain()
    hint = f"on another number of GPUs too: add --num_processes M with M in {_process_counts(per_device)}"
    assert hint in a.stdout, a.explain()
    kept = f"now 1 process(es) x {per_device} per device x accumulation {2 * accumulation} = effective batch 8 (kept)"
    assert kept in a.stderr, a.explain()
    # what ran: the strategy itself on one process, at effective batch 8 (DDP on one process: single)
    s, ev = rec["strategy"], rec["strategy"]["evidence"]
    assert s["name"] == ("single" if name == "ddp" else name) and s["world_size"] == ev["world_size"] == 1, s
    assert {
        "ddp": ev["engine_class"] == "DistributedDataParallel",
        "fsdp": ev["dtensor_params"] == ev["params"] > 0 and ev["local_param_fraction"] == 1.0,
        "zero2": ev["zero_stage"] == 2,
        "zero3": ev["zero_stage"] == 3,
    }[name], ev
    assert rec["batch"] | {"input_tokens_per_step": 0, "trained_tokens_per_step": 0} == {
        "per_device": per_device,
        "grad_accum": 2 * accumulation,
        "data_parallel_size": 1,
        "effective": 8,
        "input_tokens_per_step": 0,
        "trained_tokens_per_step": 0,
    }
    worst = _assert_steps_match(rec, ref.record, 4)
    one = "single" if name == "ddp" else name
    segments = [(0, 2, name, accumulation, 8, None), (3, 1, one, 2 * accumulation, 8, RESHARDED[name])]
    assert _segments(rec) == segments, rec["resumes"]
    last = rec["resumes"][-1]
    assert (last["rng"], last["rng_ranks"], last["from_world_size"]) == ("partial", [0], 2), last
    assert last["position"] == {"epoch": 0, "samples_into_epoch": 24, "samples_per_epoch": ROWS}, last
    # the torn checkpoint-5 moved aside untouched, never saved into; checkpoint-4 holds one rank's files
    assert last["superseded"] == ["checkpoint-5.superseded-1"], last
    aside = run_dir / "checkpoint-5.superseded-1"
    assert (aside / r["victim"]).stat().st_size == r["size"] and checkpoints.problem(aside) is not None
    marker = json.loads((run_dir / "checkpoint-4" / checkpoints.MARKER).read_text())
    assert marker["world_size"] == 1 and (marker["run"]["world_size"], marker["run"]["grad_accum"]) == (
        1,
        2 * accumulation,
    ), marker
    files = r["checkpoint_4"]
    assert "checkpoint-4/rng_state.pth" in files and not any(
        "rank_1" in f or "rng_state_" in f or "__1_" in f for f in files
    ), files
    # the checkpoint resumed from is only read; DeepSpeed's universal cache sits beside it
    assert r["hashes_after_a"] == r["hashes_before"]
    universal = run_dir / "checkpoint-3.universal"
    assert universal.is_dir() == (RESHARDED[name] == "universal")
    if universal.is_dir():
        assert last["universal_cache"] == str(universal) and last["conversion_s"] > 0, last
        assert (
            json.loads((universal / "finetune-universal-complete.json").read_text())["source_completed"]
            == json.loads((run_dir / "checkpoint-3" / checkpoints.MARKER).read_text())["completed"]
        )
    # step 4 trained the rows the uninterrupted run trained at step 4 (recounted from the data)
    assert rows_per_step(r["a"].run_dir.parent / f"{name}-a.trace") == {4: rows_per_step(_trace(ref))[4]}
    print(f"{name} 2 -> 1: largest relative loss difference, steps 1-4: {worst:.2e}")


@pytest.mark.parametrize("name", list(RESHARDED))
def test_one_process_resumed_on_two_ranks_then_matches_the_uninterrupted_run(runs, resumed, name):
    from safetensors.torch import load_file

    ref, r = runs(name), resumed(name)
    b = r["b"]
    assert b is not None, f"segment A left no checkpoint-4:\n{r['a'].explain()}"
    assert b.returncode == 0, b.explain()
    per_device, accumulation = shape(name)[:2]  # on each of the 2 ranks; one process: accumulation x 2
    assert f"written by 1 rank(s) x {per_device} per device x accumulation {2 * accumulation}" in b.stderr, b.explain()
    rec = b.record
    s = rec["strategy"]
    assert s["name"] == name and s["world_size"] == s["evidence"]["world_size"] == 2, s
    assert rec["batch"]["grad_accum"] == accumulation and rec["batch"]["effective"] == 8, rec["batch"]
    worst = _assert_steps_match(rec, ref.record, STEPS)
    one = "single" if name == "ddp" else name
    assert _segments(rec) == [
        (0, 2, name, accumulation, 8, None),
        (3, 1, one, 2 * accumulation, 8, RESHARDED[name]),
        (4, 2, name, accumulation, 8, RESHARDED[name]),
    ], rec["resumes"]
    assert [x.get("previous_status") for x in rec["resumes"]] == [None, "completed", "interrupted"]
    # every row once in the epoch, each step the uninterrupted run's rows: steps 1-3 of the original
    # segment, 4 on one process, 5 on two ranks again (recounted from the traces)
    trained = {k: v for k, v in rows_per_step(_trace(ref)).items() if k <= RESUME_FROM}
    trained |= rows_per_step(b.run_dir.parent / f"{name}-a.trace") | rows_per_step(b.run_dir.parent / f"{name}-b.trace")
    assert trained == rows_per_step(_trace(ref)) and sorted(i for v in trained.values() for i in v) == list(range(ROWS))
    # the adapter after step 5's update (Adam state resharded 1 -> 2) is the uninterrupted run's
    got = load_file(b.run_dir / "model" / "adapter_model.safetensors")
    want = load_file(ref.run_dir / "model" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff < 1e-5, diff
    print(f"{name} 1 -> 2: largest relative loss difference, steps 1-5: {worst:.2e}; adapter max abs diff {diff:.2e}")


def _trace(launch):
    return launch.run_dir.with_name(launch.run_dir.name + ".trace")


def test_sigterm_on_one_rank_checkpoints_exits_preempted_and_resumes_exactly(runs, tmp_path, tiny_model_dir):
    """DDP through `finetune train`: SIGTERM from outside to rank 1 only, after step 1, while rank 0
    holds step 2 open (a 5 s pause fault, so the signal lands inside step 2 however fast the machine:
    rank 1 is then waiting in a collective). Both ranks stop at the same step boundary, 2, with a
    complete checkpoint-2, the record says interrupted, the exit code is 75 with "preempted" and the
    resume command; resuming reproduces steps 3..5."""
    import signal
    import time

    import psutil

    from finetune.checkpointing import checkpoints
    from finetune.errors import EXIT_PREEMPTED

    ref = runs("ddp")
    run_dir = tmp_path / "preempted"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **CPU_ENV,
        "FINETUNE_FAULT_INJECT": "pause@rank0,step2",
    }
    cmd = [
        sys.executable,
        "-m",
        "finetune.cli",
        "train",
        "--recipe",
        "ddp",
        "--config_file",
        "accelerate_configs/cpu/ddp.yaml",
        *common_args(tiny_model_dir, "ddp"),
        f"--run.output_dir={run_dir}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        rank1 = None
        while rank1 is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:  # once step 1 is logged: rank 0 is then pausing at the start of step 2
                ready = len(json.loads((run_dir / "run.json").read_text())["steps"]) >= 1
            except (OSError, ValueError, KeyError):
                ready = False
            if ready:
                rank1 = next(
                    c for c in psutil.Process(proc.pid).children(recursive=True) if c.environ().get("RANK") == "1"
                )
        assert rank1 is not None, "training never started"
        rank1.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_tree(proc)  # the ranks too: they run in sessions of their own
            proc.communicate()
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    k = rec["summary"]["steps"]
    assert rec["summary"]["status"] == "interrupted", rec["summary"]
    assert rec["summary"]["error"] == f"preempted by SIGTERM on rank(s) [1] at step {k}", rec["summary"]
    assert k == 2, f"stopped at step {k}, not at the end of step 2, which the signal landed in"
    assert checkpoints.newest_valid(run_dir) == run_dir / f"checkpoint-{k}"
    assert "preempted: SIGTERM on rank(s) [1]" in out and f"--run.output_dir={run_dir} --resume" in out, out[-3000:]
    counts = _process_counts(shape("ddp")[0])
    assert f"on another number of GPUs too: add --num-processes M with M in {counts}" in out, out[-3000:]  # as typed
    run = launch_train(
        ["--recipe", "ddp", *common_args(tiny_model_dir, "ddp"), "--resume"],
        run_dir=run_dir,
        cwd=REPO,
        config_file=STRATEGIES["ddp"][1],
        env=CPU_ENV,
        timeout=420,
    )
    assert run.returncode == 0, run.explain()
    _assert_resumed(run.record, ref.record, "ddp", k)
    assert run.record["summary"]["resume_history"][0]["previous_status"] == "interrupted"
    # the same world size: nothing resharded, every rank's RNG stream restored
    assert [(x["world_size"], x["grad_accum"], x.get("reshard"), x.get("rng")) for x in run.record["resumes"]] == [
        (2, shape("ddp")[1], None, None),
        (2, shape("ddp")[1], "none", "restored"),
    ], run.record["resumes"]


def test_universal_cache_is_built_once_and_reused(resumed):
    """ZeRO-2 2 -> 1 built checkpoint-3.universal; converting again reuses it (nothing rewritten)."""
    from finetune.checkpointing import universal

    ckpt = resumed("zero2")["a"].run_dir / f"checkpoint-{RESUME_FROM}"
    cache = universal.current(ckpt)
    assert cache == ckpt.with_name(ckpt.name + ".universal")
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    assert universal.convert(ckpt) == (cache, None)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == stamps
    assert (cache / "latest_universal").read_text().strip() == "global_step3_universal"
