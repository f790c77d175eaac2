"""The bad-input table: every input a user gives, broken on purpose, and what `finetune` says.

Each case writes the broken input into a scratch workspace that also holds what the user already
has (an earlier run directory, the data file, the recipe), runs `finetune train` (finetune.cli.main)
or finetune/train.py's main in this process, and records the exit code, the message and whether
any file the user had changed (SHA-256 before and after). `accelerate launch` is replaced by a
recorder: a case that gets as far as launching is a failure of the table.

    python -m tests.cli.bad_inputs_table > docs/bad_inputs.md    # regenerate the document

tests/cli/test_bad_inputs.py runs the same cases under pytest and checks each one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root

GOOD_ROWS = [{"instruction": "Add 2 and 3.", "output": "5"}, {"instruction": "Add 1 and 1.", "output": "2"}]


@dataclass
class Case:
    what: str  # the broken input, in the user's words
    where: str  # which input: recipe, override, data file, accelerate config, ...
    setup: Callable[[Path], list[str]]  # writes files into the workspace, returns the extra arguments
    expect: tuple[str, ...]  # what the message must name (written here by hand, not taken from a run)
    entry: str = "finetune train"  # "train.py": finetune/train.py main() in this process; or "finetune export"
    env: dict = field(default_factory=dict)  # huggingface_hub.constants overrides, see _patched
    gpu_free_only: bool = False  # the problem exists only on a machine without CUDA (the test hides CUDA for it)
    needs_root: bool = False  # made with a mount (a full disk): only as root


@dataclass
class Outcome:
    exit_code: int | None
    message: str
    launched: bool
    changed: list[str]  # files the user had that are different or gone afterwards
    created: list[str]  # top-level paths of new files (a failed run's own directory, say)
    traceback: bool


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _recipe(text: str):
    return lambda ws: ["--recipe", str(_write(ws / "my_recipe.yaml", text))]


def _data(content: str | bytes, name: str = "train.jsonl"):
    return lambda ws: [f"--data.path={_write(ws / name, content)}"]


def _accelerate(text: str, *, ds: str | None = None, recipe: str = "zero2"):
    def setup(ws: Path) -> list[str]:
        if ds is not None:
            _write(ws / "ds.json", ds)
        return ["--recipe", recipe, "--config_file", str(_write(ws / "launch.yaml", text.replace("WS", str(ws))))]

    return setup


CPU_DS = (
    "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\n"
    "deepspeed_config:\n  deepspeed_config_file: WS/ds.json\n"
)
AUTO_DS = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}


_CLEANUPS: list = []  # undone after each case (run_case): mounts, processes holding a run directory


def cleanup() -> None:
    while _CLEANUPS:
        _CLEANUPS.pop()()


def _tmpfs(path: Path, options: str) -> Path:
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    _CLEANUPS.append(lambda: subprocess.run(["umount", "-l", str(path)], check=False))
    return path


def _read_only(ws: Path) -> list[str]:
    """An output directory under a read-only mount (root ignores permission bits), mode 0555 otherwise."""
    ro = ws / "ro"
    if os.geteuid() == 0:
        _tmpfs(ro, "size=1m,ro")
    else:
        ro.mkdir()
        ro.chmod(0o555)
        _CLEANUPS.append(lambda: ro.chmod(0o755))
    return [f"--run.output_dir={ro / 'run'}"]


def _full_disk(ws: Path) -> list[str]:
    """An output directory on a filesystem of one 4 KiB page: the directory and its lock fit, run.json does not."""
    return [f"--run.output_dir={_tmpfs(ws / 'disk', 'size=4k') / 'run'}"]


def _held(run: str, then=None):
    """Another process holds runs/<run> as a live run does (finetune/launch/run_lock.py)."""
    import subprocess

    def setup(ws: Path) -> list[str]:
        extra = then(ws) if then else []
        code = (
            f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
            f"from finetune.launch import run_lock; run_lock.Locks().acquire(Path({str(ws / 'runs' / run)!r})); "
            f"print('holding', flush=True); time.sleep(600)"
        )
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        _CLEANUPS.append(lambda: (holder.kill(), holder.wait()))
        assert holder.stdout.readline().strip() == "holding"
        return extra

    return setup


def _fifo(ws: Path) -> list[str]:
    os.mkfifo(ws / "train.jsonl.pipe")
    return [f"--data.path={ws / 'train.jsonl.pipe'}"]


def _link_loop(ws: Path) -> list[str]:
    (ws / "a.jsonl").symlink_to(ws / "b.jsonl")
    (ws / "b.jsonl").symlink_to(ws / "a.jsonl")
    return [f"--data.path={ws / 'a.jsonl'}"]


def _model_config(make_config) -> Callable[[Path], list[str]]:
    """A model directory holding only the config `make_config()` builds: preflight reads no weights."""

    def setup(ws: Path) -> list[str]:
        make_config().save_pretrained(ws / "other-model")
        return [f"--model.name_or_path={ws / 'other-model'}"]

    return setup


def _bert():
    from transformers import BertConfig

    return BertConfig(architectures=["BertForMaskedLM"])


def _bart():
    from transformers import BartConfig

    return BartConfig(architectures=["BartForConditionalGeneration"])


def _truncated_weights(ws: Path) -> list[str]:
    model = shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], ws / "half-copied-model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return [f"--model.name_or_path={model}"]


def _broken_model_file(name: str):
    """A copy of the tiny model whose `name` (generation_config.json, tokenizer_config.json) is cut in half."""

    def setup(ws: Path) -> list[str]:
        model = shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], ws / "model-with-a-cut-file")
        text = (model / name).read_text()
        (model / name).write_text(text[: len(text) // 2])
        return [f"--model.name_or_path={model}"]

    return setup


def _shards(files: dict[str, str | bytes], path: str = "shards"):
    """Data kept as several files in the workspace; `path` (a folder or a glob, relative to it) names them."""

    def setup(ws: Path) -> list[str]:
        for name, content in files.items():
            _write(ws / name, content)
        return [f"--data.path={ws / path}"]

    return setup


def _cache_in_a_file(ws: Path) -> list[str]:
    _write(ws / "cache", "a file where the cache folder should be")
    return [f"--data.cache_dir={ws / 'cache' / 'tokenized'}"]


def _small_embedding(ws: Path) -> list[str]:
    """A tiny Llama with 1,000 embedding rows, saved with the table model's 49,152-token tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(ws / "small-vocab-model")
    AutoTokenizer.from_pretrained(os.environ["FINETUNE_TABLE_MODEL"]).save_pretrained(ws / "small-vocab-model")
    return [f"--model.name_or_path={ws / 'small-vocab-model'}"]


def _no_chat_template(ws: Path) -> list[str]:
    """A copy of the tiny model whose tokenizer has no chat template."""
    model = ws / "model-without-template"
    shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], model)
    for f in model.glob("chat_template.*"):
        f.unlink()
    config = model / "tokenizer_config.json"
    values = json.loads(config.read_text())
    values.pop("chat_template", None)
    config.write_text(json.dumps(values))
    return [f"--model.name_or_path={model}"]


def _no_tokenizer(ws: Path) -> list[str]:
    """A copy of the tiny model saved without its tokenizer (model.save_pretrained alone)."""
    model = shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], ws / "model-without-tokenizer")
    for f in [*model.glob("tokenizer*"), *model.glob("chat_template*")]:
        f.unlink()
    return [f"--model.name_or_path={model}"]


