"""What each strategy run proves, read from its run.json: the strategy and precision that engaged,
its per-step losses against the single-process run, and the planner's predicted peak beside the
measured one. Pure functions of the records. The tolerances and their derivations: docs/doctor.md.
"""

from __future__ import annotations

import math

from finetune import precision, strategies
from finetune.compare import comparable
from finetune.doctor import report
from finetune.telemetry.record import RecordView

S = report.Section("strategies")
TOLERANCES = {
    "32-true": {"loss": 1e-5, "grad_norm": 1e-4, "source": "tests/training/test_strategies.py"},
    "bf16-mixed": {"loss": 1e-4, "grad_norm": 5e-3, "source": "tests/training/test_precision_equivalence.py"},
}
SHARD_SLACK = 0.2  # a rank's share of sharded elements may differ from 1/W by this fraction (padding, uneven dims)
# Named when losses disagree: what `finetune compare` requires of comparable runs (model, data, precision
# policy, effective batch, applied LR: finetune/compare/comparable.py) and the clipping all doctor runs share.
CLIPPING = ("config", "training", "max_grad_norm")


def expected_evidence(row: strategies.Strategy) -> dict:
    """strategy.evidence values the live engine must show for a strategy row, from the strategy table
    itself (finetune/strategies.py); the clipping is what the doctor's runs pin (runs.common_args)."""
    if row.zero_stage is not None:
        want = {
            "engine_class": "DeepSpeedEngine",
            "zero_stage": row.zero_stage,
            "offload_optimizer_device": "cpu" if row.offload_optimizer else "none",
            "offload_param_device": "cpu" if row.offload_params else "none",
            "optimizer_offloaded": row.offload_optimizer,
            "gradient_clipping": 1.0,
        }
        if row.offload_optimizer:
            want["basic_optimizer_class"] = "DeepSpeedCPUAdam"
        if row.zero_stage == 3:
            want["params_offloaded"] = row.offload_params
        return want
    if row.fsdp is not None:
        return {
            "fsdp_offload_policy": "CPUOffloadPolicy" if row.fsdp.offload_params else "OffloadPolicy",
            "fsdp_modules>=": 3,
        }  # the root and one unit per decoder layer (2 layers)
    if row.replicates:
        return {"engine_class": "DistributedDataParallel"}
    return {"fsdp_modules": 0, "zero_stage": None}


def engaged(record: dict, row: strategies.Strategy, world: int, policy: str) -> tuple[list[str], str]:
    """(mismatches, one-line description) of what engaged, against the row, world size and policy."""
    s, p = record.get("strategy") or {}, record.get("precision") or {}
    ev = s.get("evidence") or {}
    wrong = []
    for key, want in {"name": row.name, "offload": row.offload, "world_size": world}.items():
        if s.get(key) != want:
            wrong.append(f"strategy.{key} is {s.get(key)!r}, expected {want!r}")
    if ev.get("world_size") != world:
        wrong.append(f"strategy.evidence.world_size is {ev.get('world_size')!r} (torch.distributed), expected {world}")
    for key, want in expected_evidence(row).items():
        if key.endswith(">="):
            if not (ev.get(key[:-2]) or 0) >= want:
                wrong.append(f"strategy.evidence.{key[:-2]} is {ev.get(key[:-2])!r}, expected >= {want}")
        elif ev.get(key) != want:
            wrong.append(f"strategy.evidence.{key} is {ev.get(key)!r}, expected {want!r}")
    if row.shards_params:
        fraction, want = ev.get("local_param_fraction"), 1 / world
        if fraction is None or abs(fraction - want) > SHARD_SLACK * want:
            wrong.append(
                f"strategy.evidence.local_param_fraction is {fraction!r}: each of {world} rank(s) should hold "
                f"about {want:.2f} of the sharded parameters"
            )
    if row.fsdp is not None and not (ev.get("dtensor_params") == ev.get("params") and (ev.get("params") or 0) > 0):
        wrong.append(
            f"strategy.evidence: {ev.get('dtensor_params')} of {ev.get('params')} parameters are DTensors "
            f"(FSDP2 shards all)"
        )
    policy_row = precision.get(policy)
    if p.get("policy") != policy:
        wrong.append(f"precision.policy is {p.get('policy')!r}, expected {policy!r}")
    elif p.get("observed_compute_dtype") != policy_row.compute_dtype:
        wrong.append(
            f"precision.observed_compute_dtype is {p.get('observed_compute_dtype')!r} in step 1, expected "
            f"{policy_row.compute_dtype!r}"
        )
    return wrong, describe(ev)


def describe(ev: dict) -> str:
    """What engaged, in a few words: the engine and what it shards or offloads."""
    engine = ev.get("engine_class")
    if ev.get("zero_stage") is not None:
        parts = [f"{engine} ZeRO-{ev['zero_stage']}"]
        if ev.get("optimizer_offloaded"):
            parts.append(f"optimizer on {ev.get('offload_optimizer_device')} ({ev.get('basic_optimizer_class')})")
        if ev.get("params_offloaded"):
            parts.append(f"params on {ev.get('offload_param_device')}")
    elif ev.get("fsdp_modules"):
        parts = [
            f"FSDP2 {ev['fsdp_modules']} units, {ev.get('dtensor_params')}/{ev.get('params')} DTensor "
            f"{ev.get('placements', '')}".rstrip()
        ]
        if ev.get("fsdp_offload_policy") == "CPUOffloadPolicy":
            parts.append("CPUOffloadPolicy")
    else:
        parts = [str(engine)]
    if ev.get("local_param_fraction") is not None:
        parts.append(f"{ev['local_param_fraction']:.0%} of params/rank")
    return ", ".join(parts)


