"""`finetune plan`, `finetune bench-comm` and run.json's predicted_memory, each checked against
something computed outside the code under test: the ZeRO paper's formulas, bitsandbytes' own
4-bit quantization, peft's own adapters, the tensors autograd really saves, the nccl-tests
bus-bandwidth factors, and real runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.errors import UserError
from finetune.planning import comm, memory, params, report
from tests.conftest import REPO, launch_train

GIB = 2**30
CONFIGS = REPO / "docs" / "model_configs"


def tiny_llama_config(**kw):
    from transformers import LlamaConfig

    values = {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2}
    return LlamaConfig(**{**values, **kw})


def workload(method="full", **kw):
    return memory.Workload(method=method, micro_batch=2, seq_len=64, **kw)


@pytest.mark.parametrize("strategy, stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_zero_model_states_in_the_plan_are_the_papers(strategy, stage, n):
    """16-bit full fine-tuning under DeepSpeed: params + grads + optimizer = the ZeRO paper's formula."""
    shape = memory.shape_of(tiny_llama_config())
    device, host = memory.components(shape, workload(weight_bytes=2), strategy, n)
    states = device["weights"] + device["gradients"] + device["optimizer_states"]
    assert states == pytest.approx(params.zero_model_states_bytes(shape.params.total, n, stage))
    assert host == {}


def test_torch_native_strategies_keep_no_master_copy_and_ddp_keeps_its_buckets():
    shape = memory.shape_of(tiny_llama_config())
    psi, n = shape.params.total, 4
    ddp, _ = memory.components(shape, workload(weight_bytes=2), "ddp", n)
    # bf16 weights, bf16 grads, a bucket copy of the grads (gradient_as_bucket_view=False), AdamW m+v in bf16
    assert ddp["weights"] + ddp["gradients"] + ddp["ddp_grad_buckets"] + ddp["optimizer_states"] == 10 * psi
    fsdp, _ = memory.components(shape, workload(weight_bytes=2), "fsdp", n)
    assert fsdp["weights"] + fsdp["gradients"] + fsdp["optimizer_states"] == pytest.approx(8 * psi / n)
    offload_dev, offload_host = memory.components(shape, workload(weight_bytes=2), "fsdp_offload", n)
    assert "weights" not in offload_dev and offload_host["weights"] == pytest.approx(2 * psi / n)


def test_nf4_bytes_per_parameter_match_bitsandbytes():
    """NF4 with double quantization, blocksize 64: what bitsandbytes actually stores per parameter."""
    import bitsandbytes.functional as bnbf

    weight = torch.randn(256, 512)
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size() \
        + state.state2.absmax.numel() * state.state2.absmax.element_size()
    assert memory.NF4_BITS[True] == pytest.approx(8 * stored / weight.numel())
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type="nf4")
    stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
    assert memory.NF4_BITS[False] == pytest.approx(8 * stored / weight.numel())


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_parameter_count_matches_peft(targets):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config()
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert memory.shape_of(cfg).lora_params(8, targets) == trainable


def test_activation_formula_matches_the_tensors_autograd_saves():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=4, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    predicted = memory.activation_bytes(memory.shape_of(cfg), workload(weight_bytes=4))
    saved_log_softmax = 4 * 2 * 64 * cfg.vocab_size  # the one b x s x V tensor the fp32 loss saves
    assert predicted["activations"] + saved_log_softmax == pytest.approx(sum(saved.values()), rel=0.05)


def test_communication_volumes_follow_the_zero_paper():
    """ZeRO paper §7: ZeRO-2 moves what DDP moves (2Ψ), ZeRO-3/FSDP 1.5x that (3Ψ), ring factors per nccl-tests."""
    shape = memory.shape_of(tiny_llama_config())
    n, w = 4, workload(weight_bytes=2)
    psi_bytes = 2 * shape.params.total
    total = {s: sum(comm.step_traffic(shape, w, s, n)["collectives"].values())
             for s in ("ddp", "zero2", "zero3", "fsdp")}
    assert total["ddp"] == pytest.approx(2 * (n - 1) / n * psi_bytes)
    assert total["zero2"] == pytest.approx(total["ddp"])
    assert total["zero3"] == pytest.approx(1.5 * total["ddp"]) and total["fsdp"] == pytest.approx(total["zero3"])
    times = comm.step_time(comm.step_traffic(shape, w, "ddp", n), busbw_gbs=10.0, h2d_gbs=None)
    assert times["collectives_s"] == pytest.approx(total["ddp"] / 10e9)


