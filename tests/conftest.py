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

    _patch_lang = _interpreter._patch_lang

    class _LaunchPatched:
        """What a device function called inside an interpreted launch gets instead of a fresh patch scope."""

        def restore(self) -> None:
            pass

    def _lang_modules(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def _patch_lang_once(fn, _patched: list = [set()]):  # noqa: B006 - the lang modules patched by the launch in flight
        """Triton's interpreter patches `triton.language` for every launch (restored at its end) and again at every
        device-function call inside it (never restored): the same modules, the same patches, ~1 ms each, half of an
        interpreted decoder test's time. Inside a launch, a call whose modules the launch patched reuses them."""
        langs = _lang_modules(fn)
        if _patched[0] and langs <= _patched[0]:
            return _LaunchPatched()
        scope = _patch_lang(fn)
        if _patched[0]:  # a device call reaching a module the launch did not patch: as Triton does, kept patched
            _patched[0] |= langs
            return scope
        _patched[0] = set(langs)
        restore = scope.restore

        def end_of_launch() -> None:
            _patched[0] = set()
            restore()

        scope.restore = end_of_launch
        return scope

    _interpreter._patch_lang = _patch_lang_once
