"""The parallel mesh (finetune/mesh.py, docs/parallelism.md) without launching: its arithmetic, the launch
plan's data-parallel size and what every consumer reads from it, what engages it (TrainingArguments),
the recipe rules, batches cut for it, tokens counted once, the loss under AutoTP, the gradient divisor
read from a DeepSpeed engine, the live mesh check, and the planner's sharded shapes. Launched runs:
tests/training/test_parallel.py."""

from __future__ import annotations

import pytest
import torch

from finetune import batch
from finetune import mesh as meshes
from finetune.config.recipe import load_recipe
from finetune.errors import ConfigError, UserError
from finetune.launch.configs import DeclaredLaunch
from finetune.launch.plan import LaunchPlan


def plan_for(recipe: str, overrides: list[str], *, world: int, ds: dict | None = None) -> tuple:
    cfg, _ = load_recipe(recipe, overrides)
    facts = DeclaredLaunch(source="test", distributed_type="DEEPSPEED", num_processes=world, use_cpu=True)
    facts.deepspeed = ds if ds is not None else {"zero_optimization": {"stage": 3}}
    facts.deepspeed_source = "DeepSpeed config test.json"
    return cfg, LaunchPlan.of(cfg, facts)


# --- the arithmetic and the launch plan ------------------------------------------------------------


@pytest.mark.parametrize(
    "world, sizes, dp, divides",
    [(2, {}, 2, True), (2, {"sp": 2}, 1, True), (8, {"sp": 2, "tp": 2}, 2, True), (3, {"sp": 2}, 1, False)],
)
def test_data_parallel_size_is_the_world_over_the_model_parallel_ranks(world, sizes, dp, divides):
    m = meshes.Mesh(world=world, **sizes)
    assert (m.dp, m.divides) == (dp, divides)
    assert m.model_parallel * (m.dp if divides else 0) == (world if divides else 0)


def test_the_launch_plan_carries_the_mesh_and_everything_counts_with_its_data_parallel_size():
    from finetune.training import arguments

    cfg, launch = plan_for(
        "zero3",
        ["--parallel.sp_size=2", "--training.lr_scaling=linear", "--training.lr_reference_batch_size=8"],
        world=4,
    )
    assert launch.mesh == meshes.Mesh(world=4, sp=2) and launch.data_parallel_size == 2
    assert launch.effective_batch(4, 1) == 8  # 4 per device x 1 x (4 / 2), not x 4
    run = arguments.for_run(cfg, launch, output_dir="/tmp/mesh-test", run_name="t")
    assert run.batch["data_parallel_size"] == 2 and run.batch["effective"] == 8
    assert run.lr["factor"] == 1.0  # linear scaling at the reference batch: the world size would double it
    pc = run.args.parallelism_config
    assert (pc.sp_size, pc.sp_backend, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (2, "deepspeed", 2, 1, 1)
    assert pc.sp_handler.sp_seq_length_is_variable and pc.sp_handler.sp_attn_implementation == "sdpa"


def test_tensor_parallelism_adds_autotp_to_the_launchs_own_deepspeed_config():
    from finetune.training.arguments import mesh_arguments

    ds = {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}
    cfg, launch = plan_for("zero2", ["--parallel.tp_size=2", "--method.name=full"], world=2, ds=ds)
    out = mesh_arguments(cfg, launch)
    # AutoTP, and the export gathering its shards into one model (the default path saves the model)
    gathered = {"stage": 2, "gather_16bit_weights_on_model_save": True}
    expected = {**ds, "zero_optimization": gathered, "tensor_parallel": {"autotp_size": 2}}
    assert out["deepspeed"] == expected and "parallelism_config" not in out
    assert ds == {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}  # the launch's own, untouched
    assert mesh_arguments(*plan_for("zero2", [], world=2)) == {}  # no mesh: nothing added


# --- the recipe rules (finetune/config/validate.py) -------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["--parallel.sp_size=0"], "parallel.sp_size: must be >= 1, got 0"),
        (["--parallel.pp_size=4"], "Trainer has no pipeline schedule"),
        (["--parallel.sp_size=2", "--parallel.cp_size=2"], "cannot be combined"),
        (["--parallel.tp_size=2", "--parallel.sp_size=2", "--method.name=full"], "not composed with sequence"),
        (["--parallel.sp_size=4", "--data.max_length=130"], "data.max_length 130 is not divisible by sp_size = 4"),
        (["--parallel.cp_size=2", "--data.max_length=130"], "not divisible by 2 x cp_size = 4"),
        (["--parallel.sp_size=2", "--data.padding_free=true"], "data.padding_free: true with parallel.sp_size"),
        (["--parallel.sp_size=2", "--model.attn_implementation=eager"], "model.attn_implementation 'eager'"),
        (["--parallel.sp_size=2", "--training.label_smoothing_factor=0.1"], "label_smoothing_factor 0.1"),
        (["--parallel.tp_size=2"], "method.name 'lora' with parallel.tp_size 2"),
    ],
)
def test_each_recipe_rule_refuses_with_the_values_and_the_fix(overrides, expect):
    with pytest.raises(ConfigError) as e:
        load_recipe("zero3", overrides)
    assert any(expect in p for p in e.value.problems), e.value.problems


