"""The precision policy table: one row per `training.precision` value (Lightning's names), what it
keeps in which dtype, and how each strategy family (torch autocast, FSDP2 MixedPrecisionPolicy,
DeepSpeed's 16-bit module with fp32 master partitions) implements it (docs/precision.md). Pure, no
torch at import: config, preflight, loading, the live check and the planner read the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.strategies import STRATEGIES, by_key

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
POLICY_NAMES = ("bf16-mixed", "bf16-true", "16-mixed", "32-true")
CHOICES = ("auto", *POLICY_NAMES)  # what training.precision accepts
FAMILIES = ("torch", "fsdp2", "deepspeed")
# bf16-true warning (finetune/training/precision_evidence.py vanishing_share): warn when at least this
# share of the trainable weights has a bf16 half-spacing above the learning rate (research
# note §4.5: 84.5% predicted and measured at LR 1e-5 on the test model, 12% at 1e-4).
VANISHING_WARN_SHARE = 0.10


@dataclass(frozen=True)
class Policy:
    name: str
    summary: str  # one line for the console and W&B
    full_load_dtype: str  # the checkpoint's load dtype for full fine-tuning
    frozen_dtype: str  # the frozen base of LoRA/QLoRA (loaded in it) = the compute dtype, or fp32
    master_dtype: str  # trainable parameters (and LoRA adapters) as the optimizer updates them
    compute_dtype: str  # matmul inputs (autocast dtype, FSDP2 param_dtype, DeepSpeed module dtype)
    optimizer_state_dtype: str  # Adam exp_avg / exp_avg_sq
    master_weights: bool  # an fp32 master of parameters that compute in 16 bits
    adapters_fp32: bool  # peft get_peft_model(autocast_adapter_dtype=...) on torch-native strategies
    torch_autocast: str | None  # autocast dtype of the torch family (Accelerate mixed_precision); None: none
    fsdp_param_dtype: str | None  # FSDP2 MixedPrecisionPolicy.param_dtype; None: no policy (no casts)
    fsdp_reduce_dtype: str | None
    deepspeed_bf16: bool  # DeepSpeed "bf16.enabled"
    deepspeed_fp16: bool  # DeepSpeed "fp16.enabled"
    deepspeed_low_precision_master: bool  # bf16.bf16_master_weights_and_grads + bf16_optimizer_states
    deepspeed_offload_ok: bool  # DeepSpeed ZeRO offload can run this policy through Trainer
    needs_cuda: bool  # no CPU implementation this project can honour (fp16: Accelerate skips it on CPU)

    def load_dtype(self, method: str) -> str:
        """The dtype from_pretrained loads the checkpoint in, for `full`, `lora` or `qlora`."""
        return self.full_load_dtype if method == "full" else self.frozen_dtype

    def module_dtype(self, method: str, family: str) -> str:
        """The dtype the wrapped module holds the weights in: LoRA/QLoRA's frozen base; for full
        fine-tuning DeepSpeed's module in the compute dtype (its master lives in the optimizer),
        else the trainable parameters themselves, the master (finetune/modeling/load.py upcasts them)."""
        _check_family(family)
        if method != "full":
            return self.frozen_dtype
        return self.compute_dtype if family == "deepspeed" else self.master_dtype

    def training_args(self, family: str) -> dict:
        """TrainingArguments bf16 / fp16. The policy owns them (training.bf16/fp16 are refused). Under DeepSpeed they
        fill the JSON's "auto" bf16/fp16.enabled (transformers/integrations/deepspeed.py trainer_config_process), so
        bf16-true sets bf16 there; for the torch families bf16 would switch autocast on, which bf16-true must not."""
        _check_family(family)
        if family == "deepspeed":
            return {"bf16": self.deepspeed_bf16, "fp16": self.deepspeed_fp16}
        return {"bf16": self.torch_autocast == "bfloat16", "fp16": self.torch_autocast == "float16"}

    def fsdp_mixed_precision(self) -> dict | None:
        """Keyword arguments of torch MixedPrecisionPolicy for FSDP2, or None for MixedPrecisionPolicy()
        (no casts). output_dtype None: Accelerate's default (the param dtype) rounds the returned
        loss to bf16; cast_forward_inputs as torch's default."""
        if self.fsdp_param_dtype is None:
            return None
        return {
            "param_dtype": self.fsdp_param_dtype,
            "reduce_dtype": self.fsdp_reduce_dtype,
            "output_dtype": None,
            "cast_forward_inputs": True,
        }

    def deepspeed_keys(self) -> dict:
        """The DeepSpeed config values this policy needs (deepspeed/runtime/precision_config.py)."""
        bf16 = {"enabled": self.deepspeed_bf16}
        if self.deepspeed_low_precision_master:
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        return {"bf16": bf16, "fp16": {"enabled": self.deepspeed_fp16}}

    def expected_live(self, family: str) -> dict:
        """What the live objects must show before step 1 (run.json precision.*), any strategy."""
        _check_family(family)
        return {
            "param_dtype": self.master_dtype,
            "compute_dtype": self.compute_dtype,
            "optimizer_state_dtype": self.optimizer_state_dtype,
            "master_weights": self.master_weights,
        }

    def allowed_reduce_dtypes(self, family: str) -> tuple[str, ...]:
        """Gradient reduction dtypes that honour the policy: torch-native strategies reduce in the
        master dtype (DDP all-reduces .grad, FSDP2 gets reduce_dtype); DeepSpeed reduces in the
        module dtype by default (communication_data_type) or fp32 when configured."""
        _check_family(family)
        if family == "deepspeed":
            return tuple(dict.fromkeys((self.compute_dtype, "float32")))
        return (self.master_dtype,)


