"""DeepSpeed's CPU ops (the optimizer offloaded to the host, the CPU collectives) are compiled on first use and
cached per machine (~/.cache/torch_extensions, shared by every environment of this Python). .ci/run builds them
before pytest so that no launched test compiles inside its timeout. Measured on the 2-core machine under load:
205 s to build cpu_adam, 5-9 s to load it once built (also from another virtual environment)."""

from deepspeed.accelerator import get_accelerator

for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):  # the two the CPU rehearsal's launches load
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        builder.load()
