"""The agent's Generate decoding of hold_kv: passed to the engine with a session, refused when negative."""

from __future__ import annotations

import pytest
from google.protobuf.duration_pb2 import Duration

from mesh_runtime.errors import InvalidArgument
from replica_agent.convert import generation_request
from rollmesh.common.v1 import generation_pb2
from rollmesh.replica.v1 import replica_agent_pb2


def _request(**kw) -> replica_agent_pb2.GenerateRequest:
    return replica_agent_pb2.GenerateRequest(replica_id="r", request_id="x", prompt_token_ids=[1, 2],
                                             sampling_params=generation_pb2.SamplingParams(max_tokens=3), **kw)


def test_hold_kv_reaches_the_engine_with_a_session_only_and_a_negative_one_is_refused():
    assert generation_request(_request(session_id="s", hold_kv=Duration(seconds=2, nanos=500_000_000))).hold_kv_s == 2.5
    assert generation_request(_request(hold_kv=Duration(seconds=2))).hold_kv_s == 0.0    # no session: nothing held
    assert generation_request(_request(session_id="s")).hold_kv_s == 0.0
    with pytest.raises(InvalidArgument, match="hold_kv must not be negative") as info:
        generation_request(_request(session_id="s", hold_kv=Duration(seconds=-3)))
    assert info.value.reason == "INVALID_KV_HOLD"