# The table by field: each field's value under POLICY_NAMES, in that order (bf16-mixed, bf16-true, 16-mixed, 32-true).
_BY_FIELD = {
    "summary": (
        "fp32 master weights and optimizer states, bf16 compute",
        "everything in bf16: parameters, gradients, optimizer states, compute (no master copy)",
        "fp32 master weights and optimizer states, fp16 compute with dynamic loss scaling",
        "everything in fp32",
    ),
    # 16-mixed: fp32 for full fine-tuning, as a bf16 checkpoint loaded in fp16 can leave fp16's range
    "full_load_dtype": ("bfloat16", "bfloat16", "float32", "float32"),
    "frozen_dtype": ("bfloat16", "bfloat16", "float16", "float32"),
    "master_dtype": ("float32", "bfloat16", "float32", "float32"),
    "compute_dtype": ("bfloat16", "bfloat16", "float16", "float32"),
    "optimizer_state_dtype": ("float32", "bfloat16", "float32", "float32"),
    "master_weights": (True, False, True, False),
    "adapters_fp32": (True, False, True, True),
    "torch_autocast": ("bfloat16", None, "float16", None),
    "fsdp_param_dtype": ("bfloat16", None, "float16", None),
    "fsdp_reduce_dtype": ("float32", None, "float32", None),
    "deepspeed_bf16": (True, True, False, False),
    "deepspeed_fp16": (False, False, True, False),
    "deepspeed_low_precision_master": (False, True, False, False),
    # bf16-true: Accelerate's map_pytorch_optim_to_deepspeed builds DeepSpeedCPUAdam without
    # fp32_optimizer_states=False, which ZeRO-Offload then asserts on.
    "deepspeed_offload_ok": (True, False, True, True),
    "needs_cuda": (False, False, True, False),
}
POLICIES: dict[str, Policy] = {
    name: Policy(name, **{k: column[i] for k, column in _BY_FIELD.items()}) for i, name in enumerate(POLICY_NAMES)
}


def get(name: str) -> Policy:
    """The row of a concrete policy name (not `auto`: see `resolve`)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"no precision policy {name!r} (allowed: {', '.join(CHOICES)})") from None


def resolve(name: str, device_has_cuda: bool, cuda_bf16: bool) -> Policy:
    """`auto` -> bf16-mixed on CUDA with bf16, 16-mixed on CUDA without it, 32-true on CPU (CPU autocast in bf16 is slow
    and the demo-scale models gain nothing from it); any other name -> its row."""
    if name == "auto":
        name = ("bf16-mixed" if cuda_bf16 else "16-mixed") if device_has_cuda else "32-true"
    return get(name)


def torch_dtype(name: str | None):
    """ "bfloat16" -> torch.bfloat16 (None stays None)."""
    import torch

    return None if name is None else getattr(torch, name)


def family_of(strategy: str) -> str:
    """torch | fsdp2 | deepspeed for a strategy key or name of finetune/strategies.py."""
    row = next((s for s in STRATEGIES if strategy in (s.key, s.name)), None)
    if row is None:
        raise ValueError(f"no strategy {strategy!r} in finetune/strategies.py")
    return family_of_distributed_type(row.distributed_type)


def family_of_distributed_type(distributed_type: str | None) -> str:
    """torch | fsdp2 | deepspeed for Accelerate's DistributedType name (DEEPSPEED, FSDP, else torch)."""
    return {"DEEPSPEED": "deepspeed", "FSDP": "fsdp2"}.get(distributed_type, "torch")


def dtype_name(dtype) -> str | None:
    """torch's dtype as this table names it ("bfloat16"), None for None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"no precision family {family!r} (allowed: {', '.join(FAMILIES)})")


# --- bytes per parameter, for the memory planner ----------------------------------------------


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per trainable parameter (LoRA: per adapter parameter) under one policy and strategy, before sharding: the
    planner divides what the strategy shards (finetune/strategies.py flags) by the data-parallel size. Persistent:
    params, grads, master, optimizer_states. Transient, per parameter of what is being computed (the planner decides how
    much is live at once): working_params, working_grads, reduce."""

    params: int  # the module's copy (what forward reads or casts from)
    grads: int  # the gradient kept from backward to the optimizer step
    master: int  # a separate master copy the optimizer updates (0: the module's parameters are the master)
    optimizer_states: int  # Adam exp_avg + exp_avg_sq
    working_params: int  # 16-bit compute copies: autocast's cached weight casts (torch, held from forward
    #                      to backward), FSDP2's unsharded per-unit params (all-gathered in param_dtype)
    working_grads: int  # FSDP2: the unsharded gradient of a unit before its reduce-scatter
    reduce: int  # bytes per gradient element communicated (DDP buckets, FSDP2 reduce-scatter input, ZeRO)

    @property
    def k(self) -> int:
        """The ZeRO paper's K (Rajbhandari et al. 2020, §3): bytes of optimizer-side state per
        parameter, master copy included; 12 for mixed-precision Adam."""
        return self.master + self.optimizer_states


