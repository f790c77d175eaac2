"""The check of a save (finetune/export/live.py, figures.py, reload.py) in this process, on the model a LoRA run of the
demo recipe trains (the tiny random Llama, its adapters moved off their zero start as training moves them): both
checks pass on a faithful save and name what is wrong with a damaged one. Each damage is a control: the same save
undamaged passes. Launched runs with the damage injected: tests/export/test_export_faults.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from finetune.export import figures, live


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, tokenizer):
    """(the live LoRA model, its data section, the folder it was saved in as the run saves it)."""
    from finetune.config.recipe import load_recipe
    from finetune.data import demo
    from finetune.modeling.load import load_model

    root = tmp_path_factory.mktemp("check")
    cfg, _ = load_recipe("demo", [f"--model.name_or_path={tiny_model_dir}", "--model.dtype=float32"])
    train, _ = demo.write_demo(root / "data", 20, 0)
    model = load_model(cfg.model, cfg.method)
    _save_as_trained(model, tokenizer, root / "model")
    return model, dataclasses.replace(cfg.data, path=str(train)), root / "model"


def _save_as_trained(model, tokenizer, folder):
    """lora_B moved off its zero start (seeded), as training leaves it, then the adapter saved to `folder`."""
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _check(data, base, mode: str) -> live.ExportCheck:
    return live.ExportCheck(
        mode=mode,
        data=data,
        compute_dtype="float32",
        load_dtype="float32",
        adapter=True,
        base=str(base),
        quantization=None,
        no_forward=None,
        tensor_parallel=False,
        merged=False,
    )


def _trainer(model):
    """What the check reads of a Trainer: the model, the main-process flag, the autocast context, the device."""
    accelerator = SimpleNamespace(is_main_process=True, autocast=contextlib.nullcontext)
    return SimpleNamespace(model=model, accelerator=accelerator, args=SimpleNamespace(device=torch.device("cpu")))


def _damaged_copy(folder, tmp_path, damage) -> object:
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    damage(copy / "adapter_model.safetensors")
    return copy


def _zero_one(path, key="base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors[key] = torch.zeros_like(tensors[key])
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_stream_check_passes_a_faithful_save_and_names_a_zeroed_tensor(trained, tiny_model_dir, tokenizer, tmp_path):
    model, data, saved = trained
    check = _check(data, tiny_model_dir, "stream")
    section = live.verify(_trainer(model), saved, tokenizer, check, live.probe(check, tokenizer))
    assert section["kind"] == "stream" and section["passed"] and section["tensors"] == 28, section
    assert section["reference_loss"] > 0 and section["saved_loss"] is None  # the stream check computes no logits
    damaged = _damaged_copy(saved, tmp_path, _zero_one)
    with pytest.raises(live.ExportCheckFailed) as failed:
        live.verify(_trainer(model), damaged, tokenizer, check, live.probe(check, tokenizer))
    assert failed.value.section["problems"] == [
        "tensor base_model.model.model.layers.1.mlp.down_proj.lora_B.weight differs from the trained one by up to "
        + failed.value.section["problems"][0].split("by up to ")[1]
    ], failed.value.section


def test_reload_check_compares_the_fresh_process_figures_and_names_a_truncated_file(
    trained, tiny_model_dir, tokenizer, tmp_path
):
    import os

    model, data, saved = trained
    check = _check(data, tiny_model_dir, "reload")
    section = live.verify(_trainer(model), saved, tokenizer, check, live.probe(check, tokenizer))
    assert section["kind"] == "reload" and section["passed"], section
    assert section["max_logit_diff"] <= section["logit_tolerance"] and section["device"] == "cpu", section
    assert abs(section["saved_loss"] - section["reference_loss"]) <= section["loss_tolerance"], section
    assert section["probe"] == {
        "rows": 4,
        "tokens": 128,
        "trained_tokens": section["probe"]["trained_tokens"],
        "source": data.path,
    }
    damaged = _damaged_copy(saved, tmp_path, lambda p: os.truncate(p, p.stat().st_size // 2))
    with pytest.raises(live.ExportCheckFailed) as failed:
        live.verify(_trainer(model), damaged, tokenizer, check, live.probe(check, tokenizer))
    problems = failed.value.section["problems"]
    assert problems[0].startswith("adapter_model.safetensors: cannot be read"), problems
    assert any(p.startswith("model/ does not load: ") for p in problems), problems


def test_a_qlora_save_after_an_eval_forward_passes_the_reload_check_at_fp32s_tolerance(
    trained, tiny_model_dir, tokenizer, tmp_path
):
    """QLoRA as the qlora_baseline recipe runs it on CPU: an eval forward without gradients before training (its
    exact match), then the save. bitsandbytes repacked the live 4-bit layers for its bf16 CPU kernel there, and the
    save unpacked them, so the live model and the fresh process computed 2.9e-3 apart and every such run failed its
    check (finetune/modeling/load.py differentiable_4bit). The live model and the fresh one now compute alike, within
    fp32's tolerance. Control: the same save with one adapter tensor zeroed fails."""
    from finetune.config.sections import MethodConfig, ModelConfig
    from finetune.modeling import load

    _, data, _ = trained
    method = MethodConfig(name="qlora", lora_dropout=0.0)
    model = load.load_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32"), method)
    batch = live.probe(_check(data, tiny_model_dir, "reload"), tokenizer)
    figures.forward(model, batch, "cpu", None)  # eval mode, no gradients: the exact match before training
    _save_as_trained(model, tokenizer, tmp_path / "model")
    quantization = load.quantization_config(method, torch.float32).to_dict()
    check = dataclasses.replace(_check(data, tiny_model_dir, "reload"), quantization=quantization)
    section = live.verify(_trainer(model), tmp_path / "model", tokenizer, check, batch)
    assert section["passed"] and section["logit_tolerance"] < 1e-3, section
    damaged = _damaged_copy(tmp_path / "model", tmp_path, _zero_one)
    with pytest.raises(live.ExportCheckFailed, match="computes other figures"):
        live.verify(_trainer(model), damaged, tokenizer, check, batch)


