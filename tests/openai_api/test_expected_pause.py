"""The HTTP fronts' x-expected-pause header: the session's next request is that many seconds away (0: none)."""

from __future__ import annotations

import pytest

from loadbalancer.fronts.openai_requests import ApiError, apply_expected_pause
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb


def test_the_header_sets_expected_pause_on_session_requests_only():
    requests = [pb.GenerateRequest(request_id="a", session_id="s"), pb.GenerateRequest(request_id="b")]
    apply_expected_pause(requests, None)
    assert not any(r.HasField("expected_pause") for r in requests)
    apply_expected_pause(requests, "2.5")
    assert requests[0].expected_pause.ToNanoseconds() == 2_500_000_000 and not requests[1].HasField("expected_pause")
    apply_expected_pause(requests, "0")           # the session's last turn: set, to zero
    assert requests[0].HasField("expected_pause") and requests[0].expected_pause.ToNanoseconds() == 0
    for bad in ("-0.5", "nan", "inf", "x" * 500):
        with pytest.raises(ApiError) as err:
            apply_expected_pause(requests, bad)
        assert err.value.param == "x-expected-pause" and len(str(err.value)) < 300
