"""pdserve client SDK: AsyncClient (asyncio), Client (sync), chat sessions, typed errors."""

from .aio import AsyncClient, build_request
from .chat import AsyncChatSession, ChatSession
from .errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    PdserveClientError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .results import ClusterStatus, GenerationEvent, GenerationResult, InstanceInfo, Usage
from .sync import Client

__all__ = [
    "AsyncChatSession",
    "AsyncClient",
    "Cancelled",
    "ChatSession",
    "Client",
    "ClusterStatus",
    "DeadlineExceeded",
    "GenerationEvent",
    "GenerationResult",
    "InstanceInfo",
    "Internal",
    "InvalidArgument",
    "PdserveClientError",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "build_request",
]
