"""``python -m cable_lightning gpu-check``: timed bf16 compiled fits of every attention backend on a CUDA GPU, with
recompiles, memory and a 16k evaluation, within a time budget (its plan in ``run``'s docstring and docs/speed.md, "On
a GPU"). Its parts, each read in one sitting: ``plan`` (encodings, sizes, parts and budgets), ``fits`` (a timed fit
per encoding), ``evaluation`` (the bench's evaluation at 16,384 tokens), ``memory`` (the estimate beside a fit's
peak), ``flex`` (FlexAttention against the reference), ``dynamo`` (counters, the recompile watch, the rehearsal's
backend), ``rows`` (the results file) and ``run`` (the run, part by part, and the verb's ``main``)."""

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """The verb (``run.main``), imported when it runs: ``python -m cable_lightning.gpu_check.flex`` (gpu-check's
    child process) then imports this package without Lightning."""
    from .run import main as run

    run(argv)
