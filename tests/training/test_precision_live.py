"""The live precision reading and its stop (finetune/training/precision_evidence.py, the precision
steps of finetune/training/hooks.py RunHooks) without a launch: the optimizer-state dtype before states
exist, the bf16-true rule against bf16 arithmetic itself, and the hooks on small real modules: they
record, refuse a mismatch before step 1 and check the compute dtype in the first forward. The launched runs: tests/training/test_precision_equivalence.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from finetune import precision
from finetune.errors import UserError
from finetune.telemetry.record import RunRecord
from finetune.telemetry.sinks import RunJson, Sinks
from finetune.training import precision_evidence
from finetune.training.hooks import RunHooks


def test_optimizer_state_dtype_is_known_before_the_states_exist():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([p])
    assert not opt.state  # nothing allocated yet: the dtype comes from how AdamW will allocate
    assert precision_evidence.optimizer_state_dtype(opt, p.dtype) == torch.bfloat16
    p.grad = torch.ones_like(p)
    opt.step()  # control: what AdamW really allocates
    assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16

    class DeepSpeedCPUAdam:  # the attribute DeepSpeed's CPU Adam keeps (deepspeed/ops/adam/cpu_adam.py)
        def __init__(self, fp32_states):
            self.fp32_optimizer_states = fp32_states

    assert precision_evidence.optimizer_state_dtype(DeepSpeedCPUAdam(True), torch.bfloat16) == torch.float32
    assert precision_evidence.optimizer_state_dtype(DeepSpeedCPUAdam(False), torch.bfloat16) == torch.bfloat16

    class Lion:  # an optimizer this reader does not know: unknown, not guessed
        pass

    assert precision_evidence.optimizer_state_dtype(Lion(), torch.float32) is None


def _lost_by_bf16_arithmetic(w: torch.Tensor, lr: float) -> float:
    """Independent of the rule: add an update of size lr away from zero in fp32 and round to bf16,
    as a bf16 AdamW step does; the update is lost when the bf16 value does not change."""
    b = w.bfloat16()
    moved = (b.float() + lr * torch.sign(b.float())).bfloat16()
    nonzero = b != 0
    return float(((moved == b) & nonzero).sum()) / w.numel()


@pytest.mark.parametrize("lr", [1e-5, 1e-4, 1e-3])
def test_the_bf16_true_rule_predicts_which_updates_bf16_rounds_away(lr):
    torch.manual_seed(0)
    w = torch.randn(20_000) * 0.02
    w[:100] = 0.0  # LoRA B starts at zero: always movable
    model = torch.nn.Linear(200, 100, bias=False)
    model.weight.data = w.view(100, 200).bfloat16()
    share, needed, counted = precision_evidence.vanishing_share(model, lr)
    assert counted == 20_000
    assert share == pytest.approx(_lost_by_bf16_arithmetic(w, lr), abs=1e-4)
    lost_at_needed = _lost_by_bf16_arithmetic(w, needed * 1.0001)
    assert lost_at_needed < precision.VANISHING_WARN_SHARE <= _lost_by_bf16_arithmetic(w, needed / 2.0001)


def test_the_rule_on_hand_made_values():
    m = torch.nn.Linear(3, 1, bias=False)
    m.weight.data = torch.tensor([[1.0, 0.02, 0.0]])
    # half-spacings: 1.0 -> 2^-8 (bf16 keeps 8 significant bits); 0.02 -> 2^-14; 0 -> can always move
    assert precision_evidence.vanishing_share(m, 1e-4)[0] == pytest.approx(1 / 3)  # 2^-14 = 6.1e-5 < 1e-4
    assert precision_evidence.vanishing_share(m, 1e-5)[0] == pytest.approx(2 / 3)
    assert precision_evidence.vanishing_share(m, 2**-7)[0] == 0.0
    m.weight.requires_grad_(False)
    assert precision_evidence.vanishing_share(m, 1e-5) == (0.0, 0.0, 0)  # frozen weights are not trained


def test_the_warning_only_for_bf16_true_full_fine_tuning_over_the_share():
    args = dict(share=0.85, needed=1.2e-4, lr=1e-5)
    text = precision_evidence.bf16_true_warning(**args, policy="bf16-true", method="full")
    assert text.startswith("bf16-true: 85% of the trainable weights") and "training.precision: bf16-mixed" in text
    assert "0.00012" in text
    assert precision_evidence.bf16_true_warning(**args, policy="bf16-mixed", method="full") is None
    assert precision_evidence.bf16_true_warning(**args, policy="bf16-true", method="lora") is None
    assert precision_evidence.bf16_true_warning(0.05, 1e-5, 1e-5, policy="bf16-true", method="full") is None


def _fake_trainer(model, *, mixed_precision="no"):
    """What the reader touches of a Trainer: the wrapped model, the (accelerated) optimizer, the
    Accelerator's AMP state; a single process without autocast (Accelerate installs none for "no")."""
    callbacks = []
    acc = SimpleNamespace(
        native_amp=False,
        mixed_precision=mixed_precision,
        unwrap_model=lambda m: m,
        scaler=None,
        is_fsdp2=False,
        state=SimpleNamespace(distributed_type=SimpleNamespace(value="NO"), num_processes=1),
    )
    trainer = SimpleNamespace(
        model_wrapped=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        accelerator=acc,
        add_callback=callbacks.append,
    )
    return trainer, callbacks


