"""Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels on CPU) without a redundant step.

A kernel launch patches ``triton.language`` for the interpreter once and restores it when the grid is done
(`GridExecutor.__call__`). Each call of a ``@triton.jit`` helper from inside the kernel patches the same modules again
(`InterpretedFunction.__call__` -> `_patch_lang`): ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math``
per call, and its scope is never restored. Our kernels call helpers per block and per tile, so this re-patching was
about 30% of an interpreted test's time (cProfile of ``test_triton_generation_with_one_byte_blocks_equals_torch``:
60 of 198 s in ``_patch_lang``, 41,120 calls for 184 launches).

`skip_repatching_inside_launches` wraps `_patch_lang`: while a launch's patch is in place, a helper call gets an empty
scope instead; a launch, or a helper called outside one, runs Triton's own code. A launch patches ``tl.core`` beside
``tl`` (Triton's own helpers, ``tl.max`` or ``tl.zeros``, are written against ``core``) and restores both when its grid
is done. What the kernels compute does not change: the same patched functions are in place either way. Installed by
``tests/conftest.py`` under the interpreter only; a Triton whose interpreter lacks these names is left as it is.
"""

from __future__ import annotations

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
    open_launches: list = []  # the scopes of the launches whose patch is in place

    def patch_lang(fn):
        if not isinstance(sys._getframe(1).f_locals.get("self"), launcher):  # a helper call, not `GridExecutor.__call__`
            return scope_type() if open_launches else original(fn)  # inside a launch: its patch is in place
        # a launch patches `tl` and `tl.core` both, the only modules Triton patches (its own helpers, `tl.max`, see `core`)
        scope = original(every_language)
        restore = scope.restore
        open_launches.append(scope)

        def restore_and_close():
            if open_launches and open_launches[-1] is scope:
                open_launches.pop()
            restore()

        scope.restore = restore_and_close
        return scope

    patch_lang.kvtool_wrapped = True
    interpreter._patch_lang = patch_lang
    return True

