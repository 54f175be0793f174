"""Tools for multi-turn trajectories, declared in verl's tool config and written against verl's ``BaseTool``.

A verl tool config is a YAML file::

    tools:
      - class_name: my_package.tools.LookupTool     # imported by path (also from the file's directory)
        config: {type: native, ...}                  # given to the constructor as ``config``
        tool_schema: {type: function, function: {name, description, parameters}}

Each class is built as verl builds it, ``cls(config=..., tool_schema=...)``, and used through verl's
interface: ``await create(instance_id, **create_kwargs)`` per trajectory (verl's newer tools return
``(instance_id, response)``, older ones the id), ``await execute(instance_id, parameters, **kwargs)``
returning ``(response, reward, metrics)`` where the response is a ``ToolResponse`` (``.text``), a dict
with ``text`` or a string, ``await calc_reward(instance_id)`` at the end of the trajectory and ``await
release(instance_id)``.

verl need not be installed: while a tool module is imported, ``verl.tools.base_tool``,
``verl.tools.schemas`` and ``verl.utils.rollout_trace`` are answered by small stand-ins of ours
(:data:`STAND_INS`: ``BaseTool``, ``OpenAIFunctionToolSchema``, ``ToolResponse``, ``rollout_trace_op``)
and removed again afterwards, as the controller does for ``ray`` with verl's policies. With verl
installed, its own modules are used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import sys
import traceback
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mesh_runtime.stand_ins import import_with_stand_ins

log = logging.getLogger(__name__)


class ToolConfigError(ValueError):
    """A tool config that cannot be loaded (the message names the entry and what is wrong)."""


# -- stand-ins for verl's tool modules -------------------------------------------------------------

class _Schema:
    """A read-only attribute view of a JSON schema dict with pydantic's ``model_dump`` / ``model_validate``
    (what tools written for verl call on ``OpenAIFunctionToolSchema``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        object.__setattr__(self, "_data", data)

    def __getattr__(self, name: str) -> Any:
        value = self._data.get(name)
        return _Schema(value) if isinstance(value, dict) else value

    @classmethod
    def model_validate(cls, data: dict[str, Any]) -> _Schema:
        return cls(dict(data))

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return dict(self._data)


class OpenAIFunctionToolSchema(_Schema):
    """Stand-in for ``verl.tools.schemas.OpenAIFunctionToolSchema``."""


@dataclasses.dataclass
class ToolResponse:
    """Stand-in for ``verl.tools.schemas.ToolResponse`` (text only)."""

    text: str | None = None
    image: Any = None
    video: Any = None


class BaseTool:
    """Stand-in for ``verl.tools.base_tool.BaseTool``: the same constructor and coroutines."""

    def __init__(self, config: dict, tool_schema: Any) -> None:
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def rollout_trace_op(fn: Any) -> Any:
    """Stand-in for ``verl.utils.rollout_trace.rollout_trace_op`` (no tracing)."""
    return fn


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name, "rollmesh's stand-in while a verl tool module is imported")
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


STAND_INS: dict[str, dict[str, Any]] = {
    "verl": {}, "verl.tools": {}, "verl.utils": {},
    "verl.tools.base_tool": {"BaseTool": BaseTool, "OpenAIFunctionToolSchema": OpenAIFunctionToolSchema},
    "verl.tools.schemas": {"OpenAIFunctionToolSchema": OpenAIFunctionToolSchema, "ToolResponse": ToolResponse},
    "verl.utils.rollout_trace": {"rollout_trace_op": rollout_trace_op},
}


def _verl_installed() -> bool:
    module = sys.modules.get("verl")
    if module is not None:
        return getattr(module, "__file__", None) is not None   # a stand-in has no file
    try:
        return importlib.util.find_spec("verl") is not None
    except (ImportError, ValueError):
        return False


def import_tool_module(name: str) -> types.ModuleType:
    """``importlib.import_module(name)``, verl's tool modules answered by the stand-ins when verl is absent."""
    if _verl_installed():
        return importlib.import_module(name)
    return import_with_stand_ins(name, {key: _module(key, **attrs) for key, attrs in STAND_INS.items()})


# -- the tool config ---------------------------------------------------------------------------------

