"""What a training run holds in which dtype, as the memory planner needs it: bytes per element of the weights,
gradients, optimizer states, master copy and compute, for one precision policy, method and strategy, because the same
policy is carried out differently by torch autocast, FSDP2 and DeepSpeed. `legacy_regime`: records without a `precision`
section. Evidence per strategy: docs/planning.md "Which regime a run had"; sources inline.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune import precision
from finetune.strategies import by_key

B16, F32 = 2, 4  # bytes per element of bf16/fp16 and fp32


@dataclass(frozen=True)
class Regime:
    """Bytes per element of what the live run holds (the planner's view of a precision policy)."""

    policy: str  # the policy name, or "legacy: ..." for runs from before the policy
    param: int  # trainable parameters as the module holds them (full: the weights; LoRA/QLoRA: the adapters)
    frozen: int  # frozen weights (LoRA's base; QLoRA's non-quantized embeddings, norms and head)
    grad: int  # gradients as they are accumulated (.grad, or DeepSpeed's gradient-accumulation dtype)
    state: int  # each of AdamW's two moments
    master: int = 0  # a separate master copy of the trainable parameters (DeepSpeed); 0: none
    autocast: bool = False  # torch.autocast around the forward pass (Accelerate's native AMP)
    compute: int | None = None  # FSDP2 MixedPrecisionPolicy param_dtype: the unsharded working copies
    note: str = ""  # how the strategy carries the policy out (source)

    @property
    def param_compute(self) -> int:
        """Trainable weights as the forward pass reads them."""
        return self.compute or self.param

    @property
    def frozen_compute(self) -> int:
        """Frozen weights as the forward pass reads them (FSDP2's policy casts every parameter)."""
        return self.compute or self.frozen


def policy_regime(policy: str, method: str, strategy: str) -> Regime:
    """The live dtypes of a resolved policy (finetune/precision.py; not "auto") for a method under a
    strategy: the table's bytes per trainable parameter and frozen base; LoRA adapters and QLoRA's
    non-quantized weights as docs/planning.md "Which regime a run had" says."""
    pol = precision.get(policy)
    fam = precision.family_of(strategy)
    tb = precision.trainable_bytes(pol, strategy)
    frozen = precision.frozen_bytes(pol)
    if method == "qlora" and pol.adapters_fp32 and fam != "deepspeed":
        # peft's prepare_model_for_kbit_training leaves the unquantized weights fp32; DeepSpeed's engine then casts
        # every floating parameter to its module dtype (engine.py _cast_module_mixed_precision), ZeRO-3 too (a
        # quantized model is not built under zero.Init): its residual stream is bf16 (tests/planning/test_zero_buffers.py)
        frozen = F32
    compute = tb.working_params if (fam == "fsdp2" and pol.fsdp_param_dtype) else None
    autocast = fam == "torch" and pol.torch_autocast is not None
    how = {
        "torch": "torch.autocast" if autocast else "no autocast",
        "fsdp2": f"FSDP2 MixedPrecisionPolicy(param_dtype={pol.fsdp_param_dtype})" if compute else "FSDP2, no casts",
        "deepspeed": f"DeepSpeed module in {pol.compute_dtype}, separate master",
    }[fam]
    return Regime(
        pol.name,
        tb.params,
        frozen,
        tb.grads,
        tb.optimizer_states // 2,
        master=tb.master,
        autocast=autocast,
        compute=compute,
        note=f"{pol.summary}; {how}",
    )


def legacy_regime(method: str, strategy: str, device_type: str = "cuda", model_dtype: str = "auto") -> Regime:
    """What the project did before the precision policy (records without `precision`; the rules and
    their evidence: docs/planning.md "Which regime a run had"). Sources: modeling/load.py
    resolve_dtype; peft autocast_adapter_dtype; prepare_model_for_kbit_training; DeepSpeed
    engine.get_data_types() (bf16 "auto" resolved to false) and zero.Init._set_dtype."""
    loaded = B16 if (model_dtype in ("auto", "bfloat16", "float16") and device_type == "cuda") else F32
    if model_dtype == "float32":
        loaded = F32
    fam, zero3 = precision.family_of(strategy), by_key(strategy).zero_stage == 3
    label = f"legacy (before training.precision): model loaded in {'bf16' if loaded == B16 else 'fp32'}, no autocast"
    if method == "full":
        if zero3:
            note = "DeepSpeed fp32 mode: zero.Init dtype fp32, separate fp32 master"
            return Regime(label + "; ZeRO-3 zero.Init in fp32", F32, F32, F32, F32, master=F32, note=note)
        if fam == "deepspeed":
            note = "DeepSpeed fp32 mode: 16-bit flat module, fp32 master, fp32 gradient partition"
            return Regime(label + "; DeepSpeed fp32 mode", loaded, loaded, F32, F32, master=F32, note=note)
        note = "weights, gradients and AdamW states in the load dtype"
        return Regime(label, loaded, loaded, loaded, loaded, note=note)
    frozen = F32 if method == "qlora" else loaded
    if zero3 and method != "qlora":
        frozen = F32  # zero.Init re-creates the frozen base in fp32 as well
    master = F32 if fam == "deepspeed" else 0
    note = "fp32 adapters (peft), frozen base in the load dtype"
    return Regime(label, F32, frozen, F32, F32, master=master, note=note)
