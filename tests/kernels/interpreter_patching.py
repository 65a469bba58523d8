"""Triton's interpreter patches triton.language once per launch, not on every device-function call.

Under TRITON_INTERPRET=1 a launch swaps triton.language's builtins for interpreted ones
(`_patch_lang`), and so does every call of a @triton.jit helper inside the kernel, again, though
nothing has undone the swap since: hundreds of setattr per call, a third of the sampler's time and
half of the GEMV's (its fma runs recurse) on the CPU. Patching is idempotent, so a call whose
language modules were already patched in the running launch skips it: the same functions run on
the same values. Nothing changes where the interpreter's internals differ from what is expected
here (another Triton version): install() then leaves it alone.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Wraps the interpreter's patching; True if it did."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    real_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if real_patch is None or executor is None or getattr(real_patch, "_once_per_launch", False):
        return False
    real_call = executor.__call__
    patched: set[int] = set()  # the language modules patched since the running launch began
    langs_of: dict[int, tuple[int, ...]] = {}  # a function's globals -> the language modules it sees

    def patch_lang(fn):
        scope = id(fn.__globals__)
        langs = langs_of.get(scope)
        if langs is None:
            langs = langs_of[scope] = tuple(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if langs and patched.issuperset(langs):
            return None  # a device-function call: the launch (or an earlier call) patched these
        patched.update(langs)
        return real_patch(fn)

    def launch(self, *args, **kwargs):
        patched.clear()  # the launch patches afresh, and restores what it patched when it ends
        try:
            return real_call(self, *args, **kwargs)
        finally:
            patched.clear()

    patch_lang._once_per_launch = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    return True
