"""DeepSpeed's buffers as the planner counts them (finetune/planning/memory.py states
and its DeepSpeed buffer sizes) against a live DeepSpeed 0.19.8 engine built in this process (CPU accelerator,
gloo, world size 1) from the shipped ds_configs with the "auto" values HF Trainer fills in
(transformers' own HfTrainerDeepSpeedConfig, called here): the module's partition, the separate
master, ZeRO-3's gradient partition buffer and ipg bucket, ZeRO-2's gradient accumulation dtype,
and the fill itself. Under bf16-mixed (TrainingArguments.bf16) and the legacy fp32 mode."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.planning import memory, regimes
from finetune.planning.shapes import Workload, shape_of
from finetune.resources import DS_CONFIGS


def tiny():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


def trainer_filled(stage: str | dict, bf16: bool, model) -> dict:
    """A shipped ds_configs file by name (or a DeepSpeed config dict) with Trainer's "auto" fill."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2, bf16=bf16, use_cpu=True, report_to=[])
    config = stage if isinstance(stage, dict) else json.loads((DS_CONFIGS / f"{stage}.json").read_text())
    hf = HfTrainerDeepSpeedConfig(config)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model, 10)
    return hf.config


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_the_auto_fill_is_trainers(stage):
    from transformers import LlamaForCausalLM

    cfg = tiny()
    shipped = json.loads((DS_CONFIGS / f"{stage}.json").read_text())
    filled = trainer_filled(stage, True, LlamaForCausalLM(cfg))["zero_optimization"]
    ours = memory.fill_auto(shipped["zero_optimization"], cfg.hidden_size)
    assert {
        k: float(ours[k]) for k in filled if isinstance(filled[k], (int, float)) and not isinstance(filled[k], bool)
    } == {k: float(v) for k, v in filled.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.fixture(scope="module")
def process_group():
    import os

    from tests.conftest import free_port

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()
    # a ZeRO-3 engine replaces torch.nn.functional.linear process-wide with its memory-efficient one ("This will persist
    # unless manually reset", deepspeed/runtime/zero/partition_parameters.py): put torch's back for later tests (seen:
    # test_plan's checkpointing recompute counted one down_proj more)
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patched

    torch.nn.functional.linear = getattr(patched, "linear_bk", torch.nn.functional.linear)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def engine_buffers(stage: str, bf16: bool, dtype=torch.bfloat16) -> dict:
    import deepspeed
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny()).to(dtype)  # bf16: what a bf16 policy loads
    config = trainer_filled(stage, bf16, model)
    _, opt, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), config=config
    )

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    if stage == "zero3":
        lp, master = list(opt.fp16_partitioned_groups_flat), list(opt.fp32_partitioned_groups_flat)
        return {
            "weights": nbytes(lp),
            "master_weights": nbytes(master),
            "separate_master": all(
                a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for a, b in zip(lp, master)
            ),
            "grad_partition_buffer": nbytes([opt.grad_partitions_flat_buffer]),
            "ipg_bucket": nbytes([b.buffer for b in opt.ipg_buckets.values()]),
        }
    return {
        "weights": nbytes(opt.bit16_groups_flat),
        "master_weights": nbytes(opt.single_partition_of_fp32_groups),
        "separate_master": True,
        "grad_bytes": torch.tensor([], dtype=opt.gradient_accumulation_dtype).element_size(),
        "reduce_bucket_size": opt.reduce_bucket_size,
    }


