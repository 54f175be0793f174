"""OpenTelemetry wiring shared by every server and client channel.

Export is configured by the standard ``OTEL_*`` variables: spans go to an
OTLP/gRPC exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-specific
variant) is set. ``ROLLMESH_TRACES_SINK`` (an OTLP/gRPC endpoint on loopback,
plaintext) adds a second exporter next to the user's: ``rollmesh train`` points
it at the run directory's own sink, so the user's collector still gets every
span. Every resource carries ``service.name``, ``service.version`` and
``service.instance.id`` (host and process id). W3C trace context travels in gRPC
metadata through the interceptors of ``opentelemetry-instrumentation-grpc``;
health checks and reflection are not traced.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import (
    aio_client_interceptors,
    aio_server_interceptor,
    filters,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")

_TRACED = filters.negate(filters.any_of(*(filters.service_prefix(p) for p in _UNTRACED_SERVICES)))

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


SINK_VARIABLE = "ROLLMESH_TRACES_SINK"


def create_tracer_provider(service_name: str, env: Mapping[str, str],
                           extra_processors: list[SpanProcessor] | None = None) -> TracerProvider:
    """Build a provider named ``service_name``; add the OTLP exporters ``env`` asks for."""
    from . import __version__  # noqa: PLC0415

    provider = TracerProvider(resource=Resource.create({
        "service.name": service_name, "service.version": __version__,
        "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}))
    enabled = env.get("OTEL_SDK_DISABLED", "").lower() != "true"
    if enabled and (any(env.get(v) for v in ENDPOINT_VARIABLES) or env.get(SINK_VARIABLE)):
        # Imported here: the exporter pulls in its own gRPC channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if any(env.get(v) for v in ENDPOINT_VARIABLES):
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))   # the user's collector
        if env.get(SINK_VARIABLE):
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=env[SINK_VARIABLE],
                                                                            insecure=True)))
    for processor in extra_processors or []:
        provider.add_span_processor(processor)
    return provider


def install_global(provider: TracerProvider) -> None:
    """Make ``provider`` the process-wide provider (once per server process)."""
    trace.set_tracer_provider(provider)


def server_interceptor(provider: TracerProvider | None):
    """Server-side span per RPC, continuing the caller's W3C context."""
    return aio_server_interceptor(tracer_provider=provider, filter_=_TRACED)


def client_interceptors(provider: TracerProvider | None) -> list:
    """Client-side spans that inject the current context into call metadata."""
    return aio_client_interceptors(tracer_provider=provider, filter_=_TRACED)


def tracer(provider: TracerProvider | None, name: str) -> trace.Tracer:
    """A tracer for the transition spans a component emits itself."""
    return trace.get_tracer(name, tracer_provider=provider)
