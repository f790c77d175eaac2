"""Small helpers for doing something once on rank 0 and sharing the outcome with every rank."""

from __future__ import annotations

from finetune.errors import UserError


def run_on_main(state, fn):
    """Run `fn` on the main process and return its result on every rank. A UserError raised
    there is raised on every rank, so all processes stop together instead of some hanging."""
    result, error = None, None
    if state.is_main_process:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        result, error = broadcast_object_list([result, error], from_process=0)
    if error is not None:
        raise UserError(error)
    return result