def _resume(
    launch: list[str],
    *,
    model_sha: str | None = None,
    strategy: str = "zero3",
    world: int = 2,
    fingerprint: str | None = None,
    mesh: dict | None = None,
    change=None,
):
    """An earlier run, runs/prev (its run.json too), whose complete checkpoint-3 was written by ZeRO-3
    on 2 ranks x 4 per device x accumulation 1 (effective batch 8) of the tiny model, and a
    `--resume` of it. `change(model_dir)`: the run trained a copy of the tiny model in the workspace,
    its inputs recorded in the checkpoint, and `change` alters that copy before the resume."""

    def setup(ws: Path) -> list[str]:
        from finetune.checkpointing import checkpoints
        from finetune.checkpointing.provenance import model_identity

        model, args = os.environ["FINETUNE_TABLE_MODEL"], list(launch)
        if change is not None:
            shutil.copytree(model, ws / "model")
            model = str(ws / "model")
            args.append(f"--model.name_or_path={model}")
        identity = model_identity(type("M", (), {"name_or_path": model, "revision": None})())
        ckpt = ws / "runs" / "prev" / "checkpoint-3"
        for name in (
            "trainer_state.json",
            "latest",
            "rng_state_0.pth",
            "rng_state_1.pth",
            "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ):
            _write(ckpt / name, '{"global_step": 3}')
        _write(ws / "runs" / "prev" / "run.json", '{"summary": {"status": "interrupted", "steps": 4}}')
        run = {
            "world_size": world,
            "strategy": strategy,
            "offload": "none",
            "per_device": 8 // world,
            "grad_accum": 1,
            "effective": 8,
            "method": {"name": "lora", "lora_r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
            "model": {**identity, "config_sha256": model_sha or identity["config_sha256"]},
            "data": {
                "train_rows": 8,
                "fingerprint": fingerprint,
                "seed": 42,
                "data_seed": None,
                "sampling": "random",
                "drop_last": False,
                "packing": False,
            },
        }
        if mesh is not None:
            run["mesh"] = mesh
        cfg = _saved_config(ws, args)
        if change is not None:  # the inputs it was trained on, then one of them changed
            from finetune.checkpointing.provenance import inputs

            run["inputs"] = inputs(cfg, cfg.data.path, cfg.eval.heldout_path)
            change(Path(model))
        checkpoints.write_marker(ckpt, step=3, world_size=world, run=run)
        return ["--run.name=prev", "--resume", f"--training.per_device_train_batch_size={8 // world}", *args]

    return setup


def _saved_config(ws: Path, launch: list[str]) -> None:
    """runs/prev/config.yaml as the earlier run saved it: the recipe the case launches, with the table's
    base overrides (a resume continues this configuration: finetune/checkpointing/resume_config.py)."""
    import yaml

    from finetune.config.recipe import load_recipe

    recipe = launch[launch.index("--recipe") + 1] if "--recipe" in launch else "demo"
    base = [a for a in base_args(ws, Path(os.environ["FINETUNE_TABLE_MODEL"])) if a.startswith("--") and "=" in a]
    given = [a for a in launch if a.startswith("--model.")]
    cfg, _ = load_recipe(recipe, [*base, *given, "--run.name=prev"])
    _write(ws / "runs" / "prev" / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return cfg


def _edit_template(model: Path) -> None:
    """The chat template edited after the run started (a system line added)."""
    template = model / "chat_template.jinja"
    template.write_text("{{ 'You are brief.' }}\n" + template.read_text())


def _other_weights(model: Path) -> None:
    """Other weights saved over the model in place (a re-download, a colleague's fixed copy): config.json unchanged."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, model / "model.safetensors", metadata={"format": "pt"})


ZERO3_CPU = ["--recipe", "zero3", "--config_file", "accelerate_configs/cpu/zero3.yaml"]


def _user_files(folder: Path) -> Path:
    """What a user keeps in a project folder besides the data: notes, a notebook, a figure."""
    _write(folder / "notes.md", "# what I tried\n")
    _write(folder / "analysis.ipynb", '{"cells": []}')
    _write(folder / "figures" / "loss.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    return folder


def _home(ws: Path) -> list[str]:
    """`~` is a home directory of the user's files (HOME set to one inside the workspace)."""
    saved = os.environ.get("HOME")
    os.environ["HOME"] = str(_user_files(ws / "home"))
    _CLEANUPS.append(lambda: os.environ.__setitem__("HOME", saved) if saved else os.environ.pop("HOME", None))
    return ["--run.output_dir=~", "--overwrite"]


def _own_code(ws: Path) -> list[str]:
    """The tiny model whose config.json asks for a model class of its own code (auto_map)."""
    model = shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], ws / "custom-model")
    values = json.loads((model / "config.json").read_text())
    values.update(model_type="my_arch", auto_map={"AutoModelForCausalLM": "modeling_my.MyForCausalLM"})
    _write(model / "config.json", json.dumps(values))
    _write(model / "modeling_my.py", "import os\nos.system('echo ran')\n")
    return [f"--model.name_or_path={model}"]


def _pickled_code(ws: Path) -> list[str]:
    """The tiny model with its weights as a pytorch_model.bin that also pickles a call of os.system."""
    import torch
    from safetensors.torch import load_file

    model = shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], ws / "pickled-model")
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**weights, "extra": _Call()}, model / "pytorch_model.bin")
    return [f"--model.name_or_path={model}"]


class _Call:
    def __reduce__(self):
        return (os.system, ("echo ran",))


def _config_dir(ws: Path, name: str, **values) -> Path:
    """A model directory holding only a config.json: what preflight reads (no weights are loaded)."""
    path = ws / name
    _write(path / "config.json", json.dumps(values))
    return path


def _heads(ws: Path) -> list[str]:
    """The tiny model's config with 5 attention and 5 key/value heads (what sp_size 2 cannot split)."""
    values = json.loads((Path(os.environ["FINETUNE_TABLE_MODEL"]) / "config.json").read_text())
    heads = {"num_attention_heads": 5, "num_key_value_heads": 5, "hidden_size": 80, "head_dim": 16}
    path = _config_dir(ws, "five-heads", **{**values, **heads})
    return [*ZERO3_CPU, f"--model.name_or_path={path}", "--parallel.sp_size=2"]


def _gpt2_like(ws: Path) -> Path:
    return _config_dir(
        ws, "gpt2-like", model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64
    )


def _no_tp_plan(ws: Path) -> list[str]:
    path = _gpt2_like(ws)
    return ["--recipe", "zero2", "--cpu", f"--model.name_or_path={path}", "--method.name=full", "--parallel.tp_size=2"]