@pytest.mark.parametrize(
    "stage, bf16, policy",
    [
        ("zero2", True, "bf16-mixed"),
        ("zero3", True, "bf16-mixed"),
        ("zero2", False, "legacy"),
        ("zero3", False, "32-true"),
    ],
    ids=["zero2-bf16-mixed", "zero3-bf16-mixed", "zero2-fp32-mode", "zero3-32-true"],
)
def test_the_planners_deepspeed_states_are_the_engines(process_group, stage, bf16, policy):
    """zero3-32-true is the case finetune/precision.py first had wrong: an fp32 module partition that
    DeepSpeed means to share as the master, but copies (stage3.py compares a torch.device with a string)."""
    shape = shape_of(tiny())
    w = Workload(method="full", micro_batch=2, seq_len=64)
    p = (
        regimes.legacy_regime("full", stage, "cuda")
        if policy == "legacy"  # bf16 module, DeepSpeed in fp32 mode
        else regimes.policy_regime(policy, "full", stage)
    )
    z = memory.zero_values(stage, shape)
    dev, _ = memory.states(shape, w, p, stage, 1, z)
    live = engine_buffers(stage, bf16, torch.float32 if policy == "32-true" else torch.bfloat16)
    assert live["separate_master"]
    assert dev["weights"] == live["weights"] and dev["master_weights"] == live["master_weights"]
    if stage == "zero3":
        assert dev["grad_partition_buffer"] == live["grad_partition_buffer"]
        assert dev["ipg_bucket"] == live["ipg_bucket"]  # h^2 elements in the gradient dtype
    else:
        assert p.grad == live["grad_bytes"]  # fp32 accumulation in fp32 mode, the module's dtype with bf16
        assert z.reduce_bucket_size == live["reduce_bucket_size"]


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_zero2s_reduce_bucket_on_cpu_commits_only_the_pages_gradients_are_copied_into(process_group):
    """Issue 27 item 8: the planner counted ZeRO-2's whole reduce bucket on CPU (3.29 GiB predicted for a
    rehearsal that measured 1.86). The engine allocates it whole (torch.empty of reduce_bucket_size
    elements, checked below) but only what the gradients are copied into becomes resident: here a 1 GiB
    bucket (2^28 fp32 elements) with only the norms trained (640 elements) adds far less than 1 GiB of
    RSS over a backward. The planner's CPU figure is min(bucket, trainable) elements; on a GPU, the whole bucket."""
    import deepspeed
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny())
    for name, param in model.named_parameters():  # a frozen base with a few trained tensors, as LoRA has
        param.requires_grad_(name.endswith("norm.weight"))
    config = trainer_filled("zero2", False, model)
    bucket = 2**28  # 1 GiB of fp32
    config["zero_optimization"]["reduce_bucket_size"] = bucket
    engine, opt, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
        config=config,
    )
    allocated = []
    setup = opt.setup_buckets

    def seen_setup():  # what the first gradient hook allocates (stage_1_and_2.py setup_buckets)
        setup()
        allocated.append(sum(t.numel() for b in opt.ipg_buckets.values() for t in b.buffer))

    opt.setup_buckets = seen_setup
    ids = torch.randint(0, 512, (2, 32))
    before = _rss()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grown = _rss() - before
    assert max(allocated) == bucket  # the engine did allocate the whole bucket ...
    assert grown < bucket * 4 / 8, f"RSS grew {grown / 2**20:.0f} MiB"  # ... but not an eighth of it is resident
    # control: the same kind of allocation counts once its pages are written
    start = _rss()
    block = torch.empty(2**26)  # 256 MiB
    untouched = _rss() - start
    block.fill_(1.0)
    assert untouched < 2**26 * 4 / 8 < 2**26 * 4 * 0.9 < _rss() - start
    shape = shape_of(tiny())
    p = regimes.policy_regime("32-true", "full", "zero2")
    z = memory.zero_values("zero2", shape, config)
    w = Workload(method="full", micro_batch=2, seq_len=32)
    cpu = memory.phases(shape, w, p, "zero2", 1, z, cpu=True)["last_block_backward"]["ipg_bucket"]
    gpu = memory.phases(shape, w, p, "zero2", 1, z, cpu=False)["last_block_backward"]["ipg_bucket"]
    assert gpu == bucket * 4
    assert cpu == min(bucket, memory.trainable_params(shape, w)) * 4 < gpu


def held_storages(root) -> dict:
    """{data_ptr: bytes} of every CPU storage reachable from `root` through the attributes, lists and
    dicts of deepspeed/torch/transformers objects and tensors' .grad, less one-element tensors
    (DeepSpeed's loss scale, norms, flags). Checked once against the torch profiler's net CPU
    allocations over building the engine and a step: within 1 KiB."""
    seen, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            if obj.device.type == "cpu" and obj.numel() > 1:
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            todo.append(obj.grad)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif type(obj).__module__.split(".")[0] in ("deepspeed", "torch", "transformers") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return storages


