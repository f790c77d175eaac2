"""Task evaluation: exact match of greedy generations against reference answers, the prompt rendered exactly as in
training (docs/run_record.md `eval`). Under several processes each rank generates a shard and the counts are summed.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from finetune.data.formats import prompt_and_answer
from finetune.launch import peers


def render_prompts(
    tokenizer, rows: list[dict], *, system_prompt: str | None, use_chat_template: bool, source: str
) -> tuple[list[str], list[str]]:
    prompts, answers = [], []
    for i, row in enumerate(rows, start=1):
        text, answer = prompt_and_answer(row, f"{source} row {i}")
        if use_chat_template:
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": text})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(text)
        answers.append(answer)
    return prompts, answers


@torch.no_grad()
def exact_match(
    model,
    tokenizer,
    rows: list[dict],
    *,
    system_prompt: str | None,
    use_chat_template: bool,
    max_new_tokens: int,
    batch_size: int,
    source: str,
    watch: peers.Watch,
    accelerator=None,
) -> dict:
    """{'exact_match': fraction, 'correct', 'total', 'per_task': {...}, 'examples': [...]}; `watch`: the run's."""
    from tqdm.auto import tqdm

    prompts, answers = render_prompts(
        tokenizer, rows, system_prompt=system_prompt, use_chat_template=use_chat_template, source=source
    )
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    # Every rank runs the same number of batches: sharded models (ZeRO-3, FSDP) need all ranks
    # in every forward pass, so generate() also runs with synced_gpus when world > 1.
    per_rank = math.ceil(len(prompts) / world)
    mine = list(range(rank * per_rank, min(len(prompts), (rank + 1) * per_rank)))
    n_batches = math.ceil(per_rank / batch_size)
    was_training = model.training
    model.eval()
    old_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # decoder-only: pad on the left
    device = next(model.parameters()).device
    generated: dict[int, str] = {}
    try:
        for b in tqdm(range(n_batches), desc="exact match", disable=rank != 0):
            idx = mine[b * batch_size : (b + 1) * batch_size] or mine[:1] or [0]  # pad idle ranks
            batch = tokenizer(
                [prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=world > 1,
            )
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            for i, text in zip(idx, texts):
                if i in mine:
                    generated[i] = text
            watch.progress()  # a batch done: the watchdog's limit counts from here
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    correct = Counter()
    total = Counter()
    examples = []
    for i, text in generated.items():
        task = rows[i].get("task", "all")
        ok = text.strip() == answers[i].strip()
        correct[task] += ok
        total[task] += 1
        if len(examples) < 5:
            examples.append(
                {
                    "prompt": prompt_and_answer(rows[i], source)[0],
                    "expected": answers[i],
                    "generated": text.strip(),
                    "correct": ok,
                }
            )
    tasks = sorted(set(r.get("task", "all") for r in rows))
    counts = torch.tensor([[correct[t], total[t]] for t in tasks], dtype=torch.long)
    if world > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    c, n = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    return {
        "exact_match": c / n if n else 0.0,
        "correct": c,
        "total": n,
        "per_task": {t: int(counts[k, 0]) / max(1, int(counts[k, 1])) for k, t in enumerate(tasks)},
        "examples": examples,
    }


def section(results: dict[str, dict], heldout_path: str) -> dict:
    """run.json `eval`: exact match before and after training (each stage's `exact_match` result)."""
    return {
        "metric": "exact_match",
        "heldout_path": heldout_path,
        **{f"exact_match_{stage}": r["exact_match"] for stage, r in results.items()},
        "details": results,
    }
