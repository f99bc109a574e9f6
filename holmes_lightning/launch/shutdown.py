"""Our processes end without the interpreter's last walks over every object: with torch and Lightning loaded, those
take about a second per process, at the end of every job, of every rank and before every restart."""

from __future__ import annotations

import atexit
import functools
import gc


def _collect_then_freeze() -> None:
    gc.collect()  # the run's garbage, finalizers included, as the interpreter's exit would collect it
    gc.freeze()  # what is left is freed by reference counts alone as the modules are torn down


@functools.cache
def skip_exit_collections() -> None:
    """At exit, after the exit handlers registered later (they run first), collect once and freeze what is left, so
    that the interpreter's teardown does not walk torch's and Lightning's objects again. Python does not promise the
    finalizers of objects alive at exit either; the run closes its files, checkpoints and loggers before."""
    atexit.register(_collect_then_freeze)