def test_the_shipped_mesh_recipes_load():
    sp, _ = load_recipe("zero3_sp", [])
    tp, _ = load_recipe("zero2_tp", [])
    assert (sp.parallel.sp_size, sp.run.strategy, sp.data.max_length % 2) == (2, "zero3", 0)
    assert (tp.parallel.tp_size, tp.run.strategy, tp.method.name) == (2, "zero2", "full")


# --- the launch rules (finetune/preflight/parallel.py) ----------------------------------------------


def test_an_accelerate_configs_parallelism_sizes_must_be_the_recipes(monkeypatch, tiny_model_dir):
    from finetune.preflight import parallel

    cfg, launch = plan_for("zero3", ["--parallel.sp_size=2", f"--model.name_or_path={tiny_model_dir}"], world=2)
    assert parallel.problems(cfg, launch, in_process=False) == []
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    (problem,) = parallel.problems(cfg, launch, in_process=False)
    assert "PARALLELISM_CONFIG_SP_SIZE=4" in problem and "--parallel.sp_size=4" in problem


def test_tensor_parallel_heads_are_checked_against_the_models_config(tiny_model_dir):
    from finetune.preflight import parallel

    cfg, launch = plan_for(
        "zero2",
        ["--parallel.tp_size=4", "--method.name=full", f"--model.name_or_path={tiny_model_dir}"],
        world=4,
        ds={"zero_optimization": {"stage": 2}},
    )
    (problem,) = parallel.problems(cfg, launch, in_process=False)  # 4 heads, 2 key/value heads
    assert "has 4 attention heads and 2 key/value heads" in problem and "allowed here: 2" in problem


# --- batches, counts, loss ---------------------------------------------------------------------------


def test_sequence_parallel_batches_are_cut_evenly_with_positions_and_filler_rows():
    from finetune.data.collate import REAL_TOKENS_KEY, SequenceShards, sharded_batch

    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}]
    b = sharded_batch(rows, 0, None, SequenceShards(sp=4, rows=2, length=None))
    assert b["input_ids"].shape == (2, 4) and b["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]  # the filler row is no token
    assert (b["labels"][1] == -100).all()
    fixed = sharded_batch(rows, 0, 3, SequenceShards(sp=2, rows=1, length=8))  # gloo: data.max_length
    assert fixed["input_ids"].shape == (1, 12)  # 8 rounded up to a multiple of lcm(3, 2)
    cp = sharded_batch(rows, 0, None, SequenceShards(sp=4, rows=1, length=None, mask=False))
    assert "attention_mask" not in cp and cp[REAL_TOKENS_KEY].tolist() == [3]


def test_tokens_rows_and_lengths_of_a_sequence_split_batch_count_once(monkeypatch):
    """Two Ulysses shards of one batch counted on their ranks sum to the batch's own counts; a
    tensor-parallel rank that is not its group's first counts nothing. The SP group's all-reduce
    is played by a stand-in that adds the other shard's row lengths."""
    import torch.distributed as dist

    from finetune.telemetry.meter import BatchShare, batch_counts

    full = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3]),
        "labels": torch.tensor([[-100, 1, 2, 3, 4, 5, 6, 7], [-100, -100, 2, 3, 4, -100, -100, -100]]),
    }
    shift = torch.nn.functional.pad(full["labels"], (0, 1), value=-100)[..., 1:]
    shards = [
        {
            "input_ids": full["input_ids"][:, s],
            "attention_mask": full["attention_mask"][:, s],
            "shift_labels": shift[:, s],
        }
        for s in (slice(0, 4), slice(4, 8))
    ]
    lengths = [sh["attention_mask"].sum(-1) for sh in shards]
    got = []
    for rank, sh in enumerate(shards):
        monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, r=rank: t.add_(lengths[1 - r]))
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        got.append(batch_counts(sh, BatchShare(sp_group=object())))
    assert (got[0] + got[1]).tolist() == batch_counts(full).tolist()  # [13, 10, 2, 64 + 25]
    assert batch_counts(full, BatchShare(counted=False)).tolist() == [0, 0, 0, 0]


