"""LoRA folded into its base shard by shard: each base tensor is read on its own (safetensors' safe_open), the ones an
adapter targets merged by peft's own LoRA layer (its scaling lora_alpha / r or / sqrt(r) under rsLoRA, its rank and
alpha patterns, fan_in_fan_out), and written into output shards of a bounded size, so the host holds about one shard
plus the adapter, never the whole model (docs/benchmarks.md "Merging LoRA"). QLoRA: each weight the 4-bit base
quantized is first quantized and dequantized as bitsandbytes did when the run loaded it, so the adapter lands on the
weights it trained against.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from finetune.errors import UserError
from finetune.export import figures, sources

# LoraConfig fields this merge cannot honour: variants with more state than A and B, or an initialisation that
# changed the base weights (PiSSA, OLoRA, CorDA: the saved base is no longer the one the adapter sits on)
UNSUPPORTED = (
    "use_dora use_qalora use_bdlora lora_bias alora_invocation_tokens arrow_config velora_config monteclora_config "
    "kasa_config layer_replication modules_to_save trainable_token_indices"
).split()
PLAIN_INITS = (True, False, "gaussian")


def lora_config(adapter_config: dict):
    """peft's LoraConfig of the adapter; UserError naming what this merge does not fold in."""
    from peft import LoraConfig

    values = {k: v for k, v in adapter_config.items() if k in LoraConfig.__dataclass_fields__}
    config = LoraConfig(**values)
    refused = [k for k in UNSUPPORTED if getattr(config, k, None)]
    if config.init_lora_weights not in PLAIN_INITS:
        refused.append(f"init_lora_weights={config.init_lora_weights!r}")
    if refused:
        raise UserError(
            f"--merge: the adapter uses {', '.join(refused)}; this merge folds plain LoRA (A and B of linear layers) "
            f"only. Load it with peft and call merge_and_unload() instead"
        )
    return config


def base_files(base: Path) -> list[str]:
    """The base model's safetensors files, in the order its index (or its one file) gives them."""
    files, problems = figures.weight_files(base)
    if problems:
        raise UserError(f"the base model {base}: {'; '.join(problems)}")
    return [name for name, _ in files]


def merged_tensors(
    base: Path, adapter: dict[str, torch.Tensor], config, dequantize: Callable | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every base tensor, in file order, one at a time: fp32 and merged where the adapter targets it,
    else as stored; `dequantize(name, tensor)`: QLoRA's 4-bit round trip. UserError when an adapter module has no
    weight in the base."""
    from safetensors import safe_open

    modules = sources.adapter_modules(adapter)
    targets = {f"{module}.weight": module for module in modules}
    files = base_files(base)
    held = set()
    for name in files:
        with safe_open(str(Path(base) / name), "pt") as f:
            held.update(f.keys())
    missing = sorted(set(targets) - held)
    if missing:
        raise UserError(f"--merge: the base model {base} has no weight for the adapter's {', '.join(missing[:3])}")
    for name in files:
        with safe_open(str(Path(base) / name), "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if dequantize is not None:
                    tensor = dequantize(key, tensor)
                if key in targets:
                    a, b = modules[targets[key]]
                    tensor = merge_one(tensor, adapter[a], adapter[b], targets[key], config)
                yield key, tensor


def merge_one(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, module: str, config) -> torch.Tensor:
    """weight + scaling * (B @ A), computed in fp32 by peft's LoRA layer for `module` (its merge, safe_merge: a
    non-finite result raises)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils.other import get_pattern_key
    from transformers.pytorch_utils import Conv1D

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
    with torch.device("meta"):  # the layer's own weight is replaced below: never allocated
        if config.fan_in_fan_out:  # GPT-2 style Conv1D: weight [in, out]
            base = Conv1D(weight.shape[1], weight.shape[0])
        else:
            base = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    base.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
    layer = LoraLinear(base, "default", config=config, r=r, lora_alpha=alpha)
    layer.lora_A["default"].weight.data = a.float()
    layer.lora_B["default"].weight.data = b.float()
    layer.merge(safe_merge=True)
    return layer.get_base_layer().weight.data


def requantizer(base: Path, quantization: dict, load_dtype: str) -> Callable:
    """QLoRA: (name, tensor) -> the tensor as the run's 4-bit base held it, dequantized (fp32): every weight
    transformers quantizes (its linear layers but those it keeps, the output head), loaded in `load_dtype` and
    quantized with the run's BitsAndBytesConfig by bitsandbytes' own quantize_4bit; the others unchanged."""
    import bitsandbytes.functional as bnb
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    keep = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keys = {
        f"{name}.weight"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and should_convert_module(name, keep)
    }
    storage = getattr(torch, quantization.get("bnb_4bit_quant_storage") or "uint8")

    def dequantized(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in keys:
            return tensor
        packed, state = bnb.quantize_4bit(
            tensor.to(getattr(torch, load_dtype)).contiguous(),
            blocksize=64,  # bitsandbytes Params4bit's default, which transformers' loading keeps
            compress_statistics=quantization["bnb_4bit_use_double_quant"],
            quant_type=quantization["bnb_4bit_quant_type"],
            quant_storage=storage,
        )
        return bnb.dequantize_4bit(packed, state).float()

    return dequantized


class ShardWriter:
    """Tensors into safetensors files of at most `max_bytes` each (a larger tensor gets a file of its own) in `dtype`,
    and their index; one file is model.safetensors with no index, as transformers saves. Holds one file's worth."""

    def __init__(self, folder: Path, max_bytes: float, dtype: torch.dtype):
        self.folder, self.max_bytes, self.dtype = Path(folder), max_bytes, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.expected: dict[str, dict] = {}  # name -> shape, dtype, norm of what was written (before the cast)
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.expected[name] = figures.summary(tensor)
        if tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / part), metadata={"format": "pt"})
        self.files.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """The files' final names (model-0000i-of-0000n.safetensors and the index, or model.safetensors)."""
        if self.pending:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (part, keys), name in zip(self.files, names):
            (self.folder / part).rename(self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
            names.append("model.safetensors.index.json")
        return names