CASES = [
    # --- recipe YAML ---
    Case(
        "YAML syntax error (unclosed bracket)",
        "recipe file",
        _recipe("training:\n  max_steps: [3\n"),
        ("my_recipe.yaml", "line 3", "invalid YAML"),
    ),
    Case(
        "recipe file not UTF-8 (latin-1 byte)",
        "recipe file",
        lambda ws: ["--recipe", str(_write(ws / "my_recipe.yaml", "run:\n  name: caf\xe9\n".encode("latin-1")))],
        ("my_recipe.yaml", "not UTF-8"),
    ),
    Case(
        "value not allowed: method.name: qlora2",
        "recipe file",
        _recipe("method:\n  name: qlora2\n"),
        ("method.name", "'qlora2'", "full, lora, qlora"),
    ),
    Case(
        "unknown key: training.max_step",
        "recipe file",
        _recipe("training:\n  max_step: 3\n"),
        ("training.max_step", "unknown key", "max_steps"),
    ),
    Case(
        "unknown section: trainer:",
        "recipe file",
        _recipe("trainer:\n  max_steps: 3\n"),
        ("trainer", "unknown section", "training"),
    ),
    Case(
        "a key given twice (the last would silently win)",
        "recipe file",
        _recipe("training:\n  max_steps: 3\n  learning_rate: 1.0e-4\n  max_steps: 30\n"),
        ("my_recipe.yaml", "line 4", "key 'training.max_steps' is given twice (first at line 2)"),
    ),
    Case(
        "negative max_steps (Trainer would train an epoch instead)",
        "command line",
        lambda ws: ["--training.max_steps=-5"],
        ("training.max_steps", "must be >= 1, or -1", "got -5"),
    ),
    Case(
        "negative max_grad_norm (Trainer would turn clipping off)",
        "command line",
        lambda ws: ["--training.max_grad_norm=-1"],
        ("training.max_grad_norm", "must be >= 0", "got -1"),
    ),
    Case(
        "lora_alpha: 0 (the adapters would change nothing)",
        "command line",
        lambda ws: ["--method.lora_alpha=0"],
        ("method.lora_alpha", "must be > 0", "got 0"),
    ),
    Case(
        "wrong type: data.max_length: long",
        "recipe file",
        _recipe("data:\n  max_length: long\n"),
        ("data.max_length", "integer", "'long'"),
    ),
    Case(
        "lr_scaling: linear without lr_reference_batch_size",
        "recipe file",
        _recipe("training:\n  lr_scaling: linear\n"),
        ("training.lr_scaling", "'linear' needs training.lr_reference_batch_size", "lr_scaling: none"),
    ),
    Case(
        "recipe that does not exist",
        "--recipe",
        lambda ws: ["--recipe", "zero5"],
        ("--recipe 'zero5'", "available", "zero2"),
    ),
    # --- command-line overrides ---
    Case(
        "override without a value: --training.max_steps",
        "command line",
        lambda ws: ["--recipe", "demo", "--training.max_steps"],
        ("--training.max_steps", "missing value"),
    ),
    Case(
        "override without a section: --max_steps=3",
        "command line",
        lambda ws: ["--recipe", "demo", "--max_steps=3"],
        ("--max_steps", "--section.key=value"),
    ),
    Case(
        "override without dashes: training.max_steps=3",
        "command line",
        lambda ws: ["--recipe", "demo", "training.max_steps=3"],
        ("training.max_steps=3", "unexpected argument"),
    ),
    Case(
        "unknown override key: --training.max_stepz=2",
        "command line",
        lambda ws: ["--recipe", "demo", "--training.max_stepz=2"],
        ("training.max_stepz", "unknown key", "max_steps"),
    ),
    Case(
        "override of the wrong type: --data.max_length=abc",
        "command line",
        lambda ws: ["--recipe", "demo", "--data.max_length=abc"],
        ("data.max_length", "integer", "'abc'"),
    ),
    Case(
        "override of the wrong type: --training.learning_rate=fast",
        "command line",
        lambda ws: ["--recipe", "demo", "--training.learning_rate=fast"],
        ("training.learning_rate", "fast"),
    ),
    Case(
        "override with a comment-like tail: --training.max_steps=10 #ten",
        "command line",
        lambda ws: ["--recipe", "demo", "--training.max_steps=10 #ten"],
        ("training.max_steps: expected an integer, got string '10 #ten'",),
    ),
    # --- dataset files ---
    Case(
        "data file missing",
        "data.path",
        lambda ws: [f"--data.path={ws / 'nope.jsonl'}"],
        ("nope.jsonl", "file not found"),
    ),
    Case("data file empty", "data.path", _data(""), ("train.jsonl", "file is empty")),
    Case(
        "data file of only blank lines",
        "data.path",
        _data("\n\n  \n"),
        ("train.jsonl", "file is empty (5 bytes of blank space)"),
    ),
    Case(
        "latin-1 bytes in row 2",
        "data.path",
        _data(_jsonl(GOOD_ROWS[:1]).encode() + '{"instruction": "caf\xe9", "output": "x"}\n'.encode("latin-1")),
        ("train.jsonl row 2", "not valid UTF-8", "0xe9", "UTF-8"),
    ),
    Case("UTF-16 file", "data.path", _data(_jsonl(GOOD_ROWS).encode("utf-16")), ("train.jsonl", "UTF-16", "UTF-8")),
    Case(
        "malformed JSON line (row 2)",
        "data.path",
        _data(_jsonl(GOOD_ROWS[:1]) + '{"instruction": "x", "output": \n'),
        ("train.jsonl row 2", "malformed JSON"),
    ),
    Case(
        "JSON array with a syntax error",
        "data.path",
        _data('[{"instruction": "a", "output": "b"},]', "train.json"),
        ("train.json", "malformed JSON at line 1"),
    ),
    Case(
        "missing field (row 2 has no output)",
        "data.path",
        _data(_jsonl([GOOD_ROWS[0], {"instruction": "x"}])),
        ("train.jsonl row 2", "missing key 'output'", "alpaca rows need instruction, output"),
    ),
    Case(
        "wrong type (output is a number)",
        "data.path",
        _data(_jsonl([{"instruction": "x", "output": 5}])),
        ("train.jsonl row 1", "'output' must be a string, got number"),
    ),
    Case(
        "columns of no known format",
        "data.path",
        _data(_jsonl([{"question": "x", "answer": "y"}])),
        ("train.jsonl", "['answer', 'question']", "rename question to prompt and answer to completion"),
    ),
    Case(
        "every output empty (trains only the end-of-turn token)",
        "data.path",
        _data(_jsonl([{"instruction": "Say nothing.", "output": ""}] * 4)),
        ("train.jsonl", "4 of 4 row(s) have nothing to train on", "end-of-turn", "data.max_empty_target_share"),
    ),
    Case(
        "eval_fraction that leaves nothing to train on",
        "data.eval_fraction",
        lambda ws: [f"--data.path={_write(ws / 'two.jsonl', _jsonl(GOOD_ROWS))}", "--data.eval_fraction=0.9"],
        ("two.jsonl", "eval_fraction=0.9 of 2 usable example(s) leaves nothing to train on"),
    ),
    Case(
        "symbolic link loop as the data file",
        "data.path",
        _link_loop,
        ("a.jsonl", "is a symbolic link loop", "b.jsonl"),
    ),
    Case(
        "named pipe (FIFO) as the data file (read twice it would hang)",
        "data.path",
        _fifo,
        ("train.jsonl.pipe", "is a named pipe (FIFO), not a regular file", "write the data to a file"),
    ),
    Case(
        "folder without data files as the data (a model folder, say)",
        "data.path",
        _shards({"dataset/notes.txt": "x", "dataset/weights.bin": b"\x00"}, "dataset"),
        ("dataset: the folder: no data file (.jsonl, .json, .csv, .parquet, .arrow", "it holds weights.bin"),
    ),
    Case(
        "zstd-compressed data file",
        "data.path",
        _data(b"\x28\xb5\x2f\xfd" + bytes(16)),
        ("train.jsonl", "is zstd-compressed", "zstd -d FILE", "gzip, bzip2 or xz"),
    ),
    Case(
        "glob of shards that matches no file",
        "data.path",
        _shards({"shards/part-0.jsonl": _jsonl(GOOD_ROWS)}, "shards/*.json"),
        ("shards/*.json: no file matches this pattern", "its folder", "holds part-0.jsonl"),
    ),
    Case(
        "folder of the Hub's shards with one missing",
        "data.path",
        _shards(
            {
                "data/train-00000-of-00003.jsonl": _jsonl(GOOD_ROWS),
                "data/train-00002-of-00003.jsonl": _jsonl(GOOD_ROWS),
            },
            "data",
        ),
        ("data: the folder: 1 of the 3 'train' shards are missing (train-00001-of-00003)", "download them again"),
    ),
    Case(
        "glob of shards: one in UTF-16, one with a bad row (both named, by file and row)",
        "data.path",
        _shards(
            {
                "shards/a.jsonl": _jsonl(GOOD_ROWS).encode("utf-16"),
                "shards/b.jsonl": _jsonl([*GOOD_ROWS, {"instruction": "Add 3 and 3."}]),
            },
            "shards/*.jsonl",
        ),
        ("shards/a.jsonl: is UTF-16", "shards/b.jsonl row 3: missing key 'output'"),
    ),
    Case(
        "a key given twice in a row (one of the two values would train silently)",
        "data.path",
        _data('{"instruction": "Add 2 and 3.", "output": "5", "output": "6"}\n' + _jsonl(GOOD_ROWS)),
        ("train.jsonl row 1: the key 'output' appears 2 times in one object", 'values "5" and "6"', "keep one"),
    ),
    Case(
        "a CSV column named twice",
        "data.path",
        _data("instruction,output,output\nAdd 2 and 3.,5,6\n", "train.csv"),
        ("train.csv: the column(s) 'output' at columns 2, 3 appear more than once",),
    ),
    Case(
        "lines that end in CR only (classic Mac OS)",
        "data.path",
        _data(_jsonl(GOOD_ROWS).replace("\n", "\r")),
        ("train.jsonl: its lines end in CR only", "convert them to LF"),
    ),
    Case(
        "the data format changes mid-file (messages rows after alpaca rows)",
        "data.path",
        _data(
            _jsonl(
                [*GOOD_ROWS, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
            )
        ),
        ("train.jsonl row 3: missing key 'instruction'", "has the keys of messages rows", "the format changes here"),
    ),
    Case(
        'rows nested one level down ({"example": {...}})',
        "data.path",
        _data(_jsonl([{"example": r} for r in GOOD_ROWS])),
        ("the rows are nested one level down", "under the key 'example'", "jq -c '.example'"),
    ),
    Case(
        "prepared-data cache location that is a file",
        "data.cache_dir",
        _cache_in_a_file,
        ("the prepared-data cache", "(from data.cache_dir) cannot be used", "cache is a file, not a folder"),
    ),
    Case(
        "every row longer than max_length (completion cut off)",
        "data.path",
        lambda ws: [
            f"--data.path={_write(ws / 'long.jsonl', _jsonl([{'instruction': 'word ' * 400, 'output': 'x'}] * 2))}",
            "--data.max_length=32",
        ],
        ("long.jsonl", "no example has a trained token within max_length=32"),
        entry="train.py",
    ),
    Case(
        "own data with the demo recipe's exact-match evaluation on",
        "eval.heldout_path",
        lambda ws: ["--eval.exact_match=true"],
        ("eval.heldout_path: 'demo'", "good.jsonl", "--eval.exact_match=false", "--eval.heldout_path=FILE"),
    ),
    Case(
        "held-out file missing",
        "eval.heldout_path",
        lambda ws: ["--eval.exact_match=true", f"--eval.heldout_path={ws / 'heldout.jsonl'}"],
        ("eval.heldout_path", "heldout.jsonl", "file not found"),
    ),
    Case(
        "held-out rows exact match cannot read (messages), evaluated only after training",
        "eval.heldout_path",
        lambda ws: [
            "--eval.exact_match=true",
            "--eval.before=false",
            f"--eval.heldout_path={_write(ws / 'heldout.jsonl', _jsonl([{'messages': [{'role': 'user', 'content': 'a'}]}]))}",
        ],
        ("eval.heldout_path", "heldout.jsonl row 1", "exact-match rows need instruction/output or prompt/completion"),
    ),
    # --- accelerate configs ---
    Case(
        "accelerate config missing",
        "--config_file",
        lambda ws: ["--recipe", "demo", "--config_file", str(ws / "no.yaml")],
        ("no.yaml", "not found", "--config_file"),
    ),
    Case(
        "accelerate config: bad YAML",
        "--config_file",
        _accelerate("distributed_type: [DEEPSPEED\n"),
        ("launch.yaml", "line 2", "invalid YAML"),
    ),
    Case(
        "accelerate config: unknown distributed_type",
        "--config_file",
        _accelerate("distributed_type: MULTI_TPU\nnum_processes: 2\n"),
        ("launch.yaml", "distributed_type 'MULTI_TPU'", "allowed", "DEEPSPEED"),
    ),
    Case(
        "accelerate config: a key given twice",
        "--config_file",
        _accelerate("distributed_type: DEEPSPEED\nnum_processes: 2\nnum_processes: 4\n"),
        ("launch.yaml", "line 3", "key 'num_processes' is given twice (first at line 2)"),
    ),
    Case(
        "accelerate config: DeepSpeed and FSDP at once",
        "--config_file",
        _accelerate(
            "distributed_type: FSDP\nnum_processes: 2\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
            "deepspeed_config:\n  deepspeed_config_file: ds_configs/zero2.json\n",
            recipe="fsdp",
        ),
        ("launch.yaml", "distributed_type FSDP", "deepspeed_config section"),
    ),
    Case(
        "GPU config on a machine without a GPU",
        "--config_file",
        lambda ws: ["--recipe", "zero2", "--config_file", str(REPO / "accelerate_configs" / "zero2.yaml")],
        ("zero2.yaml", "no CUDA GPU is visible", "--cpu"),
        gpu_free_only=True,
    ),
    # --- DeepSpeed configs ---
    Case("DeepSpeed config missing", "deepspeed_config_file", _accelerate(CPU_DS), ("ds.json", "file not found")),
    Case(
        "DeepSpeed config: bad JSON",
        "deepspeed_config_file",
        _accelerate(CPU_DS, ds='{"zero_optimization": {"stage": 2,}}'),
        ("ds.json", "invalid JSON at line 1"),
    ),
    Case(
        "DeepSpeed config: a key given twice",
        "deepspeed_config_file",
        _accelerate(CPU_DS, ds='{"zero_optimization": {"stage": 2, "stage": 3}}'),
        ("ds.json", "key(s) 'stage' given twice in one object"),
    ),
    Case(
        "DeepSpeed values that fight Trainer's",
        "deepspeed_config_file",
        _accelerate(CPU_DS, ds=json.dumps({**AUTO_DS, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.5})),
        ("ds.json", "train_micro_batch_size_per_gpu is 16", "gradient_clipping is 0.5", '"auto"'),
    ),
    Case(
        "DeepSpeed stage differs from the recipe",
        "deepspeed_config_file",
        _accelerate(CPU_DS, ds=json.dumps({**AUTO_DS, "zero_optimization": {"stage": 3}})),
        ("meant for strategy 'zero2'", "sets up 'zero3'", "accelerate_configs/cpu/zero2.yaml"),
    ),
    Case(
        "DeepSpeed offload differs from the recipe",
        "deepspeed_config_file",
        _accelerate(
            CPU_DS,
            ds=json.dumps({**AUTO_DS, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
        ),
        ("offload 'none'", "sets up 'zero2' with offload 'optimizer'"),
    ),
    # --- method and precision against the launch ---
    Case(
        "QLoRA with uint8 storage under ZeRO-3",
        "method.quant_storage",
        lambda ws: ["--recipe", "zero3", "--cpu", "--method.name=qlora", "--method.quant_storage=uint8"],
        ("method.quant_storage: 'uint8' under zero3", "quant_storage: auto"),
    ),
    Case(
        "bf16 set directly instead of the precision policy",
        "training.bf16",
        lambda ws: ["--training.bf16=true"],
        ("training.bf16", "set by training.precision", "--training.precision=bf16-mixed"),
    ),
    Case(
        "16-mixed (fp16) on CPU",
        "training.precision",
        lambda ws: ["--training.precision=16-mixed"],
        ("training.precision 16-mixed on CPU", "bf16-mixed", "32-true"),
        gpu_free_only=True,
    ),
    Case(
        "bf16-true with ZeRO offload",
        "training.precision",
        lambda ws: ["--recipe", "zero2_offload", "--cpu", "--training.precision=bf16-true"],
        ("training.precision bf16-true with zero2 offload 'optimizer'", "bf16-mixed with offload", "without offload"),
    ),
    Case(
        "model.dtype contradicting the precision policy",
        "model.dtype",
        lambda ws: ["--training.precision=bf16-mixed", "--model.dtype=float32"],
        ("model.dtype: 'float32'", "training.precision bf16-mixed", "model.dtype: auto"),
    ),
    # --- the parallel mesh (docs/parallelism.md) ---
    Case(
        "pipeline parallelism asked for",
        "parallel.pp_size",
        lambda ws: ["--parallel.pp_size=2"],
        ("parallel.pp_size: 2", "Trainer has no pipeline schedule", "Megatron", "torchtitan", "parallel.pp_size: 1"),
    ),
    Case(
        "sequence-parallel size that does not divide the world size",
        "parallel.sp_size",
        lambda ws: [*ZERO3_CPU, "--parallel.sp_size=3", "--data.max_length=96"],
        ("sp_size 3 x tp_size 1 x cp_size 1 = 3 does not divide the world size 2", "launch 3 or 6 or 12 processes"),
    ),
    Case(
        "sequence length not divisible by sp_size",
        "data.max_length",
        lambda ws: [*ZERO3_CPU, "--parallel.sp_size=2", "--data.max_length=129"],
        ("data.max_length 129 is not divisible by sp_size = 2", "128 or 130"),
    ),
    Case(
        "sequence length not divisible by 2 x cp_size",
        "data.max_length",
        lambda ws: ["--recipe", "fsdp", "--cpu", "--parallel.cp_size=2", "--data.max_length=130"],
        ("data.max_length 130 is not divisible by 2 x cp_size = 4", "128 or 132"),
    ),
    Case(
        "attention heads not divisible by sp_size",
        "parallel.sp_size / model",
        _heads,
        (
            "has 5 attention heads and 5 key/value heads",
            "sp_size must divide 5",
            "allowed here: none on 2 processes (keep it at 1; 5 runs on a multiple of 5 processes)",
        ),
    ),
    Case(
        "sequence parallelism under DDP",
        "parallel.sp_size / run.strategy",
        lambda ws: ["--recipe", "ddp", "--cpu", "--parallel.sp_size=2"],
        ("parallel.sp_size 2 needs strategy zero1 or zero2 or zero3", "sets up ddp", "recipe zero3_sp"),
    ),
    Case(
        "sequence parallelism under FSDP",
        "parallel.sp_size / run.strategy",
        lambda ws: ["--recipe", "fsdp", "--cpu", "--parallel.sp_size=2"],
        ("parallel.sp_size 2 needs strategy zero1 or zero2 or zero3", "sets up fsdp", "Ulysses"),
    ),
    Case(
        "sequence and context parallelism together",
        "parallel.sp_size / cp_size",
        lambda ws: [*ZERO3_CPU, "--parallel.sp_size=2", "--parallel.cp_size=2"],
        ("sp_size 2 and parallel.cp_size 2", "cannot be combined"),
    ),
    Case(
        "sequence parallelism with packing",
        "data.packing",
        lambda ws: [*ZERO3_CPU, "--parallel.sp_size=2", "--data.packing=true"],
        ("data.packing: true with parallel.sp_size > 1", "attends causally over the whole row", "data.packing: false"),
    ),
    Case(
        "context parallelism under DeepSpeed",
        "parallel.cp_size / run.strategy",
        lambda ws: [*ZERO3_CPU, "--parallel.cp_size=2"],
        ("parallel.cp_size 2 needs strategy fsdp", "sets up zero3", "parallel.sp_size under DeepSpeed"),
    ),
    Case(
        "context parallelism on CPU",
        "parallel.cp_size",
        lambda ws: ["--recipe", "fsdp", "--cpu", "--parallel.cp_size=2"],
        ("parallel.cp_size 2", "runs on CUDA devices only", "use parallel.sp_size 2 instead"),
        gpu_free_only=True,
    ),
    Case(
        "tensor parallelism with QLoRA",
        "parallel.tp_size / method.name",
        lambda ws: ["--recipe", "zero2", "--cpu", "--parallel.tp_size=2", "--method.name=qlora"],
        ("method.name 'qlora' with parallel.tp_size 2", "not sharded with them", "method.name: full"),
    ),
    Case(
        "tensor parallelism under ZeRO-3",
        "parallel.tp_size / run.strategy",
        lambda ws: [*ZERO3_CPU, "--parallel.tp_size=2", "--method.name=full"],
        ("parallel.tp_size 2 needs strategy zero1 or zero2", "sets up zero3", "recipe zero2_tp"),
    ),
    Case(
        "tensor parallelism for a model without a tp plan",
        "parallel.tp_size / model",
        _no_tp_plan,
        ("gpt2-like (GPT2Config, model_type 'gpt2') has no tensor-parallel plan", "base_model_tp_plan", "sp_size"),
    ),
    Case(
        "auto micro-batch for a model the planner has no arithmetic for",
        "training.per_device_train_batch_size",
        lambda ws: [
            f"--model.name_or_path={_gpt2_like(ws)}",
            "--training.per_device_train_batch_size=auto",
        ],
        ("training.per_device_train_batch_size: auto needs the planner", "no activation arithmetic", "'gpt2'"),
        entry="train.py",
    ),
    Case(
        "auto for a training field that takes a number only",
        "training.gradient_accumulation_steps",
        lambda ws: ["--training.gradient_accumulation_steps=auto"],
        ("training.gradient_accumulation_steps", "expected an integer", "'auto'"),
    ),
    Case(
        "DeepSpeed config's autotp_size contradicting parallel.tp_size",
        "DeepSpeed config / parallel.tp_size",
        lambda ws: [
            *_accelerate(CPU_DS, ds=json.dumps({**AUTO_DS, "tensor_parallel": {"autotp_size": 4}}))(ws),
            "--parallel.tp_size=2",
            "--method.name=full",
        ],
        ("tensor_parallel.autotp_size is 4 but parallel.tp_size is 2", "--parallel.tp_size=4"),
    ),
    # --- model and tokenizer ---
    Case(
        "model directory that does not exist",
        "model.name_or_path",
        lambda ws: [f"--model.name_or_path={ws / 'my-model'}"],
        ("model.name_or_path", "my-model", "no such local directory"),
    ),
    Case(
        "directory that is not a model",
        "model.name_or_path",
        lambda ws: [f"--model.name_or_path={ws}"],
        ("model.name_or_path", "no config.json"),
    ),
    Case(
        "encoder-only model (BERT)",
        "model.name_or_path",
        _model_config(_bert),
        ("model_type 'bert' (BertForMaskedLM) is an encoder", "sees every position", "MODEL_FOR_CAUSAL_LM_MAPPING"),
    ),
    Case(
        "encoder-decoder model (BART)",
        "model.name_or_path",
        _model_config(_bart),
        ("model_type 'bart'", "encoder-decoder (seq2seq)", "MODEL_FOR_CAUSAL_LM_MAPPING"),
    ),
    Case(
        "model.safetensors cut short (a copy that did not finish)",
        "model.name_or_path",
        _truncated_weights,
        ("half-copied-model/model.safetensors", "cut short (truncated)", "copy or download the model again"),
    ),
    Case(
        "model folder with a cut generation_config.json (transformers would ignore it without a word)",
        "model.name_or_path",
        _broken_model_file("generation_config.json"),
        ("model-with-a-cut-file/generation_config.json: not valid JSON (line", "copy or download the model again"),
    ),
    Case(
        "model folder saved without its tokenizer",
        "model.name_or_path",
        _no_tokenizer,
        ("model-without-tokenizer: no tokenizer file", "model.tokenizer_name_or_path"),
    ),
    Case(
        "blank data path (an unset shell variable: --data.path=$DATA)",
        "override",
        lambda ws: ["--data.path="],
        ("data.path: '' is blank; it is required",),
    ),
    Case(
        "model folder with a cut tokenizer_config.json",
        "model.name_or_path",
        _broken_model_file("tokenizer_config.json"),
        ("model-with-a-cut-file/tokenizer_config.json: not valid JSON (line", "copy or download the model again"),
    ),
    Case(
        "model folder asking for its own code (auto_map) without model.trust_remote_code",
        "model.name_or_path",
        _own_code,
        ("custom-model/config.json: its auto_map asks for", "modeling_my.py", "--model.trust_remote_code=true"),
    ),
    Case(
        "model weights only as a pickle that names code (pytorch_model.bin calling os.system)",
        "model.name_or_path",
        _pickled_code,
        ("pickled-model/pytorch_model.bin: a pickle that names code", "posix.system", "model.safetensors"),
        entry="train.py",
    ),
    Case(
        "embedding smaller than the tokenizer's vocabulary",
        "model.name_or_path (and its tokenizer)",
        _small_embedding,
        ("small-vocab-model", "embedding has 1,000 rows", "IndexError", "model.tokenizer_name_or_path"),
        entry="train.py",
    ),
    Case(
        "hub id not cached, hub unreachable",
        "model.name_or_path",
        lambda ws: ["--model.name_or_path=someorg/not-cached-model"],
        ("someorg/not-cached-model", "not in the Hugging Face cache", "cannot be reached", "hf download"),
        # HF_HUB_OFFLINE off whatever the environment says: set, the message is the offline one (the next case)
        env={"ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": False},
    ),
    Case(
        "hub id not cached, HF_HUB_OFFLINE=1",
        "model.name_or_path",
        lambda ws: ["--model.name_or_path=someorg/not-cached-model"],
        ("someorg/not-cached-model", "HF_HUB_OFFLINE", "(HF_HUB_CACHE, else HF_HOME/hub)", "hf download"),
        env={"HF_HUB_OFFLINE": True},
    ),
    Case(
        "unknown bundled model",
        "model.name_or_path",
        lambda ws: ["--model.name_or_path=bundled:Llama-9000"],
        ("bundled:Llama-9000", "bundled:SmolLM2-135M-Instruct"),
    ),
    Case(
        "tokenizer without a chat template, recipe asks for it",
        "model (tokenizer)",
        _no_chat_template,
        ("has no chat template", "data.chat_template: false"),
        entry="train.py",
    ),
    # --- --resume of a checkpoint that cannot continue under this launch (docs/faults.md) ---
    Case(
        "resume under another strategy family (ZeRO-3 checkpoint, FSDP launch)",
        "--resume",
        _resume(["--recipe", "fsdp", "--config_file", "accelerate_configs/cpu/fsdp.yaml"]),
        (
            "checkpoint-3 was written by zero3 (2 rank(s)); this launch sets up fsdp",
            "launch with accelerate_configs/zero3.yaml (any --num_processes)",
            "nothing was loaded",
        ),
    ),
    Case(
        "resume under another mesh (sequence-parallel checkpoint, no sequence parallelism now)",
        "--resume / parallel.sp_size",
        _resume(ZERO3_CPU, mesh={"sp": 2, "tp": 1, "cp": 1}),
        (
            "checkpoint-3 was written under the mesh sp 2 x tp 1 x cp 1 on 2 rank(s)",
            "resume with --num_processes 2 --parallel.sp_size=2 --parallel.tp_size=1 --parallel.cp_size=1",
        ),
    ),
    Case(
        "resume on a process count that cannot keep the effective batch",
        "--resume / --num_processes",
        _resume([*ZERO3_CPU, "--num_processes", "3"]),
        (
            "effective batch 8 = 2 rank(s) x 4 per device x accumulation 1",
            "3 process(es) x 4 per device cannot make 8",
            "--num_processes 1 or 2",
        ),
    ),
    Case(
        "resume with an accumulation that contradicts the effective batch",
        "--resume / training",
        _resume([*ZERO3_CPU, "--num_processes", "1", "--training.gradient_accumulation_steps=1"]),
        ("--training.gradient_accumulation_steps=1 contradicts", "recomputed, here 2"),
    ),
    Case(
        "resume with another model",
        "--resume / model.name_or_path",
        _resume(ZERO3_CPU, model_sha="0" * 64),
        ("checkpoint-3 was trained with another model", "config_sha256"),
    ),
    Case(
        "resume after the chat template was edited",
        "--resume / the model's chat template",
        _resume([], strategy="single", world=1, change=_edit_template),
        ("checkpoint-3 was trained on other inputs: the chat template changed", "chat_template.jinja differs"),
        entry="train.py",
    ),
    Case(
        "resume after the base weights were replaced in place (same config.json, other weights)",
        "--resume / the model's weights",
        _resume(ZERO3_CPU, change=_other_weights),
        ("checkpoint-3 was trained on other inputs: the base weights changed", "model.safetensors differs"),
    ),
    Case(
        "resume on another process count with dataloader_drop_last",
        "--resume / training",
        _resume([*ZERO3_CPU, "--num_processes", "1", "--training.dataloader_drop_last=true", "--allow-config-change"]),
        ("training.dataloader_drop_last: true", "the layout changes (2 -> 1 process(es))"),
    ),
    Case(
        "resume with an override that differs from the run's saved configuration",
        "--resume / overrides",
        _resume([*ZERO3_CPU, "--training.seed=7", "--eval.exact_match=true"]),
        (
            "training.seed: 42 in the run, 7 given",
            "eval.exact_match: False in the run, True given",
            "runs/prev/config.yaml",
            "--allow-config-change",
        ),
    ),
    Case(
        "resume with another seed, the change allowed",
        "--resume / training.seed",
        _resume([*ZERO3_CPU, "--training.seed=7", "--allow-config-change"]),
        ("training.seed is 7 but checkpoint-3 was trained with 42", "--training.seed=42"),
    ),
    Case(
        "resume on other training data (the rows differ)",
        "--resume / data.path",
        _resume([], strategy="single", world=1, fingerprint="0" * 64),
        ("the training data differs from the data it was trained on", "fingerprint 000000000000"),
        entry="train.py",
    ),
    # --- the run directory ---
    Case(
        "output directory on a read-only filesystem",
        "run.output_dir",
        _read_only,
        ("ro/run cannot be written", "nothing was started", "--run.output_dir"),
    ),
    Case(
        "output directory on a read-only filesystem (train.py)",
        "run.output_dir",
        _read_only,
        ("creating run directory", "ro/run", "--run.output_dir"),
        entry="train.py",
    ),
    Case(
        "disk full when the run starts",
        "run.output_dir",
        _full_disk,
        ("writing run.json and config.yaml", "disk/run", "no space left on device", "free of"),
        entry="train.py",
        needs_root=True,
    ),
    Case(
        "run name of a run that is still training",
        "run.name",
        _held("keep", lambda ws: ["--run.name=keep"]),
        ("runs/keep is in use by a live run: pid", "nothing was changed", "kill -TERM"),
    ),
    Case(
        "--resume of a run that is still training",
        "--resume",
        _held("prev", _resume(ZERO3_CPU)),
        ("runs/prev is in use by a live run: pid", "nothing was changed"),
    ),
    Case(
        "--resume of a run that is still training (train.py)",
        "--resume",
        _held("prev", _resume([], strategy="single", world=1)),
        ("runs/prev is in use by a live run: pid", "nothing was changed"),
        entry="train.py",
    ),
    Case(
        "--overwrite into the user's own folder (the data, notes, a notebook, an earlier run)",
        "run.output_dir",
        lambda ws: [f"--run.output_dir={_user_files(ws)}", "--overwrite"],
        ("already exists and is not one finetune made", "nothing was changed", "--run.name=NAME", "or empty folder"),
    ),
    Case(
        "--overwrite into the user's own folder (train.py)",
        "run.output_dir",
        lambda ws: [f"--run.output_dir={_user_files(ws)}", "--overwrite"],
        ("already exists and is not one finetune made", "nothing was changed", "--run.name=NAME"),
        entry="train.py",
    ),
    Case(
        "--run.output_dir=. --overwrite (the working directory)",
        "run.output_dir",
        lambda ws: ["--run.output_dir=.", "--overwrite"],
        ("run directory . (", ") already exists and is not one finetune made", "good.jsonl", "nothing was changed"),
    ),
    Case(
        "--run.output_dir=~ --overwrite (the home directory)",
        "run.output_dir",
        _home,
        ("home) already exists and is not one finetune made", "nothing was changed"),
    ),
    Case(
        "--run.output_dir=runs --overwrite (the folder holding the runs)",
        "run.output_dir",
        lambda ws: ["--run.output_dir=runs", "--overwrite"],
        ("run directory runs (", "/runs) already exists and is not one finetune made", "it holds keep/"),
    ),
    Case(
        "--overwrite of a run whose demo data is the data.path of the new run",
        "run.name / data.path",
        lambda ws: [
            "--run.name=keep",
            "--overwrite",
            f"--data.path={_write(ws / 'runs' / 'keep' / 'data' / 'train.jsonl', _jsonl(GOOD_ROWS))}",
        ],
        ("--overwrite would delete", "runs/keep/data, which holds data.path", "nothing was changed"),
    ),
    Case(
        "run name with a path separator: ../../escape",
        "run.name",
        lambda ws: ["--run.name=../../escape"],
        ("run.name: '../../escape' contains a path separator", "run.output_dir"),
    ),
    Case(
        "absolute path as the run name",
        "run.name",
        lambda ws: [f"--run.name={ws / 'elsewhere'}"],
        ("contains a path separator (an absolute path)", "run.output_dir"),
    ),
    Case(
        "--resume of a folder finetune did not make",
        "--resume / run.output_dir",
        lambda ws: [
            f"--run.output_dir={_write(_user_files(ws / 'mine') / 'config.yaml', 'my: own').parent}",
            "--resume",
        ],
        ("mine is not a run directory finetune made", "nothing was changed"),
    ),
    Case(
        "run name of an existing run, no --overwrite",
        "run.name",
        lambda ws: ["--run.name=keep"],
        ("runs/keep already exists", "--run.name=keep-2", "--overwrite"),
    ),
    Case(
        "run name of an existing run, no --overwrite (train.py)",
        "run.name",
        lambda ws: ["--run.name=keep"],
        ("runs/keep already exists", "--run.name=keep-2", "--overwrite"),
        entry="train.py",
    ),
    # `finetune export` (finetune/export/command.py): the arguments are the case's own (a run it made up, or none)
    Case(
        "a folder that is not a run",
        "RUN",
        lambda ws: [str(_user_files(ws / "mine"))],
        ("mine: not a run directory", ".finetune-run"),
        entry="finetune export",
    ),
    Case(
        "a checkpoint folder given as the run",
        "RUN",
        lambda ws: [str(_a_run(ws, "lora", checkpoint=2) / "checkpoint-2")],
        ("checkpoint-2: checkpoint 2 of the run", "runs/made --checkpoint 2`"),
        entry="finetune export",
    ),
    Case(
        "the run's model/ given as the run",
        "RUN",
        lambda ws: [str(_a_run(ws, "lora") / "model")],
        ("model: inside the run", "export the run's model/ with `finetune export", "runs/made`"),
        entry="finetune export",
    ),
    Case(
        "a run folder that does not exist",
        "RUN",
        lambda ws: [str(ws / "runs" / "typo")],
        ("runs/typo: no such folder", "the directory finetune train made"),
        entry="finetune export",
    ),
    Case(
        "a run still running (its model/ not written yet, RUN/export its own)",
        "RUN",
        _held("made", lambda ws: [str(_a_run(ws, "lora", checkpoint=2))]),
        ("runs/made: a live run is writing it (pid", "now: checkpoint-2", "--checkpoint N --out DIR`"),
        entry="finetune export",
    ),
    Case(
        "a run still running, exported into itself",
        "--out",
        _held("made", lambda ws: [str(_a_run(ws, "lora", checkpoint=2)), "--checkpoint", "2"]),
        ("runs/made: a live run is writing it (pid", "to a folder outside the run", "nothing was changed"),
        entry="finetune export",
    ),
    Case(
        "a checkpoint without its completion marker (a save cut short)",
        "--checkpoint",
        lambda ws: [str(_a_run(ws, "lora", checkpoint=2, complete=False)), "--checkpoint", "2"],
        ("--checkpoint 2", "checkpoint-2 is not complete", "no finetune-checkpoint-complete.json"),
        entry="finetune export",
    ),
    Case(
        "a checkpoint that does not exist",
        "--checkpoint",
        lambda ws: [str(_a_run(ws, "lora", checkpoint=2)), "--checkpoint", "9"],
        ("--checkpoint 9", "checkpoint-9 does not exist", "checkpoints of this run: checkpoint-2"),
        entry="finetune export",
    ),
    Case(
        "a run that failed before writing model/ and before any complete checkpoint",
        "RUN",
        lambda ws: [str(_without_model(_a_run(ws, "lora", checkpoint=2, complete=False), "failed"))],
        ("model/ does not exist (run.json summary.status: failed", "no checkpoint is complete (checkpoint-2: no "),
        entry="finetune export",
    ),
    Case(
        "--merge of a full fine-tune",
        "--merge",
        lambda ws: [str(_a_run(ws, "full")), "--merge"],
        ("--merge", "is a full fine-tune (method.name: full)", "export it without --merge"),
        entry="finetune export",
    ),
    Case(
        "an output folder that is not an export (the user's earlier run)",
        "--out",
        lambda ws: [str(_a_run(ws, "lora")), "--out", str(ws / "runs" / "keep")],
        ("--out", "runs/keep: exists and was not made by finetune export", "nothing was changed"),
        entry="finetune export",
    ),
    Case(
        "the base model moved or deleted since the run",
        "model.name_or_path",
        lambda ws: [str(_a_run(ws, "lora", model=str(_model_copy(ws)))), "--merge", *_gone(ws / "base")],
        ("model.name_or_path", "config.yaml): the base model the run trained on is not on this machine", "link"),
        entry="finetune export",
    ),
    Case(
        "the base weights replaced in place since an adapter was trained on them",
        "model.name_or_path",
        lambda ws: [str(_a_run(ws, "lora", model=str(_model_copy(ws)))), "--merge", *_replaced(ws / "base")],
        ("the base weights changed", "model.safetensors differs", "Put the base weights it was trained with back"),
        entry="finetune export",
    ),
    Case(
        "an output folder inside the run's model/ or a checkpoint",
        "--out",
        lambda ws: [str(_a_run(ws, "lora", checkpoint=2)), "--out", str(ws / "runs" / "made" / "checkpoint-2" / "e")],
        ("--out", "runs/made/checkpoint-2, which the run wrote", "nothing was changed"),
        entry="finetune export",
    ),
    Case(
        "an output folder under a file",
        "--out",
        lambda ws: [str(_a_run(ws, "lora")), "--out", str(_write(ws / "a-file", "x") / "export")],
        ("--out", "a-file is a file, not a folder", "nothing was changed"),
        entry="finetune export",
    ),
    Case(
        "an output folder on a disk without room",
        "--out",
        lambda ws: [str(_a_run(ws, "lora")), "--merge", "--out", str(_tmpfs(ws / "small", "size=64k") / "export")],
        ("--out", "not enough space", "the export needs", "are free; nothing was written"),
        entry="finetune export",
        needs_root=True,
    ),
]

# Inputs that are not errors by design, and problems only a real multi-process launch shows: named
# here with the test that covers them, so the table is complete.
NOT_ERRORS = [
    (
        "data kept as shards: a glob (`shards/*.jsonl`) or a folder of .jsonl, .json, .csv, .parquet or .arrow "
        "files, the Hub's `train-00000-of-00010` names (data.split's shards)",
        "data.path",
        (
            "not an error: read in name order by preflight and the run alike, each shard's rows named by file and "
            "row (tests/data/test_data_as_kept.py::test_a_folder_and_a_glob_of_shards_are_read_in_name_order)"
        ),
    ),
    (
        "a model family without SDPA attention in transformers (BLOOM, GPT-Neo, MPT, ...)",
        "model.name_or_path",
        (
            "not an error: trained with eager attention, said in the start line and run.json "
            "speed.attention.fallback (tests/modeling/test_model_families.py::"
            "test_a_family_without_sdpa_trains_with_eager_attention_and_says_so)"
        ),
    ),
    (
        "a prepared-data cache entry damaged, cut short or partly deleted",
        "data.cache_dir",
        (
            "not an error: said and prepared again (tests/data/test_cache_heals.py::"
            "test_a_damaged_or_partly_deleted_entry_is_said_and_prepared_again)"
        ),
    ),
    (
        "data files as users save them: a JSON array (pretty-printed or not) in a .jsonl file, a first row over "
        "1 MiB, a UTF-8 byte-order mark, CRLF line ends, trailing blank lines, gzip/bzip2/xz compression (by "
        "name, .jsonl.gz, or by content)",
        "data.path",
        (
            "not an error: read by preflight and the run alike (tests/data/test_data_files.py::"
            "test_files_a_careful_reader_accepts_are_read_by_preflight_and_the_run)"
        ),
    ),
    (
        "`~` in data.path, eval.heldout_path, data.cache_dir, run.output_dir, model paths",
        "recipe file, command line",
        (
            "not an error: expanded to the home directory when the configuration is built "
            "(tests/data/test_data_files.py::test_tilde_in_data_and_heldout_paths_is_expanded)"
        ),
    ),
    (
        "data file without read permission (or in a directory that cannot be searched)",
        "data.path",
        (
            "exit 2: 'permission denied: mode -rw-------, owner uid 0, and this process runs as uid 65534; make it "
            "readable (chmod a+r FILE) ...' (tests/data/test_data_files.py::"
            "test_permission_denied_is_named_with_mode_and_owner; the table runs as root, which reads every file)"
        ),
    ),
    (
        "some rows with every target empty, at most data.max_empty_target_share (0.5) of them",
        "data.path",
        (
            "not an error: trained, named in a warning and listed in run.json data.empty_target_rows "
            "(tests/data/test_data_files.py::test_rows_with_nothing_to_train_on_are_refused_above_the_share_and_"
            "named_below)"
        ),
    ),
    (
        "a checkpoint file damaged in place (same size), then --resume",
        "--resume",
        (
            "not an error: the checkpoint fails its checksum, is skipped with a warning naming the file, set aside as "
            "checkpoint-K.superseded-<n>, and the newest intact one is resumed from (tests/training/"
            "test_wrong_results.py::test_an_error_after_training_saves_the_weights_first_and_a_damaged_checkpoint_"
            "is_passed_over; docs/faults.md)"
        ),
    ),
    (
        "a learning rate that collapses the model (gradient norm exactly 0, loss ln(vocabulary))",
        "training.learning_rate",
        (
            "found while training: stopped after training.collapse_windows (3) log windows, run.json failed, exit 3 "
            "(tests/training/test_wrong_results.py::test_a_learning_rate_that_collapses_the_model_ends_failed_not_"
            "completed; docs/faults.md)"
        ),
    ),
    (
        "one row longer than data.max_length among normal rows",
        "data.path",
        (
            "not an error: the example is cut to max_length, counted in run.json data.truncated and logged as a "
            "warning; one left with no trained token is dropped (tests/data/test_data.py::"
            "test_truncation_is_counted_and_label_less_examples_dropped)"
        ),
    ),
    (
        "bad rows with data.on_bad_rows: skip",
        "data.path",
        (
            "not an error: the rows are skipped, logged and listed in run.json data.rows_skipped; all rows bad is an "
            "error (tests/data/test_data.py::test_skip_still_raises_when_every_row_is_bad)"
        ),
    ),
    (
        "recipe without a training: section",
        "recipe file",
        (
            "not an error: the training defaults apply as with an empty section (tests/config/test_config.py::"
            "test_a_recipe_without_a_training_section_gets_the_training_defaults)"
        ),
    ),
    (
        "run name of a run that failed before its first step (no checkpoint, nothing but run.json, config.yaml, data/)",
        "run.name",
        (
            "not an error: the directory is reused and the console says so: 'reusing run directory ...: its run "
            "failed before its first step (...)' (tests/launch/test_rundir.py::"
            "test_a_run_that_failed_before_step_1_leaves_a_directory_the_retry_reuses)"
        ),
    ),
    (
        "run name with spaces, `#`, `:`, quotes or unicode (`--run.name=keep #2`)",
        "run.name",
        (
            "not an error: a name is what was typed (runs/keep #2; YAML read `keep #2` as `keep`, another run), "
            "and config.yaml reads it back on --resume (tests/config/test_config.py::"
            "test_a_valid_run_name_with_spaces_hashes_colons_or_unicode_survives_save_and_resume)"
        ),
    ),
    (
        "--overwrite of a run directory holding a file the user put there",
        "run.name",
        (
            "not an error: the run's own files (run.json, config.yaml, checkpoints, model/, its demo data) are removed, "
            "the user's kept and named (tests/launch/test_rundir.py::"
            "test_overwrite_removes_what_a_run_wrote_and_keeps_the_users_files)"
        ),
    ),
    (
        "--resume of a run that completed",
        "--resume",
        (
            "not an error: exit 0, 'the run in ... completed (step N); there is nothing to resume and nothing was "
            "changed', every file the same (tests/training/test_run_safety.py)"
        ),
    ),
    (
        "--resume with run.json half-written (a crash while it was written)",
        "--resume",
        (
            "not an error: the file is named, kept as run.damaged<n>.json, and the run resumes from its newest complete "
            "checkpoint (tests/training/test_run_safety.py)"
        ),
    ),
    (
        "`finetune compare` with an unreadable run.json among readable runs",
        "finetune compare",
        (
            "not an error while two runs are readable: they are compared, each unreadable one named with its problem "
            "(a warning, and in the report); exit 2 with fewer (tests/compare/test_compare_columns.py::"
            "test_unreadable_runs_are_named_and_the_readable_ones_compared)"
        ),
    ),
    (
        "one process with two GPUs visible (accelerate config with distributed_type NO and gpu_ids: all)",
        "accelerate config / CUDA_VISIBLE_DEVICES",
        (
            "preflight refuses it, exit 2: 'one process (distributed type NO) with 2 CUDA devices visible ... Trainer would "
            "wrap the model in torch.nn.DataParallel ... Pin one device: CUDA_VISIBLE_DEVICES=0 ... or train on all of them "
            "with DDP' (needs two GPUs; tests/preflight/test_preflight.py::"
            "test_one_process_with_two_visible_gpus_is_refused_before_dataparallel makes two visible)"
        ),
    ),
    (
        "2-process GPU launch on a machine without a GPU, straight through accelerate launch",
        "accelerate launch",
        (
            "each rank exits 2: 'the launcher started 2 processes but Accelerate set up 1 ... would train alone' "
            "(tests/training/test_strategies.py::test_fsdp_without_cpu_opt_in_is_refused_not_downgraded)"
        ),
    ),
    (
        "one-machine accelerate config (num_machines: 1) launched on each node of a 2-node SLURM job step",
        "accelerate config num_machines",
        (
            "each node's rank exits 2 before any weights load: 'this SLURM job step runs on 2 nodes "
            "(SLURM_STEP_NUM_NODES) but the launch formed 1 machine(s) ... each node would train alone. Launch with "
            "--num_machines 2 --machine_rank $SLURM_NODEID ...' (tests/multinode/test_two_nodes.py::"
            "test_a_config_for_one_machine_on_a_two_node_step_is_refused)"
        ),
    ),
    (
        "--machine_rank 1 with num_machines 1",
        "accelerate launch",
        (
            "each rank exits 2: '--machine_rank 1 is machine 2 of a multi-machine run, but the launch formed 1 "
            "machine(s) ... Give every machine's launch --num_machines 2' (tests/preflight/test_machines.py::"
            "test_a_machine_rank_beyond_the_machines_formed_is_refused)"
        ),
    ),
    (
        "recipe zero3 launched with the DDP config, straight through accelerate launch",
        "accelerate launch",
        (
            "each rank exits 2 before the run directory exists: 'recipe 'zero3' is meant for strategy 'zero3' ... sets up "
            "'ddp'' (tests/training/test_strategies.py::test_mismatched_launch_stops_before_training)"
        ),
    ),
    (
        "a strategy recipe launched without an accelerate config (`accelerate launch finetune/train.py --recipe zero2`, "
        "torchrun, python)",
        "accelerate launch",
        (
            "not an error: the recipe sets up its strategy in the script with the processes the launcher gave; run.json "
            "strategy.set_up_by is `recipe` (tests/training/test_strategies.py::"
            "test_plain_accelerate_launch_engages_the_recipes_strategy_at_world_size_one)"
        ),
    ),
    (
        "a strategy recipe under the user's accelerate default config of another strategy",
        "accelerate launch",
        (
            "each rank exits 2: '... but your accelerate default config <path> (read by every `accelerate launch` without "
            "--config_file or --cpu) sets up 'ddp' ...', with the --config_file line and how to move the default config "
            "aside (tests/preflight/test_preflight.py::test_a_launcher_deepspeed_setup_that_differs_is_refused_naming_the_"
            "default_config)"
        ),
    ),
    (
        "`accelerate launch --num_processes 2` without GPUs or a config file",
        "accelerate launch",
        (
            "the rank exits 2: 'accelerate launch --num_processes 2 started 1 process(es) ...' with the torchrun line "
            "(tests/preflight/test_preflight.py::test_accelerate_launch_num_processes_that_started_one_process_is_refused)"
        ),
    ),
]


# Faults during a launch (docs/faults.md), each provoked by a launched test as a user would.
NOT_ERRORS += [
    (
        "SIGTERM to `finetune train` (docker stop: PID 1; Kubernetes; `kill PID`; `timeout`)",
        "signal",
        (
            "not an error: one line, relayed to every rank once; they stop after the step with one complete "
            "checkpoint, exit 75, run.json `interrupted` (tests/training/test_interrupts.py::"
            "test_docker_stop_sigterm_to_finetune_train_as_pid_1_checkpoints_and_exits_75)"
        ),
    ),
    (
        "Ctrl-C, twice, through `| tee`, two ranks",
        "signal / console",
        (
            "not an error: exit 75 through the pipe, checkpoint complete although the console died and the second "
            "Ctrl-C came during the save (tests/training/test_interrupts.py::"
            "test_ctrl_c_twice_through_tee_on_two_ranks_keeps_one_whole_checkpoint)"
        ),
    ),
    (
        "SIGHUP (terminal closed, ssh dropped) while the model loads",
        "signal",
        (
            "not an error: the ranks stop before training (nothing to save), exit 75, run.json `interrupted`; the "
            "same command reuses the directory (tests/training/test_interrupts.py::"
            "test_sighup_while_the_model_loads_stops_before_training_and_the_directory_is_reusable)"
        ),
    ),
    (
        "SIGTERM to the rank alone (`kill` of train.py) during the final evaluation",
        "signal",
        (
            "not an error: a complete checkpoint of the final step, exit 75; --resume trains no step more, evaluates "
            "and exports (tests/training/test_interrupts.py::"
            "test_sigterm_during_the_final_evaluation_checkpoints_the_last_step_and_resume_only_evaluates)"
        ),
    ),
    (
        "two runs started at once with the same --run.name",
        "run.name",
        (
            "exactly one gets the run directory's lock; the other exits 2 naming it (tests/launch/test_run_lock.py::"
            "test_of_runs_claiming_one_new_directory_at_once_exactly_one_wins)"
        ),
    ),
    (
        "disk full while a checkpoint is written (a real tmpfs; ENOSPC on one of two ranks)",
        "run.output_dir",
        (
            "exit 2: 'writing checkpoint .../checkpoint-2 [on rank(s) [1]] failed: no space left on device (...; "
            "0.2 MiB free of 64.0 MiB on its filesystem). The incomplete checkpoint-2 was removed; the newest "
            "complete checkpoint is .../checkpoint-1: free space, then continue with --resume'; run.json `failed` "
            "with it (tests/training/test_run_dir_faults.py)"
        ),
    ),
    (
        "a rank stopped with SIGSTOP (stalled)",
        "process",
        (
            "exit 1 after training.ddp_timeout: 'rank 1 stopped making progress: its last heartbeat came 31 s "
            "before the others failed ...', the rank that timed out named as a consequence; run.json names it too "
            "(tests/training/test_faults.py::test_a_stopped_rank_is_named_as_the_one_that_stalled)"
        ),
    ),
    (
        "SIGUSR1 (SLURM `--signal=USR1@N`: every process; `B:USR1`: the batch shell, then `finetune train`)",
        "signal",
        (
            "not an error: a stop like SIGTERM (training.stop_signals): one complete checkpoint, exit 75, run.json "
            "`interrupted` (tests/training/test_interrupts.py::test_sigusr1_as_slurm_sends_it_checkpoints_and_exits_75)"
        ),
    ),
    (
        "SIGTERM while a 60,000-row data file is built",
        "signal",
        (
            "not an error: the build ends at its next row on every rank, exit 75 before training, run.json "
            "`interrupted` (tests/training/test_interrupts.py::test_sigterm_during_the_build_of_60000_rows_stops_the_build)"
        ),
    ),
    (
        "a failure on one rank after training (the export, the evaluation, exact match, the record)",
        "process",
        (
            "exit 1 on every rank, agreed before any enters another collective: the trained weights saved (the export, "
            "or a complete checkpoint of the final step), the failed rank and its error named (tests/training/"
            "test_agreement.py)"
        ),
    ),
    (
        "a rank held in a collective after training",
        "process",
        (
            "exit 1 after training.finish_timeout without progress: 'stuck: rank 0 made no progress in the evaluation "
            "...', what each rank waits in named, run.json `failed` with it and the newest complete checkpoint "
            "(tests/training/test_faults.py::test_a_rank_held_in_a_collective_after_training_is_ended_by_the_watchdog)"
        ),
    ),
]


def _a_run(
    ws: Path, method: str, *, checkpoint: int | None = None, complete: bool = True, model: str | None = None
) -> Path:
    """runs/made (a new name: the user's runs/keep stays as it was) as a 2-step run of the demo recipe on the table's
    model leaves it: config.yaml, run.json, the marker, the demo data, model/ (a LoRA adapter, or the full weights)
    and checkpoint-N with model/'s files (and its completion marker when `complete`)."""
    from finetune import fingerprints
    from finetune.checkpointing import checkpoints, provenance
    from finetune.config.recipe import dump_yaml, load_recipe
    from finetune.data import demo
    from finetune.modeling.load import load_model, load_tokenizer

    run = ws / "runs" / "made"
    model = model or os.environ["FINETUNE_TABLE_MODEL"]
    cfg, _ = load_recipe("demo", [f"--model.name_or_path={model}", f"--method.name={method}", "--run.name=made"])
    _write(run / "config.yaml", dump_yaml(cfg.to_dict()))
    inputs = provenance.weights_of(fingerprints.Cache(ws / "fingerprints.json"), Path(model))
    _write(run / "run.json", json.dumps({"summary": {"status": "completed", "steps": 2}, "inputs": inputs}))
    _write(run / ".finetune-run", "")
    demo.write_demo(run / "data", 16, 0)
    load_model(cfg.model, cfg.method).save_pretrained(run / "model")
    load_tokenizer(cfg.model).save_pretrained(run / "model")
    if checkpoint is not None:
        shutil.copytree(run / "model", run / f"checkpoint-{checkpoint}")
        if complete:
            checkpoints.write_marker(run / f"checkpoint-{checkpoint}", step=checkpoint, world_size=1)
    return run


def _without_model(run: Path, status: str) -> Path:
    """The run as one that ended `status` before its end wrote model/."""
    shutil.rmtree(run / "model")
    record = json.loads((run / "run.json").read_text())
    record["summary"]["status"] = status
    _write(run / "run.json", json.dumps(record))
    return run


def _model_copy(ws: Path) -> Path:
    """A copy of the table's model as the base of a run (ws/base), for cases that move it or change it."""
    return Path(shutil.copytree(os.environ["FINETUNE_TABLE_MODEL"], ws / "base"))


def _gone(model: Path) -> list[str]:
    """The base deleted (or moved away) after the run."""
    shutil.rmtree(model)
    return []


def _replaced(model: Path) -> list[str]:
    """The base's weights rewritten in place (one tensor scaled) after the run recorded their fingerprint."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] * 2
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return []


def base_args(ws: Path, model_dir: Path) -> list[str]:
    """A run that would be valid: the demo recipe on the tiny model and a good data file."""
    data = _write(ws / "good.jsonl", _jsonl(GOOD_ROWS * 4))
    return [
        "--recipe",
        "demo",
        f"--model.name_or_path={model_dir}",
        f"--data.path={data}",
        "--eval.exact_match=false",
        "--training.max_steps=1",
        "--run.name=new-run",
    ]


def make_workspace(ws: Path) -> None:
    """What the user already has: an earlier run with results, a recipe of their own, data."""
    _write(ws / "runs" / "keep" / "run.json", '{"summary": {"status": "completed", "train_loss": 1.23}}')
    _write(ws / "runs" / "keep" / "config.yaml", "run:\n  name: keep\n")
    _write(ws / "runs" / "keep" / "model" / "adapter_model.safetensors", b"\x00weights\x01" * 100)
    _write(ws / "my_data.jsonl", _jsonl(GOOD_ROWS))


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@contextlib.contextmanager
def _patched(ws: Path, env: dict):
    """cwd = the workspace, accelerate launch recorded instead of run, os.environ and
    huggingface_hub constants restored afterwards."""
    from huggingface_hub import constants

    from finetune.launch import accelerate as launcher

    launched: list = []
    saved_env, saved_cwd, saved_launch = dict(os.environ), os.getcwd(), launcher.run_accelerate_launch
    saved_constants = {k: getattr(constants, k) for k in env}
    os.chdir(ws)
    launcher.run_accelerate_launch = lambda args: launched.append(args) or 0
    for k, v in env.items():
        setattr(constants, k, v)
    try:
        yield launched
    finally:
        os.chdir(saved_cwd)
        launcher.run_accelerate_launch = saved_launch
        for k, v in saved_constants.items():
            setattr(constants, k, v)
        os.environ.clear()
        os.environ.update(saved_env)


def run_case(case: Case, ws: Path, model_dir: Path, *, keep: bool = False) -> Outcome:
    """Run one case; what its setup made (mounts, holders) is undone afterwards unless `keep`
    (then call cleanup())."""
    try:
        return _run_case(case, ws, model_dir)
    finally:
        if not keep:
            cleanup()


def _run_case(case: Case, ws: Path, model_dir: Path) -> Outcome:
    from finetune.cli import dispatch
    from finetune.training import run

    ws.mkdir(parents=True, exist_ok=True)
    os.environ["FINETUNE_TABLE_MODEL"] = str(model_dir)  # for setups that copy the model
    make_workspace(ws)
    try:
        argv = (base_args(ws, model_dir) if case.entry != "finetune export" else []) + case.setup(ws)
    finally:
        del os.environ["FINETUNE_TABLE_MODEL"]
    before = _hashes(ws)
    err = io.StringIO()
    code, tb = None, False
    with _patched(ws, case.env) as launched, contextlib.redirect_stderr(err):
        try:
            if case.entry == "train.py":
                code = run.main(argv)
            else:
                code = dispatch.main([case.entry.split()[1], *argv])
        except SystemExit as e:
            code = e.code
        except Exception:  # a bug: the table shows it as a traceback  # noqa: BLE001
            import traceback

            traceback.print_exc(file=err)
            tb = True
    after = _hashes(ws)
    changed = [f for f, h in before.items() if after.get(f) != h]
    created = sorted({str(Path(f).parent) for f in after if f not in before})
    text = err.getvalue()
    message = text[text.rfind("error: ") :] if "error: " in text else text[-2000:]
    return Outcome(code, message.strip(), bool(launched), changed, created, tb or "Traceback" in text)


def _clean(message: str, ws: Path, model_dir: Path) -> str:
    import re
    import socket

    from huggingface_hub import constants

    message = message.replace(constants.HF_HUB_CACHE, "<hf-cache>")  # this machine's Hugging Face cache
    message = re.sub(r"pid \d+", "pid <pid>", message.replace(socket.gethostname(), "<host>"))
    message = re.sub(r"kill -TERM \d+", "kill -TERM <pid>", message)
    message = re.sub(r"started \S+ \(.*?\); nothing", "started <time> (<command>); nothing", message)
    message = re.sub(r"started \d{4}-\d\d-\d\dT[\d:+-]+\)", "started <time>)", message)
    message = re.sub(r"\d+\.\d+ (MiB|GiB) free of \d+\.\d+ (MiB|GiB)", "<free> free of <size>", message)
    return (
        message.replace(str(ws), "<ws>")
        .replace(str(model_dir), "<tiny-model>")
        .replace(str(REPO), "<repo>")
        .removeprefix("error: ")
    )


def markdown(results: list[tuple[Case, Outcome]], ws_of, model_dir: Path) -> str:
    lines = [
        "# Bad inputs and what finetune says",
        "",
        "Generated by `python -m tests.cli.bad_inputs_table > docs/bad_inputs.md` (the cases live in",
        "tests/cli/bad_inputs_table.py; tests/cli/test_bad_inputs.py checks each row: exit code 2, the message",
        "names what and where, no traceback, and no file the user had changed: SHA-256 of every file in",
        "the workspace before and after, including an earlier run directory `runs/keep/`).",
        "`<ws>` is the user's working directory, `<tiny-model>` a local model directory.",
        "",
        "Caught by: `finetune train` = in `finetune train` before `accelerate launch` starts; `train.py` =",
        "inside the launched process (preflight runs there too, before the run directory and any weights);",
        "`finetune export` = before it writes anything (its cases export a run they make up, `runs/made`).",
        "`new files` are what the failed attempt itself wrote (its own new run directory, with run.json",
        "status `failed`); never inside an existing run directory.",
        "",
        "| input | where | caught by | exit | user's files changed | new files | message |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, out in results:
        msg = _clean(out.message, ws_of(case), model_dir).replace("|", "\\|").replace("\n", "<br>")
        changed = ", ".join(out.changed) or "none"
        created = ", ".join(f"{d}/" for d in out.created) or "none"
        lines.append(f"| {case.what} | {case.where} | {case.entry} | {out.exit_code} | {changed} | {created} | {msg} |")
    lines += [
        "",
        "## Not errors by design, and cases shown by real launches",
        "",
        "| input | where | behaviour |",
        "|---|---|---|",
    ]
    lines += [f"| {what} | {where} | {how} |" for what, where, how in NOT_ERRORS]
    return "\n".join(lines) + "\n"


def main() -> int:
    import contextlib
    import logging
    import tempfile

    # stdout is the document: what libraries print (DeepSpeed logs its accelerator to stdout) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        import torch
        from transformers import AutoTokenizer

        from finetune.modeling.bundled import ensure_bundled_model, save_tiny_llama

        logging.getLogger().addHandler(logging.NullHandler())  # keep train.py's log setup off the captured stderr
        root = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
        model_dir = save_tiny_llama(root / "tiny-model", AutoTokenizer.from_pretrained(ensure_bundled_model()))
        cases = [
            c
            for c in CASES
            if not (c.gpu_free_only and torch.cuda.is_available()) and not (c.needs_root and os.geteuid())
        ]
        results = [(case, run_case(case, root / f"case{i}", model_dir)) for i, case in enumerate(cases)]
    index = {id(c): i for i, c in enumerate(cases)}
    sys.stdout.write(markdown(results, lambda c: root / f"case{index[id(c)]}", model_dir))
    shutil.rmtree(root, ignore_errors=True)
    bad = [c.what for c, o in results if o.exit_code != 2 or o.launched or o.changed or o.traceback]
    if bad:
        print(f"cases that did not fail cleanly: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
