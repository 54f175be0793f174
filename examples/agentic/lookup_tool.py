"""The multi-turn example's tool, written as a verl tool is (verl's imports, its BaseTool interface).

``lookup`` answers the secret of the trajectory's row: the dataset gives each row its own secret letter in
``extra_info.tools_kwargs.lookup.create_kwargs``, so only a model that calls the tool can know it.
"""

from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class LookupTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._secrets: dict[str, str] = {}

    async def create(self, instance_id: Optional[str] = None, secret: str = "", **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._secrets[instance_id] = secret
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=self._secrets.get(instance_id, "")), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._secrets.pop(instance_id, None)
