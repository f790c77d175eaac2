"""The parallel mesh of a run: how its ranks split each training step beyond data parallelism, world = dp x sp x tp x
cp; ranks of one sp/tp/cp group train on the same micro-batch (docs/parallelism.md: what each dimension splits and under
which engine). Pure arithmetic and the engines' names; no torch at import.
"""

from __future__ import annotations

from dataclasses import dataclass

# What runs each dimension (docs/parallelism.md "Engines"); under which strategies: finetune/strategies.py Strategy.runs.
SP_ENGINE = "DeepSpeed Ulysses (ALST) through Accelerate's ParallelismConfig(sp_backend='deepspeed')"
TP_ENGINE = "DeepSpeed AutoTP (tensor_parallel.autotp_size) over the model's base_model_tp_plan"
CP_ENGINE = "torch context parallelism (ring attention over SDPA) through ParallelismConfig(cp_backend='torch')"
# Who does pipeline parallelism (Trainer has no pipeline schedule): named by the pp_size refusal.
PIPELINE_ENGINES = (
    "Megatron-LM / Megatron-Core (interleaved 1F1B)",
    "DeepSpeed's PipelineModule with its own pipeline engine (not through Trainer)",
    "torchtitan (torch.distributed.pipelining: GPipe, 1F1B, interleaved, zero-bubble)",
    "Nanotron",
)
PIPELINE_REFUSAL = (
    "pipeline parallelism is not supported: transformers' Trainer has no pipeline schedule (it runs "
    "one forward and backward per micro-batch on every rank), so a pipelined model would sit idle "
    "between stages or deadlock. Engines that do it: " + "; ".join(PIPELINE_ENGINES) + ". Here, split "
    "a model that does not fit with ZeRO-3/FSDP2 sharding, tp_size (layers) or sp_size (long sequences)"
)


@dataclass(frozen=True)
class Mesh:
    """A launch's mesh as planned: sizes of each dimension over `world` processes."""

    world: int
    sp: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def model_parallel(self) -> int:
        """Ranks that share one micro-batch: sp x tp x cp."""
        return self.sp * self.tp * self.cp

    @property
    def divides(self) -> bool:
        return self.model_parallel >= 1 and self.world % self.model_parallel == 0

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (sp x tp x cp). Preflight refuses a world it does not divide
        (`divides`); until then this is the floor, at least 1."""
        return max(1, self.world // self.model_parallel)

    @property
    def trivial(self) -> bool:
        return self.model_parallel == 1

    def sizes(self) -> dict:
        return {"sp": self.sp, "tp": self.tp, "cp": self.cp}

    def describe(self) -> str:
        parts = [f"{k} {v}" for k, v in self.sizes().items() if v > 1]
        return f"dp {self.dp}" + ("".join(f" x {p}" for p in parts))


def of(parallel, world: int) -> Mesh:
    """The mesh a recipe's `parallel` section asks for on `world` processes."""
    return Mesh(world=world, sp=parallel.sp_size, tp=parallel.tp_size, cp=parallel.cp_size)
