"""Issue 47 items 1 and 2: `finetune plan` plans any model from its config.json alone (a local folder or file, the
Hugging Face cache, the shipped table of published configs, the Hub's config.json when online) without importing
torch. Each source is exercised as a user meets it: `finetune plan` in a subprocess with the environment
huggingface_hub reads (HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT); the Hub is a local HTTP server."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from finetune.planning import model_source, shapes
from tests.conftest import REPO

# Parameter counts the models' Hub pages give (safetensors metadata), written independently of the table: the
# table's shapes must reproduce each through the planner's arithmetic. Qwen3-0.6B and 1.7B tie their head to the
# embedding (tie_word_embeddings: true) yet store it separately, and their pages count it twice: + vocab x hidden.
PUBLISHED_PARAMETERS = {
    "Llama-3.2-1B": 1_235_814_400,
    "Llama-3.2-3B": 3_212_749_824,
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-1.5B": 1_543_714_304,
    "Qwen2.5-3B": 3_085_938_688,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-14B": 14_770_033_664,
    "Qwen2.5-32B": 32_763_876_352,
    "Qwen2.5-72B": 72_706_203_648,
    "Qwen3-0.6B": 751_632_384,
    "Qwen3-1.7B": 2_031_739_904,
    "Qwen3-4B": 4_022_468_096,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-14B": 14_768_307_200,
    "Qwen3-32B": 32_762_123_264,
    "Mistral-7B-v0.3": 7_248_023_552,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
    "gemma-3-1b-it": 999_885_952,
    "Phi-3-mini-4k-instruct": 3_821_079_552,
    "Phi-3-medium-4k-instruct": 13_960_238_080,
    "phi-4": 14_659_507_200,
    "Phi-4-mini-instruct": 3_836_021_760,
}
STORED_UNTIED = {"Qwen3-0.6B", "Qwen3-1.7B"}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_the_shipped_table_reproduces_each_models_published_parameter_count(name):
    config = model_source.read_config(name)
    count = shapes.count_parameters(config)
    stored = count.total + (config.vocab_size * config.hidden_size if name in STORED_UNTIED else 0)
    assert stored == PUBLISHED_PARAMETERS[name]
    assert (count.lm_head == 0) == config.tie_word_embeddings


def test_every_row_of_the_table_has_its_families_shapes():
    """Every row's model plans: its type has arithmetic, heads divide into kv groups, and each named repository
    resolves to its row (base and instruct ids alike, with or without the organisation)."""
    names = model_source.published()
    for key, values in names.items():
        assert values["num_attention_heads"] % values["num_key_value_heads"] == 0, key
        assert values["model_type"] in shapes.DECODERS, key
    assert names["meta-llama/llama-3.1-8b-instruct"]["repo"] == names["llama-3.1-8b"]["repo"]
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"} == {
        v["model_type"] for v in names.values()
    }


def plan(*args: str, env: dict | None = None, importtime: bool = False) -> subprocess.CompletedProcess:
    """`finetune plan ARGS --json` as a user runs it: a new interpreter, this environment plus `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "finetune.cli", "plan", *args]
    return subprocess.run(
        command, cwd=REPO, env={**base, **(env or {})}, capture_output=True, text=True, timeout=120, check=False
    )


def planned(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_a_local_folder_and_a_config_file(tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    for model in (tiny_model_dir, tiny_model_dir / "config.json"):
        out = planned(plan("--recipe", "demo", "--model", str(model), "--json", env={"HF_HUB_CACHE": str(tmp_path)}))
        assert (out["model"]["layers"], out["model"]["hidden"]) == (config["num_hidden_layers"], config["hidden_size"])
        assert out["model"]["source"] == f"local file {tiny_model_dir / 'config.json'}"


def test_a_folder_without_config_json_is_said_with_how_to_fix_it(tiny_model_dir, tmp_path):
    """Before: `--model: directory X has no config.json`, and nothing on what to pass instead. Now the fix: the base
    model of a LoRA adapter saved there, a folder in it that has a config.json, else the forms --model takes."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    empty, adapter, run = tmp_path / "empty", tmp_path / "adapter", tmp_path / "run"
    empty.mkdir()
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    said = {}
    for folder in (empty, adapter, run):
        proc = plan("--recipe", "demo", "--model", str(folder), env=env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        said[folder] = " ".join(proc.stderr.split())
        assert f"--model: directory {folder} has no config.json; " in said[folder]
    assert (
        "pass the folder that holds the model's config.json (next to its weights, e.g. what `hf download ORG/NAME "
        f"config.json --local-dir {empty}` fetches), the config.json itself, a hub id, or a model of the shipped "
        "table: Llama-3.2-1B" in said[empty]
    )
    assert "it holds a LoRA adapter: plan its base model, --model Qwen/Qwen2.5-0.5B" in said[adapter]
    assert f"a folder in it has one: --model {run / 'model'}" in said[run]