def precision_text(p: dict) -> str:
    return f"{p.get('policy')} ({p.get('observed_compute_dtype')} seen)"


def losses(record: dict) -> list[dict]:
    return [s for s in record.get("steps") or [] if s.get("loss") is not None]


def compare(ref: dict, rec: dict, steps: int) -> dict:
    """The largest relative differences of `rec` against the reference, step by step, and what the
    two records hold differently among the settings that must be the same (`differences`)."""
    a, b = losses(ref), losses(rec)
    out = {
        "steps": [s["step"] for s in b],
        "loss": [s["loss"] for s in b],
        "max_loss_rel": None,
        "worst_step": None,
        "max_grad_norm_rel": None,
        "token_mismatch": [],
        "differs": differences(ref, rec),
    }
    if [s["step"] for s in a] != list(range(1, steps + 1)) or [s["step"] for s in b] != list(range(1, steps + 1)):
        out["missing_steps"] = True
        return out
    rel = [_finite(abs(x["loss"] - y["loss"]) / abs(x["loss"])) for x, y in zip(a, b)]
    grads = [
        _finite(abs(x["grad_norm"] - y["grad_norm"]) / abs(x["grad_norm"]))
        for x, y in zip(a, b)
        if x.get("grad_norm") and y.get("grad_norm") is not None
    ]
    out.update(
        loss_rel=rel,
        max_loss_rel=max(rel),
        worst_step=rel.index(max(rel)) + 1,
        max_grad_norm_rel=max(grads) if grads else None,
        token_mismatch=[
            x["step"]
            for x, y in zip(a, b)
            if (x["trained_tokens"], x["input_tokens"]) != (y["trained_tokens"], y["input_tokens"])
        ],
    )
    return out


def _finite(value: float) -> float:
    """NaN (a non-finite loss on one side) as infinitely different: it never passes a tolerance."""
    return value if math.isfinite(value) else math.inf


def differences(ref: dict, rec: dict) -> list[str]:
    """What `rec` holds differently from `ref` ("lr.applied 0.002 != 0.001"), as `finetune compare` says it."""
    mine, theirs = RecordView(rec), RecordView(ref)
    out = comparable.differences(mine, theirs)
    if mine.get(*CLIPPING) != theirs.get(*CLIPPING):
        out.append(f"{'.'.join(CLIPPING)} {mine.get(*CLIPPING)!r} != {theirs.get(*CLIPPING)!r}")
    return out


def agreement_line(
    name: str, cmp: dict, policy: str, run_dirs: tuple[str, str], overrides: list[str] = ()
) -> report.Line:
    """The loss comparison's verdict; `run_dirs`: (reference, this run)."""
    ref_name = strategies.one_process().key  # the reference every run is compared with
    tol = TOLERANCES.get(policy)
    data = {k: v for k, v in cmp.items() if k != "loss"}
    if cmp.get("missing_steps"):
        return S.problem(
            f"{name} losses",
            f"the records do not both log steps 1..N (got {cmp['steps']})",
            "rerun the doctor; if it repeats, compare the two run.json files' steps",
            **data,
        )
    if tol is None:
        return S.skipped(
            f"{name} losses",
            f"no tolerance derived for {policy}; largest relative difference "
            f"{cmp['max_loss_rel']:.1e} shown only (compare at 32-true: --precision 32-true)",
            **data,
        )
    data["tolerance"] = {"loss": tol["loss"], "grad_norm": tol["grad_norm"], "source": tol["source"]}
    why = []
    if cmp["max_loss_rel"] > tol["loss"]:
        why.append(
            f"step {cmp['worst_step']} loss differs from {ref_name} by {cmp['max_loss_rel']:.1e} relative "
            f"(tolerance {tol['loss']:g}, {policy})"
        )
    if cmp["max_grad_norm_rel"] is not None and cmp["max_grad_norm_rel"] > tol["grad_norm"]:
        why.append(f"grad norm by {cmp['max_grad_norm_rel']:.1e} (tolerance {tol['grad_norm']:g})")
    if cmp["token_mismatch"]:
        why.append(f"other tokens trained at step(s) {cmp['token_mismatch']} (not the same rows)")
    if why:
        settings = f"; the records differ in {', '.join(cmp['differs'])}" if cmp["differs"] else ""
        asked = f" (misconfigured on purpose by --override: {', '.join(overrides)})" if overrides else ""
        return S.problem(
            f"{name} losses",
            "; ".join(why) + settings + asked,
            f"{name} trained differently from one process on the same data: finetune compare "
            f"{run_dirs[0]} {run_dirs[1]}{' and make those settings equal' if settings else ''}; if "
            f"nothing differs, report it with doctor.json",
            **data,
        )
    return S.ok(
        f"{name} losses",
        f"within {tol['loss']:g} of {ref_name} at every step (largest "
        f"{cmp['max_loss_rel']:.1e} at step {cmp['worst_step']})",
        **data,
    )


def memory(record: dict) -> dict | None:
    """The planner's prediction against the measured training peak (run.json predicted_memory.error):
    device allocated on a GPU, the host process on CPU."""
    err = ((record.get("predicted_memory") or {}).get("error")) or {}
    for key, label in (("device_allocated", "device allocated"), ("host", "host RSS")):
        if err.get(key):
            return {"what": label, **err[key]}
    return None


def memory_text(m: dict | None) -> str:
    if m is None:
        return "n/a (no prediction in run.json)"
    return f"{m['what']} {m['predicted_gib']:.2f} / {m['measured_gib']:.2f} GiB ({m['relative_error']:+.0%})"