def trainable_bytes(policy: Policy | str, strategy_key: str) -> ParamBytes:
    """Bytes per trainable parameter of `policy` under the strategy row `strategy_key`."""
    p = get(policy) if isinstance(policy, str) else policy
    by_key(strategy_key)  # a planner key (KeyError otherwise), not a run.strategy name
    fam = family_of(strategy_key)
    b = DTYPE_BYTES
    master, compute, states = b[p.master_dtype], b[p.compute_dtype], 2 * b[p.optimizer_state_dtype]
    if fam == "deepspeed":
        # The module holds compute-dtype parameters and gradients; the ZeRO optimizer steps a separate master partition,
        # a clone even when the dtypes match (stage_1_and_2.py; stage3.py below). stage3.py _create_fp32_partitions
        # means to share the module partition when it already has the master dtype, but compares the partition's
        # torch.device with self.device, a *string* (get_accelerator().current_device_name()): never equal, so ZeRO-3
        # clones it too (DeepSpeed 0.19.8; the H200 ZeRO-3 record of 2026-11-22, fp32 throughout, holds this copy).
        return ParamBytes(
            params=compute,
            grads=compute,
            master=master,
            optimizer_states=states,
            working_params=0,
            working_grads=0,
            reduce=compute,
        )
    if fam == "fsdp2":
        unsharded = b[p.fsdp_param_dtype] if p.fsdp_param_dtype else master
        reduce = b[p.fsdp_reduce_dtype] if p.fsdp_reduce_dtype else unsharded
        return ParamBytes(
            params=master,
            grads=master,
            master=0,
            optimizer_states=states,
            working_params=unsharded,
            working_grads=unsharded,
            reduce=reduce,
        )
    cached = compute if p.torch_autocast else 0
    return ParamBytes(
        params=master,
        grads=master,
        master=0,
        optimizer_states=states,
        working_params=cached,
        working_grads=0,
        reduce=master,
    )


def frozen_bytes(policy: Policy | str) -> int:
    """Bytes per frozen (non-quantized) base parameter under LoRA. QLoRA: peft's
    prepare_model_for_kbit_training casts the unquantized ones to fp32 (the planner's own rule)."""
    p = get(policy) if isinstance(policy, str) else policy
    return DTYPE_BYTES[p.frozen_dtype]


# --- configuration that must agree with the policy ---------------------------------------------


def config_problems(
    policy: Policy, *, model_dtype: str, method: str, compute_dtype: str = "auto", requested: str | None = None
) -> list[str]:
    """model.dtype and QLoRA's method.compute_dtype against the policy: "auto" or the policy's own
    dtype. `requested` ("auto") says in the message that the policy came from auto."""
    how = f"training.precision {policy_label(policy, requested)}"
    problems = []
    want = policy.load_dtype(method)
    if model_dtype not in ("auto", want):
        problems.append(
            f"model.dtype: {model_dtype!r} contradicts {how}, which loads {method} fine-tuning in "
            f"{want}; set model.dtype: auto (or {want}), or choose the policy that loads "
            f"{model_dtype} (docs/precision.md)"
        )
    if method == "qlora" and compute_dtype not in ("auto", policy.compute_dtype):
        problems.append(
            f"method.compute_dtype: {compute_dtype!r} contradicts {how}, which computes in "
            f"{policy.compute_dtype}; set method.compute_dtype: auto (or {policy.compute_dtype})"
        )
    return problems


def policy_label(policy: Policy, requested: str | None) -> str:
    """'bf16-mixed' or 'auto (bf16-mixed on this machine)' for messages."""
    return f"auto ({policy.name} on this machine)" if requested == "auto" else policy.name


def mismatches(policy: Policy, family: str, live: dict) -> list[str]:
    """What the live objects (run.json `precision` fields) show against the policy; [] when they
    agree. An optimizer_state_dtype of None (an optimizer whose state dtype is not known before
    step 1) and a reduce_dtype of None (one process: nothing is reduced) are not compared."""
    problems = [
        f"{key}: the policy needs {want}, the live run has {live.get(key)}"
        for key, want in policy.expected_live(family).items()
        if live.get(key) != want and not (key == "optimizer_state_dtype" and live.get(key) is None)
    ]
    reduce = live.get("reduce_dtype")
    if reduce is not None and reduce not in policy.allowed_reduce_dtypes(family):
        problems.append(
            f"reduce_dtype: the policy reduces gradients in {' or '.join(policy.allowed_reduce_dtypes(family))}"
            f" under {family}, the live run in {reduce}"
        )
    return problems
