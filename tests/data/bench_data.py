"""The data benchmark of docs/benchmarks.md "Data preparation": generated chat rows prepared by this
project (1 process cold and cached, 2 ranks of one machine), by the code of another checkout
(--before, e.g. a worktree of an older commit) and by TRL's SFTTrainer, each in its own process:
seconds until the datasets are ready (and since the process started) and peak RSS (the process, and its largest child: the map's
processes).

    python -m tests.data.bench_data --rows 100000 --out /tmp/bench-data [--before /tmp/ref] [--trl]
    [--only ranks2,cached,trl,first-step] [--reuse-cache DIR]  (a subset, in that order; "cached" and
    "first-step", a real training run to its first step, read the first cold run's cache or DIR)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which have not but they all "
    "can their more one will has about if would there what so we when been up out into some time than them "
    "model data train function value system result example answer question number method process language"
).split()


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """Chat rows: 1-4 user/assistant exchanges (1 + a Poisson(0.9) count), words per turn log-normal:
    user median 20 (sigma 0.9), assistant median 45 (sigma 0.8), capped at 1,500; a system turn in
    one row in five. About 1 KB and 190 tokens a row, as the 100,000-row file (98 MB, 19M tokens)
    the issue measured; not fitted to a published chat set (no network here)."""
    rng = random.Random(seed)

    def text(median: float, sigma: float) -> str:
        n = min(1500, max(1, round(math.exp(rng.gauss(math.log(median), sigma)))))
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with path.open("w") as f:
        for _ in range(rows):
            messages = [{"role": "system", "content": text(8, 0.5)}] if rng.random() < 0.2 else []
            exchanges = 1
            while exchanges < 4 and rng.random() < 0.45:
                exchanges += 1
            for _ in range(exchanges):
                messages += [
                    {"role": "user", "content": text(20, 0.9)},
                    {"role": "assistant", "content": text(45, 0.8)},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")


def worker(side: str, data: str, cache: str, max_length: int) -> dict:
    start = time.monotonic()
    model = str(
        Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache/finetune") / "models/SmolLM2-135M-Instruct"
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    # Every side holds the model, as a rank does while it trains (SFTTrainer needs it); loaded before
    # the clock: only the data is timed.
    loaded = AutoModelForCausalLM.from_pretrained(model)
    sampler = RssSampler()
    if side == "trl":
        import datasets
        from trl import SFTConfig, SFTTrainer

        clock = time.monotonic()
        ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
        args = SFTConfig(output_dir=cache + "/out", max_length=max_length, report_to=[], use_cpu=True)
        rows = len(SFTTrainer(model=loaded, args=args, train_dataset=ds, processing_class=tokenizer).train_dataset)
    else:
        from finetune.config.sections import DataConfig
        from finetune.data.build import build_datasets

        cfg = DataConfig(path=data, max_length=max_length, cache_dir=cache)  # each checkout's defaults
        clock = time.monotonic()
        rows = len(build_datasets(cfg, tokenizer, seed=0).train)
    data_s = time.monotonic() - clock
    sampler.stop()
    del loaded
    return {
        "side": side,
        "local_rank": os.environ.get("LOCAL_RANK", "0"),
        "data_seconds": round(data_s, 1),  # reading and preparing the data
        "process_seconds": round(time.monotonic() - start, 1),  # + imports and the tokenizer
        "rows": rows,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "children_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
        # sampled every 0.2 s: private memory, and pages of mapped files (Arrow), which count in RSS
        # but are the page cache's to drop
        "peak_rss_anon_mb": sampler.peak["RssAnon"] // 1024,
        "peak_rss_file_mb": sampler.peak["RssFile"] // 1024,
    }


class RssSampler:
    """Peaks of /proc/self/status RssAnon and RssFile (kB), sampled by a thread."""

    def __init__(self):
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]))
            if self._done.wait(0.2):
                return

    def stop(self):
        self._done.set()
        self._thread.join()


def run(side: str, data: Path, cache: Path, max_length: int, pythonpath: str, ranks: int = 1) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", side, "--data", str(data)]
    cmd += ["--cache", str(cache), "--max-length", str(max_length)]
    procs = []
    for rank in range(ranks):
        env = os.environ | {"PYTHONPATH": pythonpath}
        if ranks > 1:  # as a launcher sets them (TRL's Accelerate would set up torch.distributed with them)
            env |= {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ranks)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, cwd=pythonpath, text=True))
    out = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    for line in out:
        print(json.dumps(line), flush=True)
    return out


def first_step(data: Path, cache: Path, max_length: int, here: str, ranks: int, out: Path) -> dict:
    """Seconds from the launch to the first optimizer step's line ("step 1/1 |"), a real training run:
    the demo recipe (1 process) or the ddp recipe (2 processes over gloo, torchrun), on the file, with
    the entry an earlier run left in `cache` (the log must say "prepared data found"); exact match
    off, else its before-training evaluation would come first. Each rank's peak RSS from run.json."""
    run_dir = out / f"first-step-{ranks}-{time.time_ns()}"
    if ranks == 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
        cmd += ["finetune/train.py", "--recipe", "demo"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        cmd += ["finetune/train.py", "--recipe", "ddp"]
    cmd += [f"--data.path={data}", f"--data.max_length={max_length}", f"--data.cache_dir={cache}"]
    cmd += ["--training.max_steps=1", "--training.logging_steps=1", "--eval.exact_match=false"]
    cmd += [f"--run.output_dir={run_dir}"]
    env = os.environ | {"PYTHONPATH": here, "PYTHONUNBUFFERED": "1", "FINETUNE_CPU_DISTRIBUTED": str(int(ranks > 1))}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds, log = None, []
    for line in proc.stdout:
        log.append(line)
        if seconds is None and "step 1/1 |" in line:
            seconds = round(time.monotonic() - start, 1)
    text = "".join(log)
    if proc.wait() != 0 or seconds is None or "prepared data found" not in text:
        sys.exit(
            f"the first-step run with {ranks} process(es) did not reuse the entry or did not step:\n{text[-3000:]}"
        )
    record = json.loads((run_dir / "run.json").read_text())
    return {
        "side": "ours, first step",
        "ranks": ranks,
        "first_step_seconds": seconds,  # launch to the step line, imports and the model load included
        "host_peak_rss_gib": [r["host_peak_rss_gib"] for r in record["memory"]["per_rank"]],
        "run_dir": str(run_dir),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--out", type=Path, default=Path("/tmp/bench-data"))
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--before", help="a checkout of older code, measured on the same file")
    p.add_argument("--trl", action="store_true", help="also TRL's SFTTrainer preparation")
    p.add_argument("--only", help="comma-separated subset of cold,cached,ranks2,before,trl,first-step")
    p.add_argument("--reuse-cache", type=Path, help="a cache folder an earlier cold run of this file left")
    p.add_argument("--worker")
    p.add_argument("--data")
    p.add_argument("--cache")
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.data, a.cache, a.max_length)))
        return
    wanted = (
        a.only.split(",") if a.only else ["cold", "cached", "ranks2"] + ["before"] * bool(a.before) + ["trl"] * a.trl
    )
    unknown = set(wanted) - {"cold", "cached", "ranks2", "before", "trl", "first-step"}
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; allowed: cold, cached, ranks2, before, trl, first-step")
    for name in ("cached", "first-step"):
        if name in wanted and not a.reuse_cache and not {"cold", "ranks2"} & set(wanted[: wanted.index(name)]):
            p.error(f"--only: {name} needs cold or ranks2 before it, or --reuse-cache")
    if "before" in wanted and not a.before:
        p.error("--only before needs --before CHECKOUT")
    a.out.mkdir(parents=True, exist_ok=True)
    data = a.out / f"chat-{a.rows}.jsonl"
    if not data.exists():
        generate(data, a.rows)
    here = str(Path(__file__).resolve().parents[2])
    results = {"rows": a.rows, "bytes": data.stat().st_size, "load_before": os.getloadavg()[0], "runs": []}
    stamp = str(time.time_ns())
    cold = a.reuse_cache  # the cache folder of the first cold run of ours, which "cached" reads again
    for name in wanted:
        if name in ("cold", "ranks2"):
            ranks = 2 if name == "ranks2" else 1
            cache = a.out / f"cache-{ranks}-{stamp}"
            cold = cold or cache
            results["runs"] += run("ours", data, cache, a.max_length, here, ranks=ranks)
        elif name == "cached":
            results["runs"] += run("ours", data, cold, a.max_length, here)
            results["runs"] += run("ours", data, cold, a.max_length, here, ranks=2)
        elif name == "before":
            results["runs"] += run("before", data, a.out / f"cache-b-{stamp}", a.max_length, a.before)
        elif name == "first-step":
            for ranks in (1, 2):
                results["runs"].append(first_step(data, cold, a.max_length, here, ranks, a.out))
                print(json.dumps(results["runs"][-1]), flush=True)
        else:
            results["runs"] += run("trl", data, a.out / f"cache-trl-{stamp}", a.max_length, here)
    results["load_after"] = os.getloadavg()[0]
    (a.out / f"results-{a.rows}.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