@pytest.mark.parametrize("strategy", ["zero2", "zero2_offload", "zero3", "zero3_offload_opt", "zero3_offload"])
def test_the_planners_offloaded_states_are_what_the_engine_holds(process_group, monkeypatch, strategy):
    """Everything a live engine holds after one training step (bf16-mixed, the shipped configs with
    Trainer's fill) against the planner's persistent states, device and host together (on CPU both
    are this process), and of it what DeepSpeed pins (pin_memory: true; on CPU the accelerator's
    pin_memory is a no-op, recorded here) against what the planner rounds as pinned. ZeRO-3 with the
    optimizer offloaded keeps a pinned fp32 gradient per sub-group on the host (4 bytes per parameter
    the planner had missed) and a pageable master; ZeRO-2 with it offloaded keeps a pinned bit16 copy
    of the partition and a staging buffer of the largest parameter on each side."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import LlamaForCausalLM

    from finetune.planning import prediction
    from finetune.strategies import by_key, planner_key
    from finetune.training.strategy_evidence import live_evidence, strategy_from_evidence

    accelerator, pins = get_accelerator(), set()

    def pin_memory(tensor, *args, **kwargs):
        out = real_pin(tensor, *args, **kwargs)
        pins.add(out.untyped_storage().data_ptr())
        return out

    real_pin = accelerator.pin_memory
    monkeypatch.setattr(accelerator, "pin_memory", pin_memory)
    file = json.loads((DS_CONFIGS / f"{strategy.removesuffix('_opt')}.json").read_text())
    if by_key(strategy).deepspeed_config is None:  # zero3_offload_opt: the shipped offload config less offload_param
        del file["zero_optimization"]["offload_param"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny()).to(torch.bfloat16)
    config = trainer_filled(file, True, model)
    # Accelerate hands DeepSpeedCPUAdam to an offloaded run (a JIT build); its states are the same
    # fp32 zeros_like of the partition (deepspeed/ops/adam/cpu_adam.py step) as torch's AdamW's
    config["zero_force_ds_cpu_optimizer"] = False
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), config=config
    )
    assert planner_key(*strategy_from_evidence(live_evidence(engine))) == strategy  # the engine engaged it
    ids = torch.randint(0, 512, (2, 32))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    shape = shape_of(tiny())
    w = Workload(method="full", micro_batch=2, seq_len=32)
    p = regimes.policy_regime("bf16-mixed", "full", strategy)
    dev, host = memory.states(shape, w, p, strategy, 1, memory.zero_values(strategy, shape, config))
    held = held_storages(engine)
    for buffer in engine.module.buffers():  # rotary inv_freq: not a state
        held.pop(buffer.untyped_storage().data_ptr(), None)
    live, planned = sum(held.values()), sum(dev.values()) + sum(host.values())
    assert live == planned, f"live - planned: {(live - planned) / shape.params.total:.3f} bytes/param; {dev} {host}"
    live_pinned = sum(n for ptr, n in held.items() if ptr in pins)
    planned_pinned = sum(v for k, v in host.items() if prediction.pinned(k, strategy))
    assert live_pinned == planned_pinned, f"pinned: live {live_pinned}, planned {planned_pinned}: {host}"
    assert (live_pinned > 0) == by_key(strategy).offload_optimizer


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_qlora_under_deepspeed_runs_a_bf16_stream(process_group, stage):
    """Issue 47: `finetune plan` showed QLoRA under ZeRO with twice single's activations (an fp32 residual stream,
    so the math attention kernel's s x s softmax). peft's prepare_model_for_kbit_training does leave the
    unquantized weights fp32 (checked before the engine), but DeepSpeed's engine casts every floating parameter
    to its bf16 module dtype: the live stream into the first decoder layer is bf16, as the planner now says."""
    import deepspeed

    from tests.planning import mechanism as mech

    model = mech.build("qlora_mixed", mech.config("llama", num_key_value_heads=1))

    def unquantized_frozen() -> set:
        return {p.dtype for p in model.parameters() if not p.requires_grad and type(p).__name__ != "Params4bit"}

    assert unquantized_frozen() == {torch.float32}  # peft's doing: the regime single and DDP run
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-4), config=trainer_filled(stage, True, model)
    )
    stream = []
    layer = next(m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer")
    layer.register_forward_pre_hook(
        lambda _, a, kw: stream.append((a[0] if a else kw["hidden_states"]).dtype), with_kwargs=True
    )
    ids = torch.randint(0, 4096, (2, 32))
    engine(input_ids=ids, labels=ids)
    assert unquantized_frozen() == {torch.bfloat16} and stream == [torch.bfloat16]
    planned = regimes.policy_regime("bf16-mixed", "qlora", stage)
    assert planned.frozen == regimes.B16 and not planned.autocast
    assert regimes.policy_regime("bf16-mixed", "qlora", "single").frozen == regimes.F32  # control: peft's fp32 stays
