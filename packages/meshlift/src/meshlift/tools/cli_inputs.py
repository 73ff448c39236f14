"""What `meshlift plan` reads from its command line: the factory, `--mesh` and `--rules`.

Each reader turns a user's mistake into a `UserError`, a message and a hint
that `meshlift.tools.cli` prints as `error:` and `hint:` lines (exit status 2).
Only the standard library is imported here, so the command line answers
`--help` at once.

Example:

```python
from meshlift.tools.cli_inputs import UserError, mesh_shape

assert mesh_shape("data=2,model=4") == {"data": 2, "model": 4}
try:
    mesh_shape("data=2,model")
except UserError as error:
    assert error.message == "--mesh 'data=2,model': 'model' is not NAME=SIZE"
    assert error.hint == "give each mesh axis a name and a size, e.g. --mesh data=2,model=4"
```
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


class UserError(Exception):
    """A mistake in what the user asked for: shown as `error:` and `hint:`, exit 2."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def factory(target: str) -> Any:
    """The zero-argument callable that `MODULE:FACTORY` names, imported from the current
    folder or the installed packages."""
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise UserError(
            f"{target!r} is not MODULE:FACTORY",
            "name a module and a zero-argument callable in it, e.g. mypkg.models:make_model",
        )
    import importlib

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):
            raise UserError(
                f"no module named {error.name!r}",
                f"run meshlift from the folder that holds {module_name.replace('.', '/')}.py "
                f"(the current folder, {os.getcwd()}, is searched), or install its package",
            ) from None
        raise UserError(
            f"importing {module_name!r} failed: {describe(error)}",
            f"install what it imports, or see the traceback with: python -c 'import {module_name}'",
        ) from None
    except Exception as error:  # a SyntaxError, or anything the module raises as it runs
        raise UserError(
            f"importing {module_name!r} failed: {describe(error)}",
            f"see the traceback with: python -c 'import {module_name}'",
        ) from None
    factory: Any = module
    for i, part in enumerate(factory_name.split(".")):
        if not hasattr(factory, part):
            where = ".".join([module_name, *factory_name.split(".")[:i]])
            names = (
                [n for n, v in vars(factory).items() if callable(v) and not n.startswith("_")]
                if hasattr(factory, "__dict__")
                else []
            )
            raise UserError(
                f"{where!r} has no attribute {part!r}",
                f"it has: {', '.join(names[:12])}" if names else "check the spelling",
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise UserError(
            f"{target} is not callable: it is the {type(factory).__name__} {factory!r:.40}",
            "name a zero-argument function or class that returns the model",
        )
    _check_no_arguments(target, factory)
    return factory


def _check_no_arguments(target: str, factory: Any) -> None:
    """Refuse a factory with required parameters, showing a zero-argument one to write."""
    import inspect

    try:
        # A class's own __init__: NNX's metaclass hides it behind (*args, **kwargs).
        is_class = isinstance(factory, type)
        callable_: Any = factory
        signature = inspect.signature(callable_.__init__ if is_class else callable_)
    except (TypeError, ValueError):  # no signature to read (some builtins): just call it
        return
    parameters = list(signature.parameters.values())[is_class:]  # no self
    required = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        module_name, _, factory_name = target.partition(":")
        call = ", ".join(f"{n}=..." if n != "rngs" else "rngs=nnx.Rngs(0)" for n in required)
        raise UserError(
            f"{target} needs arguments ({', '.join(required)}), and meshlift plan calls it "
            f"with none",
            f"name a zero-argument factory, e.g. in {module_name.replace('.', '/')}.py: "
            f"def make_model(): return {factory_name}({call}); then "
            f"meshlift plan {module_name}:make_model",
        )


def describe(error: BaseException) -> str:
    """`Type: first line of the message (at file:line)`, the line in the user's code."""
    import traceback

    if isinstance(error, SyntaxError):
        message, where = error.msg, f" (at {error.filename}:{error.lineno})"
    else:
        message = str(error).splitlines()[0] if str(error) else ""
        # The innermost frame outside the installed libraries and meshlift: the user's line.
        mine = os.path.dirname(os.path.dirname(__file__))  # meshlift/, not meshlift/tools/
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if "site-packages" not in f.filename and not f.filename.startswith(mine)
        ]
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}{': ' + message if message else ''}{where}"


def mesh_shape(text: str) -> dict[str, int]:
    """`data=2,model=4` -> `{"data": 2, "model": 4}`."""
    hint = "give each mesh axis a name and a size, e.g. --mesh data=2,model=4"
    shape: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not name or not size:
            raise UserError(f"--mesh {text!r}: {part.strip()!r} is not NAME=SIZE", hint)
        if not size.isdigit() or int(size) < 1:
            raise UserError(
                f"--mesh {text!r}: the size of {name!r} is not a positive integer", hint
            )
        if name in shape:
            raise UserError(f"--mesh {text!r}: the axis {name!r} is given twice", hint)
        shape[name] = int(size)
    return shape


def rules(path: str) -> list[tuple[Any, ...]]:
    """The `(logical_name, mesh_axes)` rules of a JSON file of `[name, axis or null]` pairs."""
    hint = (
        "the rules file is a JSON list of [logical_name, mesh_axis or null] pairs, "
        'e.g. [["batch", "data"], ["hidden", "model"], ["embed", null]]'
    )
    try:
        with open(path) as f:
            rules = json.load(f)
    except OSError as error:
        raise UserError(f"--rules {path!r}: {error.strerror}", hint) from None
    except json.JSONDecodeError as error:
        raise UserError(f"--rules {path!r} is not JSON: {error}", hint) from None
    if not isinstance(rules, list):
        raise UserError(f"--rules {path!r} holds a {type(rules).__name__}, not a list", hint)
    for rule in rules:
        if not _is_rule(rule):
            raise UserError(f"--rules {path!r}: {json.dumps(rule)} is not such a pair", hint)
    return [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules]


def _is_rule(rule: Any) -> bool:
    """`[logical_name, mesh_axis]`, the mesh axis a name, a list of names, or null."""
    if not (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)):
        return False
    axes = rule[1]
    return (
        axes is None
        or isinstance(axes, str)
        or (isinstance(axes, list) and all(isinstance(a, str) for a in axes))
    )
