"""The run record's `speed` section (docs/run_record.md) as short comparison cells."""

from __future__ import annotations

SPEED_KEYS = ("layout", "loss_impl", "attention", "compile", "liger")
LAYOUTS = {"padded": "padded", "padding_free": "padding-free", "packing": "packing"}


def speed_cells(sp: dict | None) -> dict:
    """layout (+ packing algorithm, bucketing), the loss that ran (`(auto)` when auto chose it),
    attention implementation/SDPA policy, compile, Liger; all None for a record without `speed`."""
    if not sp:
        return dict.fromkeys(SPEED_KEYS)
    layout, loss, attn, liger = sp["layout"], sp["loss_impl"], sp["attention"], sp["liger"]
    policy = attn["sdpa_backends_policy"]
    kernels = [
        k for k, on in (("layers", liger["layer_kernels"]), ("fused loss", liger["fused_linear_cross_entropy"])) if on
    ]
    return {
        "layout": LAYOUTS[layout["name"]]
        + (" (BFD)" if layout["packing_algorithm"] == "best_fit_decreasing" else "")
        + (f", x{layout['pad_to_multiple_of']} tokens" if layout["pad_to_multiple_of"] else ""),
        "loss_impl": loss["resolved"] + (" (auto)" if loss["requested"] == "auto" else ""),
        "attention": attn["implementation"]
        + (f"/{policy if isinstance(policy, str) else '+'.join(policy)}" if attn["implementation"] == "sdpa" else ""),
        "compile": f"on ({sp['compile']['mode'] or 'default'})" if sp["compile"]["enabled"] else "off",
        "liger": " + ".join(kernels) or "off",
    }
