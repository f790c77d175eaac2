"""ZeRO-3's dtype trap, for real (finetune/modeling/load.py check_init_dtype).

transformers loads a model inside deepspeed.zero.Init when a ZeRO-3 config is active (what
accelerate's zero3_init_flag sets up before from_pretrained), and zero.Init creates the parameters
in the dtype of the DeepSpeed config, not the one asked for. In a separate process (DeepSpeed's
process group and the global HfDeepSpeedConfig must not leak into other tests), world size 1 over
gloo: a bfloat16 load under a config with bf16 disabled comes out float32 and is refused; with bf16
enabled it stays bfloat16 and passes (the control that the check does not refuse everything).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO, free_port

SCRIPT = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, torch
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from finetune.errors import UserError
from finetune.modeling.load import check_init_dtype
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for bf16 in (False, True):
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                              "bf16": {"enabled": bf16}})
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
    p = model.model.layers[0].mlp.up_proj.weight
    try:
        check_init_dtype(model, torch.bfloat16)
        refused = None
    except UserError as e:
        refused = str(e)
    out[str(bf16)] = {"partitioned": hasattr(p, "ds_tensor"), "dtype": str(p.ds_tensor.dtype), "refused": refused}
    del keep, model
print(json.dumps(out))
"""


def test_zero_init_fp32_parameters_are_refused(tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = got["False"], got["True"]
    assert off["partitioned"] and on["partitioned"]  # zero.Init really ran
    assert off["dtype"] == "torch.float32" and off["refused"], off  # the trap, caught
    assert "bf16" in off["refused"] and "zero3_init_flag" in off["refused"]
    assert on["dtype"] == "torch.bfloat16" and on["refused"] is None, on
