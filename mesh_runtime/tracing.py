"""OpenTelemetry wiring shared by every server and client channel.

Export is configured only by the standard ``OTEL_*`` variables: spans go to an
OTLP/gRPC exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-specific
variant) is set, and nowhere otherwise. W3C trace context travels in gRPC
metadata through the interceptors of ``opentelemetry-instrumentation-grpc``;
health checks and reflection are not traced.
"""

from __future__ import annotations

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


def create_tracer_provider(service_name: str, env: Mapping[str, str],
                           extra_processors: list[SpanProcessor] | None = None) -> TracerProvider:
    """Build a provider named ``service_name``; add an OTLP exporter if ``env`` asks for one."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if env.get("OTEL_SDK_DISABLED", "").lower() != "true" and any(env.get(v) for v in ENDPOINT_VARIABLES):
        # Imported here: the exporter pulls in its own gRPC channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
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
