"""Triton's interpreter at a quarter of its cost (test speed only; kernels and results unchanged).

A kernel launch under ``TRITON_INTERPRET=1`` patches ``triton.language`` for the launch, and then again on every call
of a ``@triton.jit`` helper inside the kernel (``inspect.getmembers`` over three modules, ~1.5 ms a call, a patch
never undone): about a third of an interpreted kernel test's time. A helper whose language modules the launch
already patched finds them patched, so :func:`patch_each_launch_once` makes those nested patches no-ops. It checks
the interpreter's layout (Triton 3.6-3.9) and leaves the interpreter alone if it differs.

The interpreter also checks every 32-bit integer add, subtract and multiply for overflow (three more interpreted ops
each, ~40 % of a kernel test's time); compiled kernels do not (Triton checks only in debug mode), and test shapes
are far from 2**31 elements. :func:`interpret_as_compiled` turns the check off.
"""

from __future__ import annotations

import dataclasses
import inspect


def speed_up_interpreter() -> tuple[bool, bool]:
    """Both speed-ups below (each where the installed Triton has what it changes)."""
    return patch_each_launch_once(), interpret_as_compiled()


def patch_each_launch_once() -> bool:
    """Skip ``_patch_lang`` for helpers called inside a launch that patched their modules; True if installed."""
    import triton.language as tl
    from triton.runtime import interpreter

    original, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or getattr(original, "once", False):
        return False
    launch: list[set[int]] = []  # while a launch runs: the language modules patched since it began

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        needed = langs(fn)
        if launch and needed <= launch[0]:
            return interpreter._LangPatchScope()  # nothing to patch, nothing to restore
        scope = original(fn)
        if launch:
            launch[0] |= needed
        return scope

    run = executor.__call__

    def call(self, *args, **kwargs):
        launch[:] = [set()]
        try:
            return run(self, *args, **kwargs)
        finally:
            launch.clear()

    patch_lang.once = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = call
    return True


def interpret_as_compiled() -> bool:
    """The interpreter without its integer overflow checks, as compiled kernels run; True if turned off."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