def _row(strategy, device_gib, host_gib=1.0, method="full"):
    return {"method": method, "strategy": strategy, "device": {"total_gib": device_gib},
            "host_per_node_gib": host_gib, "device_fraction": device_gib / 24, "host_fraction": host_gib / 64,
            "fits": device_gib <= 0.9 * 24 and host_gib <= 0.9 * 64,
            "fits_without_margin": device_gib <= 24 and host_gib <= 64}


@pytest.mark.parametrize("sizes, expected", [
    ({"ddp": 10, "zero2": 8, "zero3": 5, "fsdp": 5, "zero2_offload": 3}, "ddp"),  # fits -> DDP
    ({"ddp": 23, "zero2": 20, "zero3": 12, "fsdp": 12, "zero2_offload": 9}, "zero2"),  # barely -> ZeRO-2
    ({"ddp": 40, "zero2": 30, "zero3": 18, "fsdp": 18, "zero2_offload": 25}, "fsdp"),  # no -> FSDP/ZeRO-3
    ({"ddp": 80, "zero2": 60, "zero3": 30, "fsdp": 30, "zero2_offload": 20}, "zero2_offload"),  # GPU short
    ({"ddp": 80, "zero2": 60, "zero3": 30, "fsdp": 30, "zero2_offload": 40}, None),  # nothing fits
])
def test_recommendation_is_the_fastest_that_fits_with_a_margin(sizes, expected):
    rows = [_row(s, g) for s, g in sizes.items()] + [_row("ddp", 1, method="lora")]
    rec = report.recommend(rows, "full", 24 * GIB, 64 * GIB, world=2)
    assert rec["strategy"] == expected
    assert {s["strategy"] for s in rec["does_not_fit"]} == {s for s, g in sizes.items() if g > 0.9 * 24}


def test_offload_is_refused_when_the_host_is_short_too():
    rows = [_row("ddp", 40), _row("zero2_offload", 10, host_gib=70)]
    rec = report.recommend(rows, "full", 24 * GIB, 64 * GIB, world=2)
    assert rec["strategy"] is None and "host needs 70.0 GiB" in rec["does_not_fit"][1]["problem"]


def run_plan(capsys, *args) -> subprocess.CompletedProcess:
    """`finetune plan ARGS` in this process (the CLI's own entry point; a subprocess would pay the
    imports again): exit code, stdout, stderr."""
    from finetune.cli.dispatch import main

    capsys.readouterr()
    try:
        code = main(["plan", *args])
    except SystemExit as e:  # user errors: message on stderr, exit 2
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_plan_cli_on_published_shapes_recommends_what_the_arithmetic_says(capsys):
    """Llama-3.2-1B full fine-tuning on 2 x 80 GiB: torch-native DDP holds 10 bytes/param, far under 72 GiB
    -> ddp. Llama-3.1-8B on 2 x 24 GiB: even ZeRO-3's sharded states (16Ψ/2 = 64 GB) exceed the GPU, so only an
    offload can fit; ZeRO-Offload leaves the 16-bit parameters (2Ψ = 16 GB) on the device with room for b=4 x 128
    tokens of activations, and it is the fastest offload, given host memory for the states (ZeRO-Offload paper)."""
    small = run_plan(capsys, "--recipe", "ddp", "--model", str(CONFIGS / "Llama-3.2-1B.json"), "--gpus", "2",
                     "--gpu-memory", "80GiB", "--method.name=full", "--json")
    assert small.returncode == 0, small.stderr
    plan = json.loads(small.stdout)
    assert 10 * plan["model"]["parameters"] < 0.9 * 80 * GIB
    assert plan["recommendation"]["strategy"] == "ddp" and plan["method"] == "full"
    big = run_plan(capsys, "--recipe", "ddp", "--model", str(CONFIGS / "Llama-3.1-8B.json"), "--gpus", "2",
                   "--gpu-memory", "24GiB", "--host-memory", "256GiB", "--method.name=full", "--json")
    assert big.returncode == 0, big.stderr
    plan = json.loads(big.stdout)
    psi = plan["model"]["parameters"]
    assert psi == 8_030_261_248  # Llama-3.1-8B's published parameter count
    assert 16 * psi / 2 > 24 * GIB
    assert 2 * psi < 0.9 * 24 * GIB < 16 * psi / 2
    assert plan["recommendation"]["strategy"] == "zero2_offload"
    rows = {(r["method"], r["strategy"]): r for r in plan["rows"]}
    assert not rows[("full", "zero3")]["fits"] and rows[("qlora", "ddp")]["fits"]
    for r in plan["rows"]:
        assert r["device"]["total_gib"] == pytest.approx(sum(r["device"]["components_gib"].values()), abs=1e-3)
        assert {"collectives_bytes", "host_device_bytes", "collectives_s"} <= set(r["communication"])