def fake_cache(root: Path, repo: str, config: dict, commit: str = "0" * 40) -> Path:
    """The layout huggingface_hub writes: models--ORG--NAME/refs/main holds the commit, snapshots/COMMIT the files."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


def test_a_cached_hub_id_offline(tmp_path):
    """A hub id in the cache is read from it, offline, and the cache wins over the table for an id both have."""
    shipped = model_source.published()["qwen2.5-0.5b"]
    mine = {k: v for k, v in shipped.items() if k != "repo"} | {"num_hidden_layers": 5}  # not the table's 24
    path = fake_cache(tmp_path / "hub", "Qwen/Qwen2.5-0.5B", mine)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = planned(plan("--recipe", "demo", "--model", "Qwen/Qwen2.5-0.5B", "--json", env=env))
    assert out["model"]["layers"] == 5 and out["model"]["source"] == f"Hugging Face cache ({path.resolve()})"
    # control: without the cached copy the same id comes from the shipped table
    out = planned(
        plan("--recipe", "demo", "--model", "Qwen/Qwen2.5-0.5B", "--json", env={**env, "HF_HUB_CACHE": "/nonexistent"})
    )
    assert out["model"]["layers"] == 24 and out["model"]["source"].startswith("shipped table")


def test_a_shipped_id_offline_and_an_unknown_one_named_with_what_was_tried(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = planned(plan("--recipe", "demo", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--json", env=env))
    assert out["model"]["parameters"] == PUBLISHED_PARAMETERS["Llama-3.1-8B"]
    assert "meta-llama/Llama-3.1-8B" in out["model"]["source"]
    missing = plan("--recipe", "demo", "--model", "someorg/unknown-7b", env=env)
    assert missing.returncode == 2
    said = " ".join(missing.stderr.split())
    assert f"not in the Hugging Face cache ({tmp_path})" in said and "not in the shipped table" in said
    assert "the Hub not tried: HF_HUB_OFFLINE is set" in said and "no hub access" not in said
    assert "Llama-3.1-8B" in said and "Qwen3-8B" in said  # the table's names, to pick from


class Hub(http.server.BaseHTTPRequestHandler):
    """A stand-in for the Hub's /REPO/resolve/REVISION/FILE: serves `files`, records every request."""

    files: dict = {}
    seen: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        body = type(self).files.get(self.path)
        if body is None:
            self.send_error(401 if "gated" in self.path else 404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture
def hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Hub.files, Hub.seen = {}, []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetched_from_the_hub_when_online(hub, tmp_path):
    """An id neither cached nor shipped: its config.json only, from HF_ENDPOINT; a gated one names the fix;
    offline nothing is asked."""
    served = {
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    Hub.files["/someorg/small-model/resolve/main/config.json"] = json.dumps(served).encode()
    env = {"HF_ENDPOINT": hub, "HF_HUB_CACHE": str(tmp_path), "HF_TOKEN": "hf_test"}
    out = planned(plan("--recipe", "demo", "--model", "someorg/small-model", "--json", env=env))
    assert Hub.seen == [("/someorg/small-model/resolve/main/config.json", "Bearer hf_test")]
    assert out["model"]["source"] == f"the Hub ({hub}/someorg/small-model/resolve/main/config.json)"
    from transformers import Qwen2Config

    assert out["model"]["parameters"] == shapes.count_parameters(Qwen2Config(**served)).total
    assert not list(tmp_path.iterdir())  # nothing written into the cache
    gated = plan("--recipe", "demo", "--model", "someorg/gated-model", env=env)
    assert gated.returncode == 2 and "the Hub answered 401" in gated.stderr and "HF_TOKEN" in gated.stderr
    Hub.seen.clear()
    offline = plan("--recipe", "demo", "--model", "someorg/small-model", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and "HF_HUB_OFFLINE is set" in offline.stderr and Hub.seen == []


def imported(importtime_stderr: str) -> set[str]:
    """Top-level packages `python -X importtime` saw imported (its lines: `import time: self | cumulative | name`)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_plan_imports_no_torch(tmp_path):
    """Issue 47 item 2: transformers' AutoConfig brought torch into every plan (2.7 s on 2 cores); the plan reads
    config.json itself now. Control: the same parse sees torch where AutoConfig is imported."""
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    args = ("--recipe", "zero2", "--model", "Llama-3.1-8B", "--gpus", "2", "--gpu-memory", "24GiB")
    proc = plan(*args, env=env, importtime=True)
    assert proc.returncode == 0 and proc.stdout.startswith("answer: "), proc.stderr[-2000:]
    seen = imported(proc.stderr)
    assert "finetune" in seen and "yaml" in seen  # the parse reads this command's imports
    assert "torch" not in seen and "transformers" not in seen
    control = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from transformers import AutoConfig"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "torch" in imported(control.stderr)


@pytest.mark.parametrize("name", ["phi-4", "gemma-2-9b", "gemma-3-4b-it"])
def test_the_tables_phi_and_gemma_models_are_planned(name, capsys):
    """Phi-3/4 and Gemma 2/3 were refused before their blocks were followed (tests/planning/test_activations.py
    checks the arithmetic to the byte); now the plan answers for them."""
    from finetune.cli.dispatch import main

    main(["plan", "--recipe", "ddp", "--model", name, "--gpus", "2", "--gpu-memory", "80GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["model_type"] == model_source.read_config(name).model_type
    assert out["answer"]["strategy"] and 0 < out["answer"]["device_fraction"] <= 0.9


def test_a_family_whose_block_is_not_followed_is_refused_by_name(tmp_path, capsys):
    """GPT-2's parameters are counted, its block (LayerNorm, fused c_attn, learned positions) is not followed:
    the plan refuses it by name rather than guessing."""
    from finetune.cli.dispatch import main

    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--recipe", "demo", "--model", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert ended.value.code == 2 and "no activation arithmetic for model_type 'gpt2'" in err
    assert "parameters are counted" in err
