"""Loading a user's function or object by name: "package.module:name" (the CLI's --task, --reward, --env, --tools)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def load_object(spec: str) -> Any:
    """"package.module:name" (name may be dotted) -> the object (ValueError naming the spec if it cannot be found)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form 'module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {e}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        target = getattr(target, part)
    return target


def load_callable(spec: str) -> Callable[..., Any]:
    """"package.module:function" -> the function (ValueError naming the spec if it cannot be found)."""
    if ":" in spec and not spec.partition(":")[2]:
        raise ValueError(f"{spec!r} is not of the form 'module:function'")
    try:
        target = load_object(spec)
    except ValueError as e:
        raise ValueError(str(e).replace("'module:name'", "'module:function'")) from None
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target