def _record(tmp_path):
    rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="demo", config={})
    return rec


def _begin(callbacks):
    """RunHooks' precision steps of on_train_begin (the strategy's need a launch: tests/training/test_strategies.py)."""
    (hooks,) = callbacks
    expected = hooks.record_live_precision(True)
    hooks.confirm_in_first_forward(expected)


def _install(trainer, policy, rec):
    cfg = SimpleNamespace(
        run=SimpleNamespace(strategy="any", offload="any"),
        recipe="demo",
        method=SimpleNamespace(name="full"),
        training=SimpleNamespace(precision="auto"),
    )
    launch = SimpleNamespace(mesh=None, policy=precision.get(policy), family="torch", setup=None)
    sinks = Sinks(RunJson(rec))
    sinks.commit()  # a run's record is saved from its commit on
    trainer.add_callback(RunHooks(trainer, cfg, launch, learning_rate=1e-4, sinks=sinks))


def test_a_matching_run_is_recorded_and_its_first_forward_confirms_the_compute_dtype(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    trainer, callbacks = _fake_trainer(model)
    rec = _record(tmp_path)
    _install(trainer, "32-true", rec)
    _begin(callbacks)
    got = json.loads(rec.path.read_text())["precision"]
    assert {
        k: got[k]
        for k in (
            "policy",
            "requested",
            "param_dtype",
            "compute_dtype",
            "optimizer_state_dtype",
            "master_weights",
            "reduce_dtype",
        )
    } == {
        "policy": "32-true",
        "requested": "auto",
        "param_dtype": "float32",
        "compute_dtype": "float32",
        "optimizer_state_dtype": "float32",
        "master_weights": False,
        "reduce_dtype": None,
    }
    assert got["evidence"]["engine"] == "Sequential" and got["evidence"]["autocast"] is False
    assert got["observed_compute_dtype"] is None
    model(torch.ones(1, 4))  # step 1's first forward
    assert json.loads(rec.path.read_text())["precision"]["observed_compute_dtype"] == "float32"


def test_a_mismatch_stops_before_the_first_step_and_says_what_differs(tmp_path):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)  # what bf16-true holds, under a bf16-mixed policy
    trainer, callbacks = _fake_trainer(model)
    rec = _record(tmp_path)
    _install(trainer, "bf16-mixed", rec)
    with pytest.raises(UserError) as e:
        _begin(callbacks)
    msg = str(e.value)
    assert "training.precision auto (bf16-mixed on this machine) did not engage" in msg and "nothing was trained" in msg
    assert "param_dtype: the policy needs float32, the live run has bfloat16" in msg
    assert "optimizer_state_dtype: the policy needs float32, the live run has bfloat16" in msg
    assert "master_weights: the policy needs True, the live run has False" in msg
    assert json.loads(rec.path.read_text())["precision"]["param_dtype"] == "bfloat16"  # recorded before the stop


def test_a_forward_in_another_dtype_stops_before_its_backward(tmp_path):
    model = torch.nn.Linear(4, 4)
    trainer, callbacks = _fake_trainer(model)
    rec = _record(tmp_path)
    _install(trainer, "32-true", rec)
    _begin(callbacks)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UserError, match="computed in bfloat16"):
        model(torch.ones(1, 4))
    assert json.loads(rec.path.read_text())["precision"]["observed_compute_dtype"] == "bfloat16"