def test_figures_name_a_zeroed_tensor_even_where_the_logits_barely_move(trained, tiny_model_dir, tokenizer, tmp_path):
    """A zeroed adapter matrix moves this model's logits by ~1e-3 (far past fp32's tolerance); the tensor comparison
    names it whatever the logits do."""
    model, data, saved = trained
    expected = {k.replace(".default.", "."): figures.summary(p) for k, p in model.named_parameters() if p.requires_grad}
    damaged = _damaged_copy(saved, tmp_path, _zero_one)
    found, problems = figures.tensor_stats(damaged)
    assert problems == []
    named, worst = figures.tensor_problems(expected, found)
    assert named == [
        "tensor base_model.model.model.layers.1.mlp.down_proj.lora_B.weight differs from the trained one: norm 0 saved "
        f"(all zeros), {expected['base_model.model.model.layers.1.mlp.down_proj.lora_B.weight']['norm']:.6g} trained"
    ]
    assert worst == 1.0
    assert figures.tensor_problems(expected, figures.tensor_stats(saved)[0]) == ([], 0.0)  # control


def test_a_missing_shard_and_a_key_its_index_lists_are_named(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(folder, max_shard_size="200KB")
    found, problems = figures.tensor_stats(folder)
    assert problems == [] and len(found) == 20
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (folder / last).unlink()
    _, problems = figures.tensor_stats(folder)
    assert problems == [f"{last}: listed in model.safetensors.index.json, missing"]


def test_tolerances_follow_the_unit_roundoff():
    assert figures.TOLERANCE["float32"] == figures.Tolerance(logits=1e-4, loss=1e-5)
    assert figures.TOLERANCE["bfloat16"].logits == 16 * 2**-8 and figures.TOLERANCE["float16"].loss == 2**-13
    # a tensor rounded to bf16 moves its norm by at most u relative: within the bound; a zeroed one is not
    t = torch.randn(1000, dtype=torch.float64)
    rounded = figures.summary(t.to(torch.bfloat16))
    want = figures.summary(t.float())
    assert figures.tensor_problems({"t": want}, {"t": rounded}) == (
        [],
        pytest.approx(abs(rounded["norm"] / want["norm"] - 1)),
    )


def test_auto_streams_where_the_host_cannot_hold_a_second_copy_and_says_so(
    trained, tiny_model_dir, tokenizer, monkeypatch
):
    """`auto` decides from the free host memory (psutil) against the weights a fresh process would load: made to
    see almost none, it streams and says why; `off` checks nothing and says so."""
    import psutil

    model, data, saved = trained
    check = _check(data, tiny_model_dir, "auto")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1024**2))
    section = live.verify(_trainer(model), saved, tokenizer, check, live.probe(check, tokenizer))
    assert section["kind"] == "stream" and section["passed"], section
    assert section["why"].startswith("auto: 0.0 GiB of free host memory cannot hold a second copy"), section["why"]
    off = dataclasses.replace(check, mode="off")
    assert live.probe(off, tokenizer) is None
    assert live.verify(_trainer(None), saved, tokenizer, off, None) == {
        "kind": "off",
        "why": "run.verify_export: off",
        "passed": None,
    }