def test_plan_cli_text_on_a_model_dir_and_clear_errors(tiny_model_dir, tmp_path, capsys):
    out = run_plan(capsys, "--recipe", "demo", "--model", str(tiny_model_dir), "--bandwidth", "12.5")
    assert out.returncode == 0, out.stderr
    assert "recommendation for lora: single" in out.stdout and "12.5 GB/s" in out.stdout
    assert "differs from DeepSpeed's estimators" in out.stdout
    missing = run_plan(capsys, "--recipe", "demo", "--model", "nobody/not-cached-model")
    assert missing.returncode == 2 and "config.json" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for args, needle in [(["--gpu-memory", "lots"], "--gpu-memory"), (["--bandwidth", str(bad)], "bench-comm"),
                         (["--gpus", "0"], "--gpus")]:
        proc = run_plan(capsys, "--recipe", "demo", "--model", str(tiny_model_dir), *args)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


@pytest.mark.integration
def test_bench_comm_two_cpu_processes(tmp_path):
    out = tmp_path / "comm.json"
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "bench-comm", "--cpu", "--num_processes", "2",
                           "--sizes", "64KiB", "1MiB", "--iters", "2", "--warmup", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert report["verified"] == {"all_reduce": True, "reduce_scatter": True, "all_gather": True}
    factors = {"all_reduce": 2 * (2 - 1) / 2, "reduce_scatter": (2 - 1) / 2, "all_gather": (2 - 1) / 2}
    assert {(r["op"], r["bytes"]) for r in report["results"]} == {(op, b) for op in factors for b in (65536, 2**20)}
    for r in report["results"]:
        assert r["time_s"] > 0 and r["algbw_gbs"] > 0 and r["busbw_gbs"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * factors[r["op"]])
        assert r["bytes_per_rank"] == round(r["bytes"] * factors[r["op"]])
    assert report["host_device"]["h2d_gbs"] is None and "no GPU" in report["host_device"]["note"]
    bw = comm.read_bandwidth(str(out))
    assert bw["busbw_gbs"] == max((r for r in report["results"] if r["op"] == "all_reduce"),
                                  key=lambda r: r["bytes"])["busbw_gbs"]


def test_bench_comm_refuses_to_run_outside_a_launch(monkeypatch):
    from finetune.planning import bench_comm

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match="processes of a launch"):
        bench_comm.main([])
    with pytest.raises(UserError, match="at least 2"):
        bench_comm.launch_args([], cpu=True, num_processes=1)


@pytest.mark.integration
def test_cpu_run_records_predicted_memory_beside_measured_rss(tmp_path, tiny_model_dir):
    run = launch_train(["--recipe", "demo", f"--model.name_or_path={tiny_model_dir}", "--data.demo_train_size=16",
                        "--eval.exact_match=false", "--training.max_steps=2", "--training.logging_steps=1",
                        "--run.save_model=false"],
                       run_dir=tmp_path / "run", cwd=REPO, config_file="accelerate_configs/single_gpu.yaml",
                       timeout=300)
    assert run.returncode == 0, run.explain()
    rec = run.record
    pred = rec["predicted_memory"]
    assert pred["strategy"] == rec["strategy"]["name"] == "single" and pred["method"] == "lora"
    assert pred["world_size"] == 1 and pred["device"] is None  # a CPU run: the host is the device
    comps = pred["host"]["components_gib"]
    assert {"frozen_weights", "lora_adapters", "optimizer_states", "activations", "logits",
            "process_baseline"} <= set(comps)
    assert pred["host"]["total_gib"] == pytest.approx(sum(comps.values()), abs=1e-3)
    measured = rec["memory"]["max"]["host_peak_rss_gib"]
    err = pred["error"]["host"]
    assert err["measured_gib"] == measured > 0
    assert err["relative_error"] == pytest.approx((pred["host"]["total_gib"] - measured) / measured, abs=1e-3)
    assert pred["error"]["device"] is None
    frozen = sum(p.numel() for p in _load(tiny_model_dir).parameters()) * 4 / GIB  # fp32 on CPU
    assert comps["frozen_weights"] == pytest.approx(frozen, abs=1e-4)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)
