"""The torch and transformers releases the model-running code supports, and the one call that differs between them.

The supported floor is what the project's two dependency sets test (``constraints/cpu.txt``: torch 2.13,
transformers 5.24; ``constraints/gpu-pins.txt``: what ``pip install .[model,vllm]`` resolves, vLLM 0.33's torch
2.14.0 and transformers 5.20.x). :func:`check_supported` refuses anything older at start-up, with a message that
names the installed and the required versions, instead of running a model whose outputs nobody checked.

The call that differs: transformers 5.24 renamed the forward argument that carries a model's KV cache from
``past_key_values`` to ``cache`` (the old name still works there, deprecated until 5.40). Before 5.24 a ``cache=``
keyword lands in ``**kwargs`` and is ignored: every decode step then sees only its last token, and the engine's
log-probabilities stop matching the trainer's (the silent failure this module exists to prevent).
:func:`cache_keyword` reads the name off the model's own ``forward`` signature, so the engine passes its cache under
whichever name the installed release reads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from mesh_runtime.failures import FailedPrecondition

# The oldest releases a dependency set of the project installs and tests (pyproject's ranges say the same).
MIN_TORCH = (2, 13)
MIN_TRANSFORMERS = (5, 20)


class UnsupportedVersion(FailedPrecondition):
    """An installed torch or transformers is older than the project supports, or a model's code lacks what the
    engine needs of it."""


def _release(version: str) -> tuple[int, ...]:
    """``'5.20.2'`` -> ``(5, 20, 2)``; local and pre-release tails (``+cpu``, ``rc1``, ``.dev0``) are ignored."""
    parts: list[int] = []
    for piece in version.split("+", 1)[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):
            break
    return tuple(parts)


def installed() -> dict[str, str]:
    """The installed torch and transformers versions, as their packages report them."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}


def describe() -> str:
    """``torch 2.14.0, transformers 5.20.2``: for errors and run summaries."""
    return ", ".join(f"{name} {version}" for name, version in installed().items())


def check_supported(versions: dict[str, str] | None = None) -> None:
    """Raise :class:`UnsupportedVersion` where torch or transformers is older than the supported floor."""
    versions = installed() if versions is None else versions
    floors = {"torch": MIN_TORCH, "transformers": MIN_TRANSFORMERS}
    problems = [f"{name} {versions[name]} (rollmesh needs >= {'.'.join(map(str, floor))})"
                for name, floor in floors.items() if name in versions and _release(versions[name]) < floor]
    if problems:
        raise UnsupportedVersion(
            "unsupported " + " and ".join(problems) + ": install the versions of a tested dependency set "
            "(pip install -c constraints/cpu.txt '.[model]', or '.[model,vllm]' on a GPU machine)")


def cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier)."""
    return _cache_keyword(type(model).forward, type(model).__name__)


@functools.cache
def _cache_keyword(forward: Any, class_name: str) -> str:
    parameters = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise UnsupportedVersion(f"{class_name}.forward takes no KV cache (neither 'cache' nor 'past_key_values'); "
                             f"the torch engine cannot decode incrementally with it")