def test_autotps_split_head_takes_the_standard_loss(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from finetune.modeling import loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    impl, why = loss.resolve("auto", model, tensor_parallel=2)
    assert impl == "standard" and "AutoTP replaces the output head" in why
    with pytest.raises(ConfigError, match="chunked cannot replace"):
        loss.resolve("chunked", model, tensor_parallel=2)


@pytest.mark.parametrize("stage, reduce_scatter, divisor", [(2, True, 2), (1, False, 2), (3, True, 4), (3, False, 2)])
def test_the_gradient_divisor_is_read_per_zero_path(stage, reduce_scatter, divisor):
    """4 ranks, sp 2: ZeRO-1/2 and ZeRO-3's contiguous all-reduce divide by world / sp, ZeRO-3's
    reduce-scatter by the world (the DeepSpeed lines in finetune/training/trainer.py gradient_divisor)."""
    from types import SimpleNamespace

    from finetune.training.trainer import gradient_divisor

    engine = SimpleNamespace(
        seq_dp_world_size=4,
        sequence_parallel_size=2,
        optimizer=SimpleNamespace(reduce_scatter=reduce_scatter),
        zero_optimization_stage=lambda: stage,
    )
    assert gradient_divisor(engine) == divisor


def test_a_live_mesh_other_than_the_recipes_is_refused():
    from finetune.training.strategy_evidence import check_mesh

    live = {"sp": 1, "tp": 1, "cp": 1, "dp_replicate": 1, "dp_shard": 2, "source": "DeepSpeed engine groups"}
    check_mesh(live, meshes.Mesh(world=2), "zero3")  # as planned: passes
    with pytest.raises(UserError, match=r"asks for the mesh \{'sp': 2.*show \{'sp': 1"):
        check_mesh(live, meshes.Mesh(world=2, sp=2), "zero3_sp")


# --- resume -----------------------------------------------------------------------------------------


def _written(mesh: dict | None, world: int = 2):
    from finetune.checkpointing.provenance import Written

    return Written(
        "runs/x/checkpoint-2", 2, world, source="test", strategy="zero3", per_device=4, grad_accum=2, effective=8,
        mesh=mesh,
    )  # fmt: skip


def test_a_checkpoint_resumes_under_its_mesh_with_the_accumulation_of_its_data_parallel_size():
    from finetune.checkpointing import resume_plan

    cfg, _ = load_recipe("zero3", ["--parallel.sp_size=2", "--training.gradient_accumulation_steps=2"])
    launch = resume_plan.launch_from(cfg, strategy="zero3", offload="none", world_size=2, overrides=[])
    p = resume_plan.plan(_written({"sp": 2, "tp": 1, "cp": 1}), launch)
    assert (p.grad_accum, p.data_parallel, p.effective_now, p.reshard) == (2, 1, 8, "none")


@pytest.mark.parametrize(
    "mesh, world, launch_sp, expect",
    [
        ({"sp": 2, "tp": 1, "cp": 1}, 2, 1, "written under the mesh sp 2 x tp 1 x cp 1 on 2 rank(s)"),
        (None, 2, 2, "written under the mesh sp 1 x tp 1 x cp 1"),
        ({"sp": 2, "tp": 1, "cp": 1}, 4, 2, "this launch has 2 process(es)"),
    ],
)
def test_another_mesh_or_world_under_a_mesh_is_refused_naming_what_works(mesh, world, launch_sp, expect):
    from finetune.checkpointing import resume_plan

    cfg, _ = load_recipe("zero3", [f"--parallel.sp_size={launch_sp}"])
    launch = resume_plan.launch_from(cfg, strategy="zero3", offload="none", world_size=2, overrides=[])
    with pytest.raises(ConfigError) as e:
        resume_plan.plan(_written(mesh, world), launch)
    assert any(expect in p and "--parallel.sp_size=" in p for p in e.value.problems), e.value.problems


# --- the planner -------------------------------------------------------------------------------------


def test_a_tensor_parallel_rank_holds_its_share_of_the_blocks():
    from finetune.planning.shapes import shape_of
    from tests.planning import mechanism as mech

    sh = shape_of(mech.config())
    local = sh.tp_local(2)
    assert (local.heads, local.kv_heads, local.intermediate) == (2, 1, sh.intermediate // 2)
    assert local.layer_linear_params * 2 == sh.layer_linear_params
    assert sh.params.total - local.params.total == sh.layers * sh.layer_linear_params // 2
    assert sh.tp_local(1) is sh


def test_finetune_plan_shows_the_mesh_and_only_the_strategies_that_run_it(tiny_model_dir, capsys):
    from finetune.cli import dispatch

    code = dispatch.main(
        ["plan", "--recipe", "zero3", "--model", str(tiny_model_dir), "--gpus", "2", "--parallel.sp_size=2", "--all"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "mesh: data parallel 1 x sp 2 x tp 1 x cp 1" in out, out
    strategies = {line.split()[1] for line in out.splitlines() if line.startswith(("full ", "lora ", "qlora "))}
    assert strategies and strategies <= {
        "zero1",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload_opt",
        "zero3_offload",
    }
    with pytest.raises(SystemExit):  # 3 GPUs cannot hold sp 2
        dispatch.main(
            ["plan", "--recipe", "zero3", "--model", str(tiny_model_dir), "--gpus", "3", "--parallel.sp_size=2"]
        )
    assert "does not divide the 3 GPU(s) planned" in capsys.readouterr().err


def test_the_sizes_offered_for_the_models_heads_run_on_the_launchs_processes(tiny_model_dir):
    """4 heads, 2 key/value heads: sp_size 2 or 4 fits the model, but on 6 processes only 2 divides the
    world (4 was offered too, and refused on the next try); on 3 processes none does."""
    from finetune.preflight import parallel

    over = ["--parallel.sp_size=3", "--data.max_length=48", f"--model.name_or_path={tiny_model_dir}"]
    for world, offered in (
        (6, "allowed here: 2"),
        (3, "allowed here: none on 3 processes (keep it at 1; 2 runs on a multiple of 2 processes)"),
    ):
        (problem,) = parallel.problems(*plan_for("zero3", over, world=world), in_process=False)
        assert "has 4 attention heads and 2 key/value heads" in problem and problem.endswith(offered), problem


def test_the_console_names_world_size_mesh_and_data_parallel_size(tmp_path, capsys):
    """2 processes with sp_size 2: the start line said "world size 1" and the summary "x 1 ranks" (the
    data-parallel size under the world size's name); the LR scaled for 1 without a word why."""
    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.summary import print_summary, start_line

    rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="zero3_sp", config={"parallel": {"sp_size": 2}})
    rec.set("batch", {**batch.section(8, 1, 1), "input_tokens_per_step": 10, "trained_tokens_per_step": 5})
    rec.set("lr", batch.lr_scaling(1e-3, "linear", 8, 8))
    rec.set("strategy", {"name": "zero3", "distributed_type": "DEEPSPEED", "world_size": 2})
    rec.set("parameters", {"trainable": 10, "total": 100})
    rec.set("precision", {"policy": "32-true"})
    rec.update("summary", status="completed", steps=2, wall_s=3.0, train_s=2.0)
    sizes = "world size 2 (mesh dp 1 x sp 2 x tp 1 x cp 1), data-parallel size 1"
    why = "effective batch of data-parallel size 1: world size 2 / (sp x tp x cp)"
    line = start_line(rec.view)
    assert line.startswith(sizes + " | per-device batch 8 x accumulation 1 x data-parallel size 1 = effective batch 8")
    assert why in line
    print_summary(rec.view, tmp_path, None, "lora")
    out = capsys.readouterr().out
    assert "x data-parallel size 1)" in out and f"sizes           {sizes}" in out and why in out, out
    assert "x 1 ranks" not in out and "world size 1" not in line + out
