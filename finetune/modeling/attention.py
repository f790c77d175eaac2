"""Which attention implementation a model family loads with (SDPA where transformers has it for the family, else
eager, said), and which scaled-dot-product-attention (SDPA) backends torch may pick: one policy, set once per process
before the first forward (torch's flags are process-global), and read back for the run record.
`auto` turns cuDNN off on CUDA: it re-plans for every new input shape, which padding-free and
packed batches have at every step (docs/speed.md, with the measurements).
"""

from __future__ import annotations

import contextlib

import torch

from finetune.config.sections import sdpa_list_problem
from finetune.errors import UserError

# recipe name -> torch's flag name (torch.backends.cuda.enable_<flag>_sdp / <flag>_sdp_enabled)
# and the torch.nn.attention.SDPBackend member.
BACKENDS = {
    "flash": ("flash", "FLASH_ATTENTION"),
    "efficient": ("mem_efficient", "EFFICIENT_ATTENTION"),
    "math": ("math", "MATH"),
    "cudnn": ("cudnn", "CUDNN_ATTENTION"),
}
CPU_USABLE = ("flash", "math")
# `auto` on CUDA: every backend but cuDNN (the per-shape re-planning above).
AUTO_CUDA = ("flash", "efficient", "math")
POLICIES = ("auto", "torch_default")  # or a list of BACKENDS names


def for_family(model_type: str | None, requested: str) -> tuple[str, str | None]:
    """(the implementation to load with, why it is not model.attn_implementation): a family whose causal-LM class has
    no SDPA attention in this transformers (BLOOM, GPT-Neo, MPT, ...: `_supports_sdpa` false) loads with eager, the
    same computation without the fused kernels; a FlashAttention request it lacks is refused (UserError). A model of
    its own code (auto_map) or an unknown type is loaded as asked: transformers says what it lacks."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    name = CAUSAL.get(model_type) if isinstance(model_type, str) else None
    family = getattr(transformers, name, None) if name else None
    if family is None or requested == "eager":
        return requested, None
    if requested == "sdpa" and not family._supports_sdpa:
        return "eager", (
            f"{name} ({model_type}) has no SDPA attention in transformers {transformers.__version__}: eager attention "
            "instead (the same computation without SDPA's fused kernels: slower, more memory on long sequences)"
        )
    if requested.startswith("flash_attention") and not family._supports_flash_attn:
        has = "sdpa or eager" if family._supports_sdpa else "eager"
        raise UserError(
            f"model.attn_implementation: {requested}, but {name} ({model_type}) has no FlashAttention in transformers "
            f"{transformers.__version__}; use {has}"
        )
    return requested, None


def problems(policy, device_type: str | None = None) -> list[str]:
    """What is wrong with a `model.sdpa_backends` value ([] = nothing); device_type adds the
    check that a CPU run keeps a backend the CPU has."""
    if isinstance(policy, str):
        return (
            []
            if policy in POLICIES
            else [
                f"model.sdpa_backends: got {policy!r}; allowed: auto, torch_default, or a list of {', '.join(BACKENDS)}"
            ]
        )
    if problem := sdpa_list_problem(policy):
        return [problem]
    if device_type == "cpu" and not set(policy) & set(CPU_USABLE):
        return [
            f"model.sdpa_backends: {policy} has no backend that runs on CPU (torch's CPU attention has only "
            f"{' and '.join(CPU_USABLE)})"
        ]
    return []


def resolve(policy, device_type: str) -> tuple[str, ...] | None:
    """The backends to enable, or None to leave torch's flags as they are."""
    found = problems(policy, device_type)
    if found:
        raise ValueError(found[0])
    if policy == "torch_default":
        return None
    if policy == "auto":
        return AUTO_CUDA if device_type == "cuda" else None  # CPU: nothing to choose (flash, then math)
    return tuple(policy)


def enabled() -> list[str]:
    """The backends torch may pick now, from its flags."""
    return [name for name, (flag, _) in BACKENDS.items() if getattr(torch.backends.cuda, f"{flag}_sdp_enabled")()]


def set_enabled(names) -> None:
    for name, (flag, _) in BACKENDS.items():
        getattr(torch.backends.cuda, f"enable_{flag}_sdp")(name in names)


def priority() -> list[str] | None:
    """The order torch tries the backends in (torch._C._get_sdp_priority_order, torch 2.13), or
    None where this torch does not say."""
    from torch.nn.attention import SDPBackend

    order = getattr(torch._C, "_get_sdp_priority_order", None)
    if order is None:
        return None
    by_int = {int(getattr(SDPBackend, member)): name for name, (_, member) in BACKENDS.items()}
    return [by_int[i] for i in order() if i in by_int]


def apply(policy, device_type: str, implementation: str = "sdpa") -> dict:
    """Set the process-global flags (every rank, before the first forward) and return what is in
    force: run.json `speed.attention`. With an attention implementation other than sdpa the flags
    change nothing the model runs; they are still set, and the record says they do not apply."""
    chosen = resolve(policy, device_type)
    if chosen is not None:
        set_enabled(chosen)
    sdpa = implementation == "sdpa"
    return {
        "implementation": implementation,
        "sdpa_backends_policy": policy,
        "sdpa_backends_enabled": enabled() if sdpa else None,
        "sdpa_priority": priority() if sdpa else None,
    }


@contextlib.contextmanager
def flags_restored():
    """Put torch's SDPA flags back as they were (the global setters do not restore them): for
    code that runs several trainings in one process (the benchmark's --in-process, tests)."""
    before = enabled()
    try:
        yield
    finally:
        set_enabled(before)