def load_tools(path: str | Path) -> list[Any]:
    """The tools of a verl tool config file, built; raises :class:`ToolConfigError`."""
    import yaml  # noqa: PLC0415

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ToolConfigError(f"{str(path)[:200]}: cannot be read as YAML ({err})") from None
    entries = (data or {}).get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{str(path)[:200]}: needs a non-empty list under 'tools'")
    tools, names = [], set()
    for index, entry in enumerate(entries):
        where = f"{str(path)[:120]}: tools[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{where}: needs class_name (MODULE.CLASS)")
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolConfigError(f"{where}: needs tool_schema {{type: function, function: {{name, ...}}}}")
        config = entry.get("config") or {}
        if config.get("type", "native") != "native":
            raise ToolConfigError(f"{where}: config.type {config.get('type')!r} is not supported (native only)")
        module_name, _, class_name = entry["class_name"].rpartition(".")
        try:
            with _importable_from(Path(path).resolve().parent):
                cls = getattr(import_tool_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ToolConfigError(f"{where}: cannot import {entry['class_name'][:120]!r} ({err})") from None
        try:
            tool = cls(config=config, tool_schema=_schema_class(cls).model_validate(schema))
        except Exception as err:  # noqa: BLE001 - a tool's constructor is user code
            raise ToolConfigError(f"{where}: {entry['class_name'][:120]} failed to build: {err!r}") from None
        name = getattr(tool, "name", function["name"])
        if name in names:
            raise ToolConfigError(f"{where}: a second tool named {name!r}")
        names.add(name)
        tools.append(tool)
    return tools


@contextlib.contextmanager
def _importable_from(directory: Path) -> Iterator[None]:
    """Modules next to the tool config import too (as they would with it as the working directory)."""
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(directory))


def _schema_class(cls: type) -> Any:
    """verl's own schema class when the tool was written against installed verl, else the stand-in."""
    module = sys.modules.get("verl.tools.schemas")
    if module is not None and getattr(module, "__file__", None):
        return module.OpenAIFunctionToolSchema
    return OpenAIFunctionToolSchema


def schema_of(tool: Any) -> dict[str, Any]:
    """The tool's OpenAI function schema as a dict (for the chat template)."""
    schema = tool.tool_schema
    return schema.model_dump(exclude_unset=True, exclude_none=True) if hasattr(schema, "model_dump") else dict(schema)


@dataclasses.dataclass
class ToolOutcome:
    """What one call gave: the text for the model, the tool's step reward, and whether it failed."""

    text: str
    reward: float = 0.0
    failed: bool = False
    crashed: bool = False


class ToolBox:
    """The tools of one run; :meth:`call` runs one call of one trajectory, bounded by ``timeout_s``."""

    def __init__(self, tools: list[Any], *, timeout_s: float, max_response_length: int, truncate_side: str) -> None:
        self.tools = {getattr(t, "name", None) or schema_of(t)["function"]["name"]: t for t in tools}
        self.schemas = [schema_of(t) for t in tools]
        self.timeout_s = timeout_s
        self.max_response_length = max_response_length
        self.truncate_side = truncate_side

    async def call(self, name: str, arguments: dict[str, Any], tools_kwargs: dict[str, Any],
                   instances: dict[str, str]) -> ToolOutcome:
        """Run ``name(arguments)``. An unknown tool, a timeout or an exception of the tool becomes an error
        message to the model (a crash is logged with its traceback and counted); ``instances`` holds the
        trajectory's instance id per tool (created on first use, released by :meth:`release`)."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolOutcome(f"error: there is no tool {name[:60]!r}; the tools are "
                               f"{', '.join(sorted(self.tools))}", failed=True)
        kwargs = tools_kwargs.get(name, {}) if isinstance(tools_kwargs, dict) else {}
        try:
            async with asyncio.timeout(self.timeout_s):
                if name not in instances:
                    created = await tool.create(**(kwargs.get("create_kwargs") or {}))
                    instances[name] = created[0] if isinstance(created, tuple) else created
                result = await tool.execute(instances[name], arguments, **(kwargs.get("execute_kwargs") or {}))
        except TimeoutError:
            return ToolOutcome(f"error: the tool {name} did not answer within {self.timeout_s:g} s", failed=True)
        except Exception:  # noqa: BLE001 - a tool is user code: its failure is the model's error message
            log.error("tool %s failed:\n%s", name, traceback.format_exc())
            return ToolOutcome(f"error: the tool {name} failed", failed=True, crashed=True)
        response, reward = (result[0], result[1]) if isinstance(result, tuple) else (result, 0.0)
        return ToolOutcome(self._truncate(_text(response)), float(reward or 0.0))

    async def finish(self, instances: dict[str, str], tools_kwargs: dict[str, Any]) -> float:
        """The tools' ``calc_reward`` summed, then every instance released (failures logged)."""
        total = 0.0
        for name, instance in instances.items():
            tool = self.tools[name]
            kwargs = tools_kwargs.get(name, {}) if isinstance(tools_kwargs, dict) else {}
            try:
                async with asyncio.timeout(self.timeout_s):
                    total += float(await tool.calc_reward(instance, **(kwargs.get("calc_reward_kwargs") or {})))
                    await tool.release(instance, **(kwargs.get("release_kwargs") or {}))
            except Exception:  # noqa: BLE001 - user code
                log.error("tool %s failed to score or release:\n%s", name, traceback.format_exc())
        return total

    def _truncate(self, text: str) -> str:
        limit = self.max_response_length
        if len(text) <= limit:
            return text
        if self.truncate_side == "left":
            return text[:limit] + "...(truncated)"
        if self.truncate_side == "right":
            return "(truncated)..." + text[-limit:]
        half = limit // 2
        return text[:half] + "...(truncated)..." + text[-half:]


def _text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return str(response.get("text") or "")
    return str(getattr(response, "text", None) or "")
