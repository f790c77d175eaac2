"""LoRA merge benchmark (docs/benchmarks.md "Merging LoRA"): `finetune export --merge` (shard by shard) against peft's
merge_and_unload of the whole model, on a random-weight model of a real shape. Not a test:

    python -m tests.bench.bench_merge --out DIR [--dtype bf16|fp32]

The model: Qwen2.5-0.5B's published configuration (QWEN below, from its config.json), random weights in bfloat16
saved in shards of 200 MB; a LoRA of rank 16 on every linear layer with random A and B, saved as a run's model/. Each
merge runs in a fresh process of its own; each reports the kernel's high-water mark of its resident set (VmHWM) after
its imports and at its end, and the seconds of the merge and the save alone. `finetune export` runs as users run it
(the check included, in two more processes of its own); its export.json gives the writing's figures. Then both
folders are compared tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Qwen/Qwen2.5-0.5B config.json (published values; no weights are fetched)
QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 24,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "dtype": "bfloat16",
}
SHARD = "200MB"


def vmhwm_gib() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+)", text, re.M).group(1)) / 2**20


def make(root: Path) -> Path:
    """The base (sharded), the adapter and a run directory around it, as `finetune train` leaves one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from finetune.config.recipe import dump_yaml, load_recipe
    from finetune.data import demo
    from finetune.modeling.bundled import ensure_bundled_model

    base, run = root / "qwen2.5-0.5b-random", root / "run"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN)).to(torch.bfloat16)
    model.save_pretrained(base, max_shard_size=SHARD)
    tokenizer = AutoTokenizer.from_pretrained(ensure_bundled_model())  # ids < Qwen's vocabulary
    tokenizer.save_pretrained(base)
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    for name, p in lora.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.02)
    lora.save_pretrained(run / "model")
    tokenizer.save_pretrained(run / "model")
    cfg, _ = load_recipe("demo", [f"--model.name_or_path={base}", "--method.lora_r=16", "--method.lora_alpha=32"])
    (run / "config.yaml").write_text(dump_yaml(cfg.to_dict()))
    (run / "run.json").write_text(json.dumps({"summary": {"status": "completed", "steps": 0}}))
    (run / ".finetune-run").touch()
    demo.write_demo(run / "data", 16, 0)
    return run


def peft_merge(base: Path, adapter: Path, out: Path, dtype: str) -> dict:
    """In this (fresh) process: the whole base loaded, peft's merge_and_unload, save_pretrained."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    after_imports = vmhwm_gib()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size=SHARD)
    return {"seconds": time.perf_counter() - started, "after_imports_gib": after_imports, "peak_gib": vmhwm_gib()}


def compare(a: Path, b: Path) -> dict:
    """Tensor by tensor: keys, the largest difference, the share of elements that differ."""
    from safetensors.torch import load_file

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    x, y = tensors(a), tensors(b)
    differ = sum((x[k] != y[k]).sum().item() for k in x if k in y)
    return {
        "same_keys": sorted(x) == sorted(y),
        "max_abs_diff": max((x[k].float() - y[k].float()).abs().max().item() for k in x if k in y),
        "differing_share": differ / sum(t.numel() for t in x.values()),
        "tensors": len(x),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--worker", nargs=4, metavar=("BASE", "ADAPTER", "OUT", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(peft_merge(Path(args.worker[0]), Path(args.worker[1]), Path(args.worker[2]), args.worker[3])))
        return 0
    root = Path(args.out)
    run = root / "run" if (root / "run" / "model").is_dir() else make(root)
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    base = root / "qwen2.5-0.5b-random"
    ours, theirs = root / f"ours-{args.dtype}", root / f"peft-{args.dtype}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "finetune.cli", "export", str(run), "--merge", "--dtype", args.dtype]
    subprocess.run([*cmd, "--out", str(ours), "--max-shard-size", SHARD], check=True, env=env, cwd=REPO)
    command_s = time.perf_counter() - started
    worker = [sys.executable, "-m", "tests.bench.bench_merge", "--out", str(root), "--worker"]
    proc = subprocess.run(
        [*worker, str(base), str(run / "model"), str(theirs), dtype],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=REPO,
    )
    found = json.loads((ours / "export.json").read_text())
    result = {
        "dtype": dtype,
        "base_shards": sorted((f.name, f.stat().st_size) for f in base.glob("*.safetensors")),
        "adapter_bytes": (run / "model" / "adapter_model.safetensors").stat().st_size,
        "ours": found["write"] | {"command_s_with_check": round(command_s, 1), "check": found["check"]},
        "peft": json.loads(proc.stdout.strip().splitlines()[-1]),
        "equal": compare(ours, theirs),
    }
    print(json.dumps(result, indent=1))
    (root / f"result-{args.dtype}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
