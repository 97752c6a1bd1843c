"""Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels on CPU) without a redundant step.

A kernel launch patches ``triton.language`` for the interpreter once and restores it when the grid is done
(`GridExecutor.__call__`). Each call of a ``@triton.jit`` helper from inside the kernel patches the same modules again
(`InterpretedFunction.__call__` -> `_patch_lang`): ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math``
per call, and its scope is never restored. Our kernels call helpers per block and per tile, so this re-patching was
about 30% of an interpreted test's time (cProfile of ``test_triton_generation_with_one_byte_blocks_equals_torch``:
60 of 198 s in ``_patch_lang``, 41,120 calls for 184 launches).

`skip_repatching_inside_launches` wraps `_patch_lang`: while a launch's patch is in place, a helper call whose
language modules that launch already patched gets an empty scope instead; anything else (a launch, a helper called
outside a launch, a helper seeing a module the launch did not patch) runs Triton's own code. A launch patches
``tl.core`` beside ``tl`` (Triton's own helpers, ``tl.max`` or ``tl.zeros``, are written against ``core``) and restores
both when its grid is done. What the kernels compute
does not change: the same patched functions are in place either way. Installed by ``tests/conftest.py`` under the
interpreter only; a Triton whose interpreter lacks these names is left as it is.
"""

from __future__ import annotations

import inspect
import sys
import types


def skip_repatching_inside_launches() -> bool:
    """Install the wrapper; True if installed (False: no Triton, an unknown interpreter, or already installed)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    launcher = getattr(interpreter, "GridExecutor", None)
    if None in (original, scope_type, launcher) or getattr(original, "kvtool_wrapped", False):
        return False
    every_language = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})  # what `_patch_lang` reads of fn
    patched: list[frozenset[int]] = []  # the language modules (ids) patched by the launch in progress, if any

    # id(a function's globals) -> (those globals, kept so the id is not reused; their language modules' ids)
    modules_of: dict[int, tuple[dict, frozenset[int]]] = {}

    def language_modules(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in modules_of:
            found = frozenset(
                id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core))
            modules_of[key] = (fn.__globals__, found)
        return modules_of[key][1]

    def patch_lang(fn):
        modules = language_modules(fn)
        launch = isinstance(sys._getframe(1).f_locals.get("self"), launcher)  # called by `GridExecutor.__call__`
        if not launch and patched and modules <= patched[-1]:
            return scope_type()  # a helper inside a launch: that launch's patch is in place
        if not launch:
            return original(fn)
        # the launch patches `tl` and `tl.core` both: Triton's own helpers (`tl.max`, `tl.zeros`, ...) see `core`
        modules = language_modules(every_language)
        scope = original(every_language)
        restore = scope.restore
        patched.append(modules)

        def restore_and_close():
            if patched and patched[-1] is modules:
                patched.pop()
            restore()

        scope.restore = restore_and_close
        return scope

    patch_lang.kvtool_wrapped = True
    interpreter._patch_lang = patch_lang
    return True

