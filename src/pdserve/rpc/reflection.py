"""gRPC server reflection (grpc.reflection.v1alpha.ServerReflection, what grpcurl and
Postman use to list services and describe messages without the .proto files)."""

from __future__ import annotations

from collections.abc import Sequence

from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

HEALTH_SERVICE = "grpc.health.v1.Health"


def enable_reflection(server, services: Sequence[str]) -> tuple[str, ...]:
    """Serve reflection for `services` + health + reflection itself on `server` (an aio
    server, or the AppServer a ServiceApp.start receives). Returns the listed names."""
    names = (*services, HEALTH_SERVICE, reflection.SERVICE_NAME)
    # The aio servicer directly: enable_server_reflection() picks the blocking one unless it
    # gets a grpc.aio.Server instance, and AppServer is a wrapper.
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(names), server
    )
    return names
