"""Model FLOPs of a training step, from the live model (what its forward multiplies), not from
config arithmetic that only fits Llama-shaped models: PaLM's convention, 6N (4N for LoRA/QLoRA)
plus attention within each example (docs/run_record.md "throughput" has the counting rules).
"""

from __future__ import annotations

from dataclasses import dataclass

# Module name parts whose parameters are not weights of the base forward (peft's adapters and
# the frozen copy ModulesToSaveWrapper keeps beside the trained one).
SKIPPED_PARTS = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "original_module"}
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of a training step: weight_factor·N per input token + attention_coeff per squared example length."""

    matmul_params: int  # N (MoE: active experts only)
    weight_factor: int  # 6 full fine-tuning, 4 frozen base (LoRA/QLoRA)
    attention_coeff: int  # 12·L·H·Q: FLOPs per token per token of its example
    convention: str

    def flops(self, input_tokens: float, sum_sq_lengths: float) -> float:
        """Model FLOPs of tokens in examples of lengths T_i: sum T_i = input_tokens, sum T_i^2 = sum_sq_lengths."""
        return self.weight_factor * self.matmul_params * input_tokens + self.attention_coeff * sum_sq_lengths


def from_model(model, method: str) -> tuple[ModelFlops | None, str | None]:
    """(ModelFlops, None), or (None, why the FLOPs cannot be known for this model). Never raises:
    a figure that cannot be had is null in the record, the run goes on."""
    try:
        return _from_model(model, method)
    except Exception as e:  # an architecture this code did not foresee: no figure, and why  # noqa: BLE001
        return None, f"model FLOPs could not be counted for {type(model).__name__}: {type(e).__name__}: {e}"


def _from_model(model, method: str) -> tuple[ModelFlops | None, str | None]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None:
        return None, f"{type(base).__name__} has no config to read the attention shape from"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dense, experts, banks = count_matmul_params(base)
    if experts:
        top_k = next((getattr(text, k) for k in TOP_K_KEYS if isinstance(getattr(text, k, None), int)), None)
        n_experts = banks or next(
            (
                getattr(text, k)
                for k in ("num_local_experts", "num_experts", "n_routed_experts")
                if isinstance(getattr(text, k, None), int)
            ),
            None,
        )
        if not top_k or not n_experts:
            return None, (
                f"{type(base).__name__} is a mixture of experts but its config does not say how many "
                f"experts a token uses ({' / '.join(TOP_K_KEYS)}) or how many there are"
            )
        dense += experts * top_k // n_experts
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) // heads if heads else None)
    if not (isinstance(layers, int) and isinstance(heads, int) and head_dim):
        return None, (
            f"{type(text).__name__} does not give the attention shape (num_hidden_layers "
            f"{layers!r}, num_attention_heads {heads!r}, head_dim {head_dim!r})"
        )
    full = method == "full"
    return ModelFlops(
        matmul_params=int(dense),
        weight_factor=6 if full else 4,
        attention_coeff=12 * layers * heads * head_dim,
        convention=(
            "6N + 12LHQT (PaLM appendix B)"
            if full
            else "4N + 12LHQT: frozen base (no weight gradients), LoRA FLOPs ignored"
        )
        + "; N = matmul weights of the live model incl. LM head"
        + (", active experts only" if experts else "")
        + "; T = each example's own length",
    ), None


def count_matmul_params(model) -> tuple[int, int, int]:
    """(dense matmul weights, expert matmul weights, experts per bank or 0), logical sizes."""
    import torch
    from transformers.pytorch_utils import Conv1D

    dense = experts = banks = 0
    for name, module in model.named_modules():
        parts = set(name.split("."))
        if parts & SKIPPED_PARTS:
            continue
        in_experts = "experts" in parts
        if isinstance(module, torch.nn.Linear):
            size = module.in_features * module.out_features
        elif isinstance(module, Conv1D):
            size = module.nx * module.nf
        elif isinstance(module, torch.nn.Embedding):
            continue  # a lookup, not a matmul (a tied LM head is counted as the Linear that multiplies)
        else:
            size = 0
            for p in module.parameters(recurse=False):
                shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # ZeRO-3: the full shape
                if len(shape) == 3:  # a fused bank of experts: (experts, out, in)
                    experts += _numel(shape)
                    banks = banks or shape[0]
                elif len(shape) >= 2:
                    size += _numel(shape)
        if in_experts:
            experts += size
        else:
            dense += size
    return dense, experts, banks


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
