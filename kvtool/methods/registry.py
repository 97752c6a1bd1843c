"""Explicit registry of compression methods: ``@register("uniform")`` binds a name to a class.

No package scanning: a method exists once its module is imported in `_load_builtin`.
"""

from __future__ import annotations

from kvtool.errors import RecipeError

QUANTIZERS: dict[str, type] = {}


def register(name: str):
    """Class decorator adding a `BlockQuantizer` subclass to the registry under ``name``."""

    def bind(cls: type) -> type:
        if name in QUANTIZERS and QUANTIZERS[name] is not cls:
            raise ValueError(f"quantizer '{name}' registered twice")
        cls.name = name
        QUANTIZERS[name] = cls
        return cls

    return bind


def _load_builtin() -> None:
    from kvtool.methods.lowrank import palu  # noqa: F401  (registers on import)
    from kvtool.methods.quant import fp8, int_static, none, nuq, turboquant, uniform  # noqa: F401  (registers on import)


def quantizer_class(name: str) -> type:
    """The class registered under ``name``; a clear error if there is none."""
    _load_builtin()
    if name not in QUANTIZERS:
        raise RecipeError(f"unknown quantization method '{name}'; registered methods: {sorted(QUANTIZERS)}")
    return QUANTIZERS[name]


def registered_quantizers() -> list[str]:
    """Names of every registered quantization method."""
    _load_builtin()
    return sorted(QUANTIZERS)
