"""LoRA folded into its base shard by shard: each base tensor is read on its own (safetensors' safe_open), the ones an
adapter targets merged by peft's own LoRA layer (its scaling lora_alpha / r or / sqrt(r) under rsLoRA, its rank and
alpha patterns, fan_in_fan_out), and written into output shards of a bounded size, so the host holds about one shard
plus the adapter, never the whole model (docs/benchmarks.md "Merging LoRA"). QLoRA: each weight the 4-bit base
quantized is first quantized and dequantized as bitsandbytes did when the run loaded it, so the adapter lands on the
weights it trained against.
"""

from __future__ import annotations

import json
import math
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


def base_layout(base: Path) -> list[tuple[str, list, str]]:
    """(name, shape, dtype) of every base tensor, in the order merged_tensors yields them (its files' headers)."""
    from safetensors import safe_open

    layout = []
    for name in base_files(base):
        with safe_open(str(Path(base) / name), "pt") as f:
            layout += [
                (k, f.get_slice(k).get_shape(), sources.dtype_name(f.get_slice(k).get_dtype())) for k in f.keys()
            ]
    return layout


def merged_tensors(
    base: Path, adapter: dict[str, torch.Tensor], config, dequantize: Callable | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every base tensor, in file order, one at a time: fp32 and merged where the adapter targets it,
    else as stored; `dequantize(name, tensor)`: QLoRA's 4-bit round trip. UserError when an adapter module has no
    weight in the base."""
    from safetensors import safe_open

    modules = sources.adapter_modules(adapter)
    targets = {f"{module}.weight": module for module in modules}
    missing = sorted(set(targets) - {name for name, _, _ in base_layout(base)})
    if missing:
        raise UserError(f"--merge: the base model {base} has no weight for the adapter's {', '.join(missing[:3])}")
    for name in base_files(base):
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
    """weight + scaling * (B @ A), computed in fp32 by peft's LoRA layer for `module` (its own merge)."""
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
    layer.merge()  # as merge_and_unload: a non-finite result is the check's to find (its logits are then not finite)
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


# safetensors' dtype names (its format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
# shape and byte range in the data that follows, padded with spaces to 8 bytes; the tensors' bytes in that order)
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ShardWriter:
    """Tensors into safetensors files of at most `max_bytes` each (a larger tensor gets a file of its own), floating
    ones in `dtype`, and their index; one file is model.safetensors with no index, as transformers saves. `layout`:
    each tensor's (name, shape, dtype) in the order add() gets them (the base's or the source's headers), so each
    file's header is written first and every tensor straight after it: the writer holds no tensor of its own (the
    safetensors package writes a whole dict at once, which would hold a file's worth twice)."""

    def __init__(self, folder: Path, max_bytes: float, dtype: torch.dtype, layout: list[tuple[str, list, str]]):
        self.folder, self.dtype = Path(folder), dtype
        self.files: list[list[tuple[str, list, torch.dtype]]] = [[]]
        size = 0
        for name, shape, stored in layout:
            kept = getattr(torch, stored)
            out = dtype if kept.is_floating_point else kept
            n = math.prod(shape) * torch.empty(0, dtype=out).element_size()
            if self.files[-1] and size + n > max_bytes:
                self.files.append([])
                size = 0
            self.files[-1].append((name, list(shape), out))
            size += n
        self.expected: dict[str, dict] = {}  # name -> shape, dtype, norm of what was written (before the cast)
        self.total = 0
        self.written: list[tuple[str, list[str]]] = []
        self.handle, self.left = None, []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.expected[name] = figures.summary(tensor)
        if not self.left:
            self._next_file()
        want, shape, out = self.left.pop(0)
        if (want, shape) != (name, list(tensor.shape)):
            raise RuntimeError(f"the export's layout expected {want} {shape}, got {name} {list(tensor.shape)}")
        data = tensor.to(out).contiguous().reshape(-1).view(torch.uint8)
        self.handle.write(memoryview(data.numpy()))
        self.total += data.numel()
        if not self.left:
            self.handle.close()

    def _next_file(self) -> None:
        entries = self.files[len(self.written)]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, out in entries:
            end = offset + math.prod(shape) * torch.empty(0, dtype=out).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[out], "shape": shape, "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        part = f".part-{len(self.written):05d}.safetensors"
        self.handle = open(self.folder / part, "wb")  # noqa: SIM115 - closed after its last tensor
        self.handle.write(len(text).to_bytes(8, "little") + text)
        self.written.append((part, [name for name, _, _ in entries]))
        self.left = list(entries)

    def close(self) -> list[str]:
        """The files' final names (model-0000i-of-0000n.safetensors and the index, or model.safetensors)."""
        if self.left or len(self.written) != len(self.files):
            raise RuntimeError(
                f"the export ended before its last tensors: {len(self.written)} of {len(self.files)} files"
            )
        n = len(self.written)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (part, keys), name in zip(self.written, names):
            (self.folder / part).rename(self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
            names.append("model.safetensors.index.json")
        return names