def test_the_fresh_process_keeps_out_what_the_run_kept_out_and_computes_the_same(trained, tiny_model_dir, tmp_path):
    """The check's process, started ahead as a run starts it (reload.start, importing while the save is written),
    imports no optional package the run's ranks did without (finetune/training/rank_imports.py): loading the save
    needs neither. Control: the same request in a process started for it, without keep_out, imports bitsandbytes
    (peft does, wherever it is installed) and computes the same loss. A process started ahead and not needed ends
    when stopped."""
    import importlib.util

    from safetensors.torch import save_file

    from finetune.export import reload

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed here: nothing to keep out (the control cannot import it)")
    _, _, saved = trained
    ids = torch.arange(32).reshape(2, 16)
    save_file(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}, str(tmp_path / "probe")
    )
    request = {"folder": str(saved), "base": str(tiny_model_dir), "dtype": "float32", "probe": str(tmp_path / "probe")}
    kept = reload.fresh(request, tmp_path / "kept", 300, reload.start(["bitsandbytes", "deepspeed"]))
    plain = reload.fresh(request, tmp_path / "plain", 300)
    assert kept["load_error"] is None and plain["load_error"] is None, (kept, plain)
    assert kept["loaded"] == ["peft"] and "bitsandbytes" in plain["loaded"], (kept["loaded"], plain["loaded"])
    assert kept["loss"] == plain["loss"] and torch.equal(kept["logits"], plain["logits"])
    unused = reload.start([])
    reload.stop(unused)
    assert unused.poll() is not None


def test_an_export_made_before_a_resumed_runs_model_is_named_with_the_command_that_renews_it(tmp_path):
    """A resumed run rewrites model/, and RUN/export, made by `finetune export` from the model/ before, no longer holds
    it: the run's end says so (finetune/training/endings.py logs it), with the command that renews it, the path quoted
    (it has a space). Control: a folder named export that finetune export did not make (the user's) is not named."""
    from finetune.export.command import MARKER, earlier_export

    run = tmp_path / "my run"
    (run / "export").mkdir(parents=True)
    assert earlier_export(run) is None  # the user's own folder named export
    (run / "export" / MARKER).write_text("")
    assert earlier_export(run) == (
        f"{run / 'export'} holds an export of the model/ before this run's; `finetune export '{run}'` renews it"
    )
