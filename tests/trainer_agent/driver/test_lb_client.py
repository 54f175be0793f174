"""LoadBalancerGenerate: request mapping and reading the final streamed message."""

from __future__ import annotations

import pytest

from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2
from trainer_agent.driver.lb_client import LoadBalancerGenerate
from trainer_agent.driver.rollouter import GenerationError, RolloutRequest

pytestmark = pytest.mark.timeout(60)


class FakeStub:
    def __init__(self, messages):
        self.messages = messages
        self.requests = []
        self.kwargs = []

    def Generate(self, request, **kwargs):  # noqa: N802
        self.requests.append(request)
        self.kwargs.append(kwargs)

        async def stream():
            for m in self.messages:
                yield m

        return stream()


def request() -> RolloutRequest:
    return RolloutRequest(request_id="g#0/1", prompt_token_ids=[1, 2], session_id="g#0",
                             partial_rollout=False, param_version=3, max_tokens=16, temperature=0.7,
                             retry_budget=4)


async def test_maps_request_and_reads_segments() -> None:
    seg1 = generation_pb2.TokenSegment(token_ids=[5, 6], logprobs=[-0.1, -0.2], weight_version=3, replica_id="a")
    seg2 = generation_pb2.TokenSegment(token_ids=[7], logprobs=[-0.3], weight_version=4, replica_id="b")
    stub = FakeStub([
        loadbalancer_pb2.GenerateResponse(request_id="g#0/1", token_ids=[5, 6]),
        loadbalancer_pb2.GenerateResponse(request_id="g#0/1", token_ids=[7],
                                          finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                                          segments=[seg1, seg2]),
    ])
    result = await LoadBalancerGenerate(stub, timeout_s=5)(request())
    sent = stub.requests[0]
    assert sent.request_id == "g#0/1" and list(sent.prompt_token_ids) == [1, 2]
    assert sent.HasField("partial_rollout") and sent.partial_rollout is False
    assert sent.session_id == "g#0" and sent.retry_budget == 4
    assert sent.sampling_params.max_tokens == 16 and sent.sampling_params.logprobs
    assert sent.sampling_params.temperature == pytest.approx(0.7)
    assert not sent.HasField("min_weight_version")
    assert stub.kwargs[0] == {"timeout": 5}
    assert result.finish_reason == "length"
    assert [s.weight_version for s in result.segments] == [3, 4]
    assert [t for s in result.segments for t in s.token_ids] == [5, 6, 7]


@pytest.mark.parametrize("messages", [
    [loadbalancer_pb2.GenerateResponse(request_id="g#0/1", token_ids=[5])],
    [loadbalancer_pb2.GenerateResponse(request_id="g#0/1", finish_reason=generation_pb2.FINISH_REASON_ABORTED)],
])
async def test_unfinished_or_aborted_stream_is_an_error(messages) -> None:
    with pytest.raises(GenerationError):
        await LoadBalancerGenerate(FakeStub(messages))(request())
