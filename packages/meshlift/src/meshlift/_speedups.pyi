from typing import Any

def read_each(descriptor: Any, objects: tuple[Any, ...], /) -> tuple[Any, ...]: ...
def read_each_is(
    descriptor: Any, objects: tuple[Any, ...], expected: tuple[Any, ...], /
) -> bool: ...
def write_each(descriptor: Any, objects: tuple[Any, ...], values: tuple[Any, ...], /) -> None: ...
def same_items(
    dicts: tuple[dict, ...],
    sizes: tuple[int, ...],
    keys: tuple[Any, ...],
    values: tuple[Any, ...],
    /,
) -> bool: ...
