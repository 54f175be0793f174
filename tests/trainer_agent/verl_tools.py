"""Tools written exactly as for verl (its imports, its BaseTool interface), for the multi-turn tests.

verl is not installed here: rollmesh answers these imports with its stand-ins while the module loads.
"""

from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

CALLS: list[tuple[str, Any]] = []
"""What the tools were asked, in order (the tests read it)."""


class LookupTool(BaseTool):
    """Answers the value of a key from its config's table; rewards a lookup of the row's expected key."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.table = dict(config.get("table", {}))
        self._expected: dict[str, str] = {}

    async def create(self, instance_id: Optional[str] = None, expected_key: str = "",
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._expected[instance_id] = expected_key
        CALLS.append(("create", expected_key))
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        key = parameters.get("key", "")
        CALLS.append(("execute", key))
        if key == "boom":
            raise RuntimeError("the lookup service exploded")
        if key == "slow":
            import asyncio

            await asyncio.sleep(60)
        value = self.table.get(key, "unknown")
        return ToolResponse(text=value), 0.1, {"key": key}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        CALLS.append(("calc_reward", instance_id))
        return 1.0 if self._expected.get(instance_id) else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        CALLS.append(("release", instance_id))
        self._expected.pop(instance_id, None)
