"""rollmesh's client library for custom trainers: the step protocol, events and scale operations, typed.

The integration point for a trainer of one's own (a verl trainer, a
Megatron loop): :class:`MeshClient` drives the controller's step protocol
(begin -> release -> complete, :class:`StepProtocol`, which the built-in driver uses too)
from a few counters the trainer keeps
(:class:`Counters`), filling every field of the step report the scheduling
policies read; retries each call with the same request until its deadline
(the controller answers a repeated call of the current step with the answer
it recorded, so a retry across a controller restart is safe); streams
lifecycle events as an async iterator that resumes from its last sequence;
and runs scale operations to their end. See docs/custom-trainers.md.
"""

from .client import MeshClient
from .steps import BeginResult, CompleteResult, Counters, ReleaseResult, StepProtocol, StepProtocolError

__all__ = ["BeginResult", "CompleteResult", "Counters", "MeshClient", "ReleaseResult", "StepProtocol",
           "StepProtocolError"]
