"""Run Triton kernels under the interpreter in tests (no CUDA), with one fix for Triton's
own interpreter.

Triton 3.6 (the version torch 2.11 pins, as on the GPU machine's image) gives an
interpreted tensor an ``__index__`` of ``int(handle.data)``; a loaded scalar's data is a
one-element 1-D numpy array, and numpy 2.5 (Python >= 3.12) refuses ``int()`` of that, so
any ``range(lo, hi)`` over loaded bounds fails inside Triton ("only 0-dimensional arrays
can be converted to Python scalars"). Triton 3.9 squeezes first. This wraps the
interpreter's tensor patching to do the same; with a fixed Triton it changes nothing.
Only the interpreter is touched: compiled kernels (a GPU) never call ``__index__``.
"""
from __future__ import annotations

import os

import torch


def use_interpreter_without_cuda() -> None:
    """Set TRITON_INTERPRET when there is no CUDA device: before ``tierkv.kernels`` is
    first imported, since ``triton.jit`` picks the interpreter when it wraps a kernel."""
    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests say so themselves
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_tierkv_squeezes", False):
        return

    def patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._tierkv_squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
