"""pdserve client SDK: AsyncClient (asyncio), Client (sync), chat sessions, typed errors."""

from .aio import AsyncClient, build_request
from .chat import AsyncChatSession, ChatSession
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PdserveClientError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .results import (
    ClusterStatus,
    GenerationEvent,
    GenerationResult,
    InstanceInfo,
    RouterInfo,
    Usage,
)
from .sync import Client

__all__ = [
    "AsyncChatSession",
    "AsyncClient",
    "Cancelled",
    "ChatSession",
    "Client",
    "ClusterStatus",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GenerationEvent",
    "GenerationResult",
    "InstanceInfo",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PdserveClientError",
    "PermissionDenied",
    "ResourceExhausted",
    "RouterInfo",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "build_request",
]
