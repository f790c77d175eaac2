"""Sequence parallelism (Ulysses under ZeRO-3 and ZeRO-2) and tensor parallelism (AutoTP under ZeRO-2)
engaged for real on CPU (2 processes over gloo, fp32) and shown equivalent to one process on the same
global batch; the mesh read from the live process groups; each token counted once; resume under the same
mesh; runs comparable across meshes (docs/parallelism.md).

One launch each, module-scoped: the tiny random Llama (4 heads, 2 key/value heads), full fine-tuning,
demo data (40 rows) at data.max_length 64 with every token trained (data.train_on_prompt: so a
sequence shard's boundary falls on scored tokens in every row), 4 sequences per micro-batch x
accumulation 2 = 8 sequences per optimizer step: the single process's 4 x 2 x 1 rank, and the mesh
runs' 4 x 2 x data-parallel size 1 (2 ranks / sp 2, or / tp 2). 4 steps, no warmup, clipping at 1.0,
checkpoint at step 2.

Tolerances as tests/training/test_strategies.py (fp32, reduction order only): losses 1e-5 relative
(seen here: at most 2e-7), grad norms 1e-4 (seen: 4e-5 under ZeRO-3, which reduces its norm over
partitions).

Controls, in the same launches (finetune/training/fault_injection.py, docs/faults.md "Drills"): at step 4
the sequence-parallel ranks score their shards with the labels shifted after the split
(sp_late_shift: each shard's last position loses its target, the next shard's first token), and the
tensor-parallel ranks drop the all-reduce that sums their row-parallel partial products
(tp_partial_sums).

Every launch exports the model at the end (run.save_model, the default); tensor parallelism's export
gathers AutoTP's shards into one model that loads in a plain process
(test_tensor_parallel_export_is_the_trained_model_in_one_plain_process). Both move step 4's loss and grad norm by far more than the tolerances (printed by
the test; the near-uniform predictions of the tiny random model damp the loss's response), so the
comparison that passes for steps 1-3 can fail.
"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.conftest import REPO, InPairs, launch_train, logged_steps, own_port, params, wanted
from tests.training.test_strategies import assert_32_true

pytestmark = pytest.mark.integration

STEPS, FAULT_STEP, SAVE = 4, 4, 2
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4
CPU_ENV = {"FINETUNE_CPU_DISTRIBUTED": "1"}
# name -> (recipe, accelerate config, parallel overrides, the fault of the control step)
MESHES = {
    "sp": ("zero3", "accelerate_configs/cpu/zero3.yaml", ["--parallel.sp_size=2"], "sp_late_shift"),
    # ZeRO-1/2 divide the summed gradients by another number than ZeRO-3's reduce-scatter under Ulysses
    # (finetune/training/trainer.py gradient_divisor): a wrong one doubles the grad norm here
    "sp_zero2": ("zero2", "accelerate_configs/cpu/zero2.yaml", ["--parallel.sp_size=2"], "sp_late_shift"),
    "tp": ("zero2", "accelerate_configs/cpu/zero2.yaml", ["--parallel.tp_size=2"], "tp_partial_sums"),
}


def common_args(model_dir) -> list[str]:
    return [
        f"--model.name_or_path={model_dir}",
        "--method.name=full",
        "--data.demo_train_size=40",
        "--data.max_length=64",
        "--data.train_on_prompt=true",
        "--eval.exact_match=false",
        f"--training.max_steps={STEPS}",
        "--training.logging_steps=1",
        "--training.warmup_steps=0",
        "--training.learning_rate=1e-4",
        "--training.lr_scaling=none",
        "--training.max_grad_norm=1.0",
        "--training.seed=42",
        "--training.per_device_train_batch_size=4",
        "--training.gradient_accumulation_steps=2",
        "--training.save_strategy=steps",
        f"--training.save_steps={SAVE}",
    ]  # and the final export: the shipped default


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_model_dir):
    """name -> finished Launch, two at a time (tests/conftest.py InPairs): the one-process reference beside the
    first mesh, the other two meshes together, the resume of the sp run after it."""
    base = tmp_path_factory.mktemp("parallel")

    def launch(name: str):
        args, run_dir = ["--recipe", "demo", *common_args(tiny_model_dir)], base / name
        config, env, port = "accelerate_configs/single_gpu.yaml", {}, []
        if name in MESHES:
            recipe, config, mesh, fault = MESHES[name]
            args = ["--recipe", recipe, *common_args(tiny_model_dir), *mesh]
            env = {**CPU_ENV, "FINETUNE_FAULT_INJECT": f"{fault}@rank0,step{FAULT_STEP};{fault}@rank1,step{FAULT_STEP}"}
            port = own_port()
        elif name == "sp_resumed":  # the sp run's directory, resumed from checkpoint-2 under its mesh, no fault
            recipe, config, mesh, _ = MESHES["sp"]
            args, env = ["--recipe", recipe, *common_args(tiny_model_dir), *mesh, "--resume"], CPU_ENV
            shutil.copytree(get("sp").run_dir, run_dir)
            shutil.rmtree(run_dir / f"checkpoint-{STEPS}")
            port = own_port()
        run = launch_train(args, run_dir=run_dir, cwd=REPO, config_file=config, launch_args=port, env=env, timeout=600)
        assert run.returncode == 0, run.explain()
        return run

    get = InPairs(launch, wanted(request, "runs", lambda item: [*params(item, "name"), "single"]))
    return get


def _steps(record: dict) -> list[dict]:
    return logged_steps(record, STEPS)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(a)


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_engaged_from_the_live_process_groups(runs, name):
    rec = runs(name).record
    s, par = rec["strategy"], rec["strategy"]["parallel"]
    assert s["world_size"] == 2 and s["evidence"]["world_size"] == 2 and par["world_size"] == 2, s
    assert s["name"] == MESHES[name][0] and s["distributed_type"] == "DEEPSPEED", s
    assert_32_true(rec)
    if name.startswith("sp"):
        assert (par["sp"], par["tp"], par["cp"], par["dp_shard"], par["dp_replicate"]) == (2, 1, 1, 1, 1), par
        assert par["ulysses_attention"] is True and par["zero_partition_ranks"] == 2, par  # ZeRO over both
        if name == "sp":
            assert 0.4 <= s["evidence"]["local_param_fraction"] <= 0.6, s["evidence"]
    else:
        assert (par["sp"], par["tp"], par["cp"], par["dp_shard"], par["dp_replicate"]) == (1, 2, 1, 1, 1), par
        # AutoTP split the 7 linear layers of each of the 2 blocks; each rank holds half of their weights
        assert par["tp_layers"] == 14 and par["tp_local_weight_fraction"] == 0.5, par
        assert rec["speed"]["loss_impl"]["resolved"] == "standard", rec["speed"]  # AutoTP's own head
        # run.json `nodes` counts each rank's share of the split layers against the whole model, which
        # one process holds whole
        nodes, whole = rec["nodes"], runs("single").record["nodes"]["ranks"][0]["params_full"]
        assert nodes["param_partition"].startswith("autotp splits"), nodes
        assert all(r["params_full"] == whole > r["params_local"] for r in nodes["ranks"]), (nodes, whole)
    assert "DeepSpeed engine groups" in par["source"], par
    b = rec["batch"]
    assert (b["per_device"], b["grad_accum"], b["data_parallel_size"], b["effective"]) == (4, 2, 1, 8), b
    assert rec["resumes"][0]["mesh"] == {k: par[k] for k in ("sp", "tp", "cp")}, rec["resumes"]


@pytest.mark.parametrize("name", list(MESHES))
def test_losses_match_one_process_and_the_control_step_does_not(runs, name):
    ref, got = _steps(runs("single").record), _steps(runs(name).record)
    assert runs("single").record["batch"]["effective"] == 8
    assert ref[-1]["loss"] < ref[0]["loss"] - 1e-3, ref  # the model learned: equal losses prove something
    worst = 0.0
    for a, b in zip(ref[: FAULT_STEP - 1], got[: FAULT_STEP - 1]):
        worst = max(worst, _rel(a["loss"], b["loss"]))
        assert _rel(a["loss"], b["loss"]) <= LOSS_RTOL, (name, a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=GRAD_NORM_RTOL), (name, a, b)
    a, b = ref[FAULT_STEP - 1], got[FAULT_STEP - 1]
    control, control_norm = _rel(a["loss"], b["loss"]), _rel(a["grad_norm"], b["grad_norm"])
    assert control > 10 * LOSS_RTOL and control_norm > 10 * GRAD_NORM_RTOL, (name, a, b)
    print(
        f"{name}: steps 1-{FAULT_STEP - 1} largest relative loss difference {worst:.2e}; control at step "
        f"{FAULT_STEP}: loss {control:.2e}, grad norm {control_norm:.2e}"
    )


@pytest.mark.parametrize("name", list(MESHES))
def test_each_token_is_counted_once(runs, name):
    """Tokens, examples and the attention lengths behind MFU summed over ranks equal one process's
    counts of the same batches: Ulysses ranks count their shards and the rows once; of the
    tensor-parallel ranks, which see the same batch, only the first counts it."""
    ref, got = _steps(runs("single").record), _steps(runs(name).record)
    for a, b in zip(ref, got):
        assert (a["trained_tokens"], a["input_tokens"], a["examples"]) == (
            b["trained_tokens"],
            b["input_tokens"],
            b["examples"],
        ), (name, a, b)
    one, mesh = runs("single").record, runs(name).record
    for key in ("input_tokens_per_step", "trained_tokens_per_step"):
        assert one["batch"][key] == mesh["batch"][key], (key, one["batch"], mesh["batch"])
    assert one["summary"]["total_trained_tokens"] == mesh["summary"]["total_trained_tokens"]


def test_sequence_parallel_run_resumes_under_its_own_mesh(runs):
    rec, ref = runs("sp_resumed").record, _steps(runs("single").record)
    assert rec["summary"]["status"] == "completed" and rec["summary"]["resumed_from"].endswith(f"checkpoint-{SAVE}")
    assert rec["strategy"]["parallel"]["sp"] == 2 and rec["resumes"][-1]["mesh"] == {"sp": 2, "tp": 1, "cp": 1}
    got = _steps(rec)
    for a, b in zip(ref, got):  # steps 3 and 4 retrained without the control's fault
        assert _rel(a["loss"], b["loss"]) <= LOSS_RTOL, (a, b)


def test_runs_on_different_meshes_at_the_same_effective_batch_are_comparable(runs):
    """`finetune compare`'s comparability (finetune/compare/comparable.py) keys on the effective batch,
    not on the world size or mesh: one process, 2 Ulysses ranks and 2 tensor-parallel ranks at 8
    sequences per step compare; the same record at another effective batch does not (the control)."""
    import copy

    from finetune.compare import comparable
    from finetune.compare.table import Run, load_runs

    loaded = load_runs([runs(name).run_dir for name in ("single", "sp", "tp")])
    assert [r.get("strategy", "parallel", "sp") for r in loaded] == [1, 2, 1]
    assert comparable.warnings(loaded) == []
    record = copy.deepcopy(loaded[1].record)
    record["batch"]["effective"] = 16
    other = Run(loaded[1].path, record, label="sp-16")
    assert any("batch.effective differs" in w for w in comparable.warnings([loaded[0], other]))


def test_tensor_parallel_export_is_the_trained_model_in_one_plain_process(runs, tiny_model_dir):
    """The tp run (defaults: export on) completed with one consolidated model in model/: every tensor
    equals the trained one, which DeepSpeed's own checkpoint of the last step holds as each rank's AutoTP
    shard (global_stepN/mp_rank_0R_model_states.pt, concatenated here along the dimension AutoTP split);
    loaded in this plain process with from_pretrained it gives the logits of a model built from those
    shards, bit for bit, and it is not the untrained model. Before: Trainer.save_model wrote no weights
    under AutoTP ("stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead"),
    the run failed on rank 0 alone and the ranks hung (the tests passed only with run.save_model false)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = runs("tp")
    assert run.record["summary"]["status"] == "completed", run.record["summary"]
    # the save's own check compared whole-vocabulary logits: AutoTP's vocabulary-parallel head leaves each rank
    # half of them, gathered for the check (before: "Target ... is out of bounds" failed the run)
    check = run.record["export"]["check"]
    assert check["kind"] == "reload" and check["passed"] and check["max_logit_diff"] <= check["logit_tolerance"], check
    exported = load_file(str(run.run_dir / "model" / "model.safetensors"))
    step_dir = run.run_dir / f"checkpoint-{STEPS}" / f"global_step{STEPS}"
    shards = [torch.load(step_dir / f"mp_rank_0{r}_model_states.pt", weights_only=False)["module"] for r in (0, 1)]
    assert set(shards[0]) == set(exported), (sorted(shards[0]), sorted(exported))
    trained, split = {}, 0
    for key, whole in exported.items():
        a, b = shards[0][key], shards[1][key]
        dims = [d for d, (x, y) in enumerate(zip(a.shape, whole.shape)) if x != y]
        split += bool(dims)
        trained[key] = torch.cat([a, b], dims[0]) if dims else a
        assert torch.equal(trained[key], whole), key
    assert split >= 16, split  # AutoTP split 7 linear layers per block (2 blocks), the head and the embedding
    untrained = load_file(str(tiny_model_dir / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(untrained[key], exported[key])

    model = AutoModelForCausalLM.from_pretrained(run.run_dir / "model", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference.load_state_dict(trained)
    ids = torch.tensor([[1, 17, 230, 4000, 12, 9, 300, 77]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
