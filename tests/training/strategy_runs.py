"""The suite's one run per strategy: each launched once per pytest session, on first use, and read by every
test file with a claim about it (tests/conftest.py `strategy_runs`; docs/testing.md lists the claims):

- tests/training/test_strategies.py: engagement from the live engine, the record's fields documented, losses
  equal to one process, checkpoint and export, the export reloaded, resume under another process count;
- tests/telemetry/test_run_record.py: per-rank batch, learning-rate rule, token totals, memory and throughput;
- tests/training/test_sync_count.py: one collective and one host read of ours per optimizer step (DDP, ZeRO-2);
- tests/telemetry/test_run_record_doc.py: the record against docs/run_record.md both ways (`single`, evaluated).

The recipe values, the same for every run: tiny random Llama + LoRA (dropout 0), demo data (40 rows), seed 42,
8 sequences per optimizer step, 5 steps (one epoch), no warmup, clipping pinned at 1.0, loss logged every step,
checkpoints at steps 3 (resumed from by the resume tests) and 5, and the final export. The 2-rank runs' batch
shape and learning-rate rule per strategy are SHAPES': every rule applies 1e-3 at the effective batch 8, so the
runs compare step for step while the record's LR rule is checked under three strategies. The single-process
reference runs 4 x accumulation 2. Every launch records the rows it trained on (FINETUNE_SAMPLE_TRACE,
finetune/training/trainer.py trace_samples), so resumed runs can be recounted.

Precision: the CPU default, training.precision auto = 32-true, whose tight tolerances the resume, reshard and
export claims need (exactly 0 seen); bf16-mixed, with its own tolerances and control, has its own runs in
tests/training/test_precision_equivalence.py.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tests.conftest import REPO, TRAIN_SCRIPT, InPairs, Launch, launch_train, own_port, run_process_group

CPU_ENV = {"FINETUNE_CPU_DISTRIBUTED": "1"}
STEPS = 5
RESUME_FROM = 3  # checkpoint-3 of every run is what the resume tests continue from
ROWS = 40  # demo rows: 5 steps x 8 sequences = exactly one epoch, so "each row once per epoch" is checkable
APPLIED_LR = 1e-3

# strategy -> (recipe, CPU accelerate config, expected evidence)
STRATEGIES = {
    "ddp": ("ddp", "accelerate_configs/cpu/ddp.yaml", {"engine_class": "DistributedDataParallel"}),
    "zero2": (
        "zero2",
        "accelerate_configs/cpu/zero2.yaml",
        {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": 2,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "optimizer_offloaded": False,
        },
    ),
    "zero2_offload": (
        "zero2_offload",
        "accelerate_configs/cpu/zero2_offload.yaml",
        {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": 2,
            "offload_optimizer_device": "cpu",
            "offload_param_device": "none",
            "optimizer_offloaded": True,
            "basic_optimizer_class": "DeepSpeedCPUAdam",
        },
    ),
    "zero3": (
        "zero3",
        "accelerate_configs/cpu/zero3.yaml",
        {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": 3,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "optimizer_offloaded": False,
            "params_offloaded": False,
        },
    ),
    "zero3_offload": (
        "zero3_offload",
        "accelerate_configs/cpu/zero3_offload.yaml",
        {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": 3,
            "offload_optimizer_device": "cpu",
            "offload_param_device": "cpu",
            "optimizer_offloaded": True,
            "params_offloaded": True,
            "basic_optimizer_class": "DeepSpeedCPUAdam",
        },
    ),
    "fsdp": ("fsdp", "accelerate_configs/cpu/fsdp.yaml", {"fsdp_offload_policy": "OffloadPolicy"}),
    "fsdp_offload": (
        "fsdp_offload",
        "accelerate_configs/cpu/fsdp_offload.yaml",
        {"fsdp_offload_policy": "CPUOffloadPolicy"},
    ),
}

# run -> (per device, accumulation, LR rule, reference batch, base LR): 8 sequences per optimizer step everywhere,
# and every rule gives APPLIED_LR (linear: 8 / 4 = 2; sqrt: sqrt(8 / 2) = 2), as tests/telemetry/test_run_record.py
# checks from the record. On 2 ranks DDP, ZeRO-2 and FSDP2 accumulate 2 micro-batches per rank, the others none;
# the one-process runs (single, single_qlora, PLAIN) 4 x accumulation 2.
SHAPES = {
    "ddp": (2, 2, "linear", 4, APPLIED_LR / 2),
    "zero2": (2, 2, "sqrt", 2, APPLIED_LR / 2),
    "fsdp": (2, 2, "none", None, APPLIED_LR),
}
TWO_RANKS = (4, 1, "none", None, APPLIED_LR)
ONE_PROCESS = (4, 2, "none", None, APPLIED_LR)


# `single` also evaluates (exact match before and after training on 4 held-out rows, greedy: no random draw) so its
# record holds every section a run writes. The held-out rows come after the training rows (finetune/data/demo.py).
SINGLE_EVAL = [
    "--eval.exact_match=true",
    "--data.demo_heldout_size=4",
    "--eval.samples=4",
    "--eval.max_new_tokens=2",
    "--eval.batch_size=4",
]


def shape(name: str | None) -> tuple:
    return SHAPES.get(name, ONE_PROCESS if name in ("single", "single_qlora", *PLAIN) else TWO_RANKS)


def common_args(tiny_model_dir, name: str | None = None) -> list[str]:
    """The recipe values of every run, with run `name`'s batch shape and LR rule (SHAPES); without a name, a
    2-rank run's 4 x 1 at 1e-3 (tests/training/test_precision_equivalence.py's runs). A resume under another
    process count leaves the accumulation out (resumed_args): it is recomputed to keep the effective batch."""
    per_device, accumulation, rule, reference, base_lr = shape(name)
    return [
        f"--model.name_or_path={tiny_model_dir}",
        f"--data.demo_train_size={ROWS}",
        *(SINGLE_EVAL if name == "single" else ["--eval.exact_match=false"]),
        f"--training.max_steps={STEPS}",
        "--training.logging_steps=1",
        "--training.warmup_steps=0",
        f"--training.learning_rate={base_lr}",
        f"--training.lr_scaling={rule}",
        *([f"--training.lr_reference_batch_size={reference}"] if reference else []),
        "--training.max_grad_norm=1.0",
        "--training.seed=42",
        f"--training.per_device_train_batch_size={per_device}",
        *([f"--training.gradient_accumulation_steps={accumulation}"] if accumulation > 1 else []),
        "--method.lora_dropout=0.0",
        "--training.save_strategy=steps",
        f"--training.save_steps={RESUME_FROM}",
    ]  # and at the last step


def resumed_args(tiny_model_dir, name: str) -> list[str]:
    """common_args of run `name` for its `--resume` under another number of processes."""
    return [a for a in common_args(tiny_model_dir, name) if not a.startswith("--training.gradient_accumulation_steps")]


# Launched without an accelerate config (issue 18): the recipe sets up its strategy in the script.
# `zero2` above is one of them: `FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node 2`, so every zero2
# test covers the in-script route at world size 2 while the other rows keep the --config_file route.
# The plain_* runs are `accelerate launch finetune/train.py --recipe X` as users type it: one process
# on CPU, 2 steps at the runs' effective batch (accumulation 2), no checkpoint or export.
TORCHRUN = {"zero2"}
PLAIN = {
    "plain_zero2": (
        "zero2",
        {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": 2,
            "zero_optimizer_class": "DeepSpeedZeroOptimizer",
            "optimizer_offloaded": False,
        },
    ),
    "plain_zero3": (
        "zero3",
        {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": 3,
            "local_param_fraction": 1.0,
            "zero_optimizer_class": "DeepSpeedZeroOptimizer_Stage3",
            "params_offloaded": False,
        },
    ),
    "plain_fsdp": (
        "fsdp",
        {"fsdp_offload_policy": "OffloadPolicy", "local_param_fraction": 1.0, "placements": "(Shard(dim=0),)"},
    ),
}
PLAIN_STEPS = 2

# QLoRA (4-bit NF4 base, float storage so it shards) under the sharded strategies, against one process.
QLORA = {
    "qlora_zero3": ("zero3", "accelerate_configs/cpu/zero3.yaml"),
    "qlora_fsdp": ("fsdp", "accelerate_configs/cpu/fsdp.yaml"),
}

# The one-process launches, in two lanes run side by side: a one-process launch leaves the other core
# idle while it imports (launcher, then rank), and neither lane can collide with the other: the first's
# runs have distributed type NO (no port, no process group); the second's run one at a time.
LANES = (("single", "single_qlora"), tuple(PLAIN))


# The runs whose host syncs and collectives per optimizer step tests/training/test_sync_count.py reads: counted in
# each rank by tests/training/sync_site/sitecustomize.py (on PYTHONPATH), written beside the run directory.
COUNTED = ("ddp", "zero2")
SYNC_SITE = Path(__file__).resolve().parent / "sync_site"


def sync_count_env(counts: Path, control: bool = False) -> dict:
    """The environment of a launch whose ranks count their syncs into `counts` (rank<r>.json)."""
    counts.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(SYNC_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "SYNC_COUNT_OUT": str(counts), "SYNC_COUNT_CONTROL": "1" if control else "0"}


def counts_dir(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".counts")


def trace_env(run_dir) -> dict:
    """Where a launch records the rows it trains on: beside its run directory, not in it (a copied
    run directory must not carry the trace into the resumed launch)."""
    return {"FINETUNE_SAMPLE_TRACE": str(run_dir.with_name(run_dir.name + ".trace"))}


def _launcher_free_env(**extra) -> dict:
    """This process's environment without launcher variables (accelerate's, torchrun's, ours)."""
    drop = (
        "ACCELERATE_",
        "FSDP_",
        "FINETUNE_ACCELERATE_CONFIG",
        "FINETUNE_CPU_DISTRIBUTED",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def torchrun_train(args: list[str], *, run_dir: Path, env: dict, timeout: float = 420) -> Launch:
    """`torchrun --standalone --nproc_per_node 2 finetune/train.py ARGS` (standalone: a free rendezvous port)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TRAIN_SCRIPT),
        *args,
        f"--run.output_dir={run_dir}",
    ]
    code, out, err = run_process_group(cmd, cwd=REPO, env=_launcher_free_env(**env), timeout=timeout)
    return Launch(code, out, err, run_dir)


def plain_accelerate_launch(args: list[str], *, run_dir: Path, home: Path, timeout: float = 300) -> Launch:
    """`accelerate launch finetune/train.py ARGS` as typed: the accelerate console script, the script
    relative to the repository root, no config file, and no accelerate default config (HF_HOME is an
    empty directory: a default config there would be read, finetune/launch/launcher.py). No GPU is
    made visible, so the launch is the CPU one on any machine."""
    # next to this Python, else on PATH (a venv made with --system-site-packages has it in the base's bin)
    found = shutil.which("accelerate", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert found, f"no accelerate console script next to {sys.executable} or on PATH"
    accelerate = Path(found)
    assert not (home / "accelerate").exists()
    cmd = [str(accelerate), "launch", "finetune/train.py", *args, f"--run.output_dir={run_dir}"]
    env = _launcher_free_env(HF_HOME=str(home), CUDA_VISIBLE_DEVICES="")
    code, out, err = run_process_group(cmd, cwd=REPO, env=env, timeout=timeout)
    return Launch(code, out, err, run_dir)


PAIRED = (*STRATEGIES, *QLORA)  # the 2-rank runs, launched two at a time (tests/conftest.py InPairs)


class StrategyRuns:
    """name -> finished Launch (a strategy of STRATEGIES, `single`, `single_qlora`, PLAIN, QLORA), each
    launched once on first use: a 2-rank one side by side with the next one the session's tests want
    (`wanted`), a one-process one with every launch of LANES."""

    def __init__(self, base: Path, tiny_model_dir: Path, wanted=()):
        self.base, self.model, self.done = base, tiny_model_dir, {}
        self.pairs = InPairs(self._start, wanted)

    def __call__(self, name: str) -> Launch:
        if name not in self.done:
            if any(name in names for names in LANES):
                self._lanes()
            else:
                self.done[name] = self.pairs(name)
        assert self.done[name].returncode == 0, self.done[name].explain()
        return self.done[name]

    def _start(self, name: str, home: Path | None = None) -> Launch:
        run_dir = self.base / name
        env = {**CPU_ENV, **trace_env(run_dir), **(sync_count_env(counts_dir(run_dir)) if name in COUNTED else {})}
        if name in ("single", "single_qlora"):
            qlora = ["--method.name=qlora"] if name == "single_qlora" else []
            args = [*common_args(self.model, name), *qlora]
            return launch_train(
                ["--recipe", "demo", *args],
                run_dir=run_dir,
                cwd=REPO,
                config_file="accelerate_configs/single_gpu.yaml",
                env=trace_env(run_dir),
                timeout=300,
            )
        if name in PLAIN:
            args = [
                *common_args(self.model, name),
                f"--training.max_steps={PLAIN_STEPS}",
                "--training.save_strategy=no",
            ]
            return plain_accelerate_launch(["--recipe", PLAIN[name][0], *args], run_dir=run_dir, home=home)
        if name in TORCHRUN:
            args = ["--recipe", STRATEGIES[name][0], *common_args(self.model, name)]
            return torchrun_train(args, run_dir=run_dir, env=env)
        if name in QLORA:
            recipe, config = QLORA[name]
            args = ["--recipe", recipe, *common_args(self.model, name), "--method.name=qlora"]
        else:
            recipe, config, _ = STRATEGIES[name]
            args = ["--recipe", recipe, *common_args(self.model, name)]
        return launch_train(
            args, run_dir=run_dir, cwd=REPO, config_file=config, launch_args=own_port(), env=env, timeout=420
        )

    def _lanes(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        homes = {name: self.base / f"{name}.hf_home" for name in PLAIN}
        for home in homes.values():
            home.mkdir(exist_ok=True)

        def lane(names):
            for n in names:
                if n not in self.done:
                    self.done[n] = self._start(n, homes.get(n))

        with ThreadPoolExecutor(len(LANES)) as pool:
            for future in [pool.submit(lane, names) for names in LANES]:
                future.result()
