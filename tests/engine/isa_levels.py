"""The ``level`` fixtures of the CPU kernel tests: each ISA level this CPU can run that has the kernel."""
import pytest

from engine import cpu_ext


def usable_level(level: str, kernel, missing: str) -> str:
    """``level`` if this CPU runs it and ``kernel(level)`` built; else skip (``missing``: the reason, with ``{}``
    for the level). A build per level: ~40 s each the first time, cached after."""
    host = cpu_ext.host_isa()
    if level not in cpu_ext.levels_up_to(host):
        pytest.skip(f"ISA level {level} is above this CPU's ({host})")
    if kernel(level) is None:
        pytest.skip(missing.format(level))
    return level
