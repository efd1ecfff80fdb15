"""Loading a user's function by name: "package.module:function" (the CLI's --task, --reward, --env)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def load_callable(spec: str) -> Callable[..., Any]:
    """"package.module:function" -> the function (ValueError naming the spec if it cannot be found)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {e}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target
