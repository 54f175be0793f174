"""OpenTelemetry wiring shared by every server and client channel.

Export is configured by the standard ``OTEL_*`` variables: spans go to an
OTLP/gRPC exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-specific
variant) is set. ``ROLLMESH_TRACES_SINK`` (an OTLP/gRPC endpoint on loopback,
plaintext) adds a second exporter next to the user's: ``rollmesh train`` points
it at the run directory's own sink, so the user's collector still gets every
span. Every resource carries ``service.name``, ``service.version`` and
``service.instance.id`` (host and process id). W3C trace context travels in gRPC
metadata through the interceptors of :mod:`mesh_runtime.rpc_tracing` (current
semantic-convention names; planned interruptions are span events, not errors);
health checks and reflection are not traced.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from . import rpc_tracing

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


SINK_VARIABLE = "ROLLMESH_TRACES_SINK"


def create_tracer_provider(service_name: str, env: Mapping[str, str],
                           extra_processors: list[SpanProcessor] | None = None) -> TracerProvider:
    """Build a provider named ``service_name``; add the OTLP exporters ``env`` asks for."""
    from . import __version__  # noqa: PLC0415

    enabled = env.get("OTEL_SDK_DISABLED", "").lower() != "true"
    exporting = enabled and (any(env.get(v) for v in ENDPOINT_VARIABLES) or bool(env.get(SINK_VARIABLE)))
    # A process that exports nothing starts no trace of its own: its root spans are not sampled (nor, by the
    # parent-based rule, anything under them downstream), and with ``rollmesh_exports`` False below it makes
    # no span at all (rpc_tracing.exports), so the data path pays nothing for tracing that is off. A caller's
    # trace context still passes through to the processes it calls. OTEL_TRACES_SAMPLER (e.g.
    # parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG) overrides the sampler.
    sampler = None if exporting or extra_processors or env.get("OTEL_TRACES_SAMPLER") else ParentBased(ALWAYS_OFF)
    provider = TracerProvider(sampler=sampler, resource=Resource.create({
        "service.name": service_name, "service.version": __version__,
        "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}))
    if exporting:
        # Imported here: the exporter pulls in its own gRPC channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if any(env.get(v) for v in ENDPOINT_VARIABLES):
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))   # the user's collector
        if env.get(SINK_VARIABLE):
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=env[SINK_VARIABLE],
                                                                            insecure=True)))
    for processor in extra_processors or []:
        provider.add_span_processor(processor)
    provider.rollmesh_exports = exporting or bool(extra_processors)  # type: ignore[attr-defined]
    return provider


def span(tracer: trace.Tracer, name: str, **options: Any) -> contextlib.AbstractContextManager[trace.Span]:
    """``tracer.start_as_current_span(name, **options)``; where ``tracer`` is the no-op one (nothing is
    exported), a context holding the invalid span instead, which costs nothing and leaves the caller's trace
    context current (so it still reaches the calls made inside)."""
    if isinstance(tracer, trace.NoOpTracer):
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return tracer.start_as_current_span(name, **options)


def install_global(provider: TracerProvider) -> None:
    """Make ``provider`` the process-wide provider (once per server process)."""
    trace.set_tracer_provider(provider)


def client_interceptors(provider: TracerProvider | None, target: str | None = None) -> list:
    """Client-side spans (to ``target``) that inject their context into the call metadata."""
    return rpc_tracing.client_interceptors(provider, target)


def tracer(provider: TracerProvider | None, name: str) -> trace.Tracer:
    """A tracer for the transition spans a component emits itself (a no-op one where nothing is exported:
    see :func:`mesh_runtime.rpc_tracing.exports`)."""
    if not rpc_tracing.exports(provider):
        return trace.NoOpTracer()
    return trace.get_tracer(name, tracer_provider=provider)
