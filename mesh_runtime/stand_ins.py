"""Importing code written for another framework without that framework: its modules answered by stand-ins
for the duration of one import only (the controller for verl's policies and ``ray``, the driver for verl's
tool modules)."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping


def import_with_stand_ins(name: str, stand_ins: Mapping[str, types.ModuleType]) -> types.ModuleType:
    """``importlib.import_module(name)`` with each of ``stand_ins`` not already loaded put in ``sys.modules``
    while it imports, and removed afterwards, so nothing else in the process believes them installed."""
    added = {key: module for key, module in stand_ins.items() if key not in sys.modules}
    sys.modules.update(added)
    try:
        return importlib.import_module(name)
    finally:
        for key, module in added.items():
            if sys.modules.get(key) is module:
                del sys.modules[key]
