"""Suite-wide setup: without a CUDA device the Triton kernels run in Triton's CPU interpreter.

NOTE: TRITON_INTERPRET is read when `triton.jit` decorates a function, and triton's own library
functions (`tl.sigmoid`, ...) are decorated when triton is first imported; so it must be set before
any test module imports triton (through `kernels` or `inference_service`). This conftest is the first
module pytest loads. Importing `kernels` afresh later instead would give two classes of every packed
weight type, and `isinstance` checks between the two copies fail."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as _interpreter

    class _PatchOncePerLaunch:
        """Triton's interpreter patches `triton.language` for every launch (restored at its end) and again at every
        device-function call inside it (never restored): the same modules, the same patches, ~1 ms each, half of an
        interpreted decoder test's time. Inside a launch, a call whose modules the launch patched reuses them."""

        def __init__(self, patch_lang):
            self.patch_lang = patch_lang
            self.patched: set[int] = set()  # ids of the language modules the launch in flight patched

        def __call__(self, fn):
            langs = {id(value) for value in fn.__globals__.values()
                     if inspect.ismodule(value) and value in (tl, tl.core)}
            if self.patched and langs <= self.patched:
                return self  # a scope whose restore() does nothing: the launch restores
            scope = self.patch_lang(fn)
            if self.patched:  # a device call reaching a module the launch did not patch: kept patched, as in Triton
                self.patched |= langs
                return scope
            self.patched = langs
            restore = scope.restore

            def end_of_launch() -> None:
                self.patched = set()
                restore()

            scope.restore = end_of_launch
            return scope

        def restore(self) -> None:
            pass

    _interpreter._patch_lang = _PatchOncePerLaunch(_interpreter._patch_lang)


def pytest_collection_modifyitems(items) -> None:
    """Tests under tests/reliability time the server under overload, disconnects and restarts (e.g. a burst's
    excess refused within 2 s): they are marked `alone`, and `make test` runs them after the parallel part, by
    themselves (beside another pytest worker a 429 once took 2.4 s)."""
    for item in items:
        if "reliability" in item.path.parts:
            item.add_marker("alone")
