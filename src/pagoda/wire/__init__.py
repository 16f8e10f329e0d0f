"""What crosses the wire between clients, replicas and routers: OpenAI's request shapes (with vLLM's
extensions), validated at the door, the door's own guards, and vLLM's KV-event encoding.

Neutral ground: `pagoda serve` and `pagoda route` both read it, and it reads neither (nor the engine or the
model). `base.py` holds what every model shares (the error shape and its scope header, strict types, the
Unicode check), `limits.py` the bounds on one request (the server's flags, and those checked before
validation), `sampling.py` the fields both generation routes take, `completions.py` and `chat.py` (with
`messages.py` and `tool_calls.py`) each route's own, `tokens.py` /tokenize's and /detokenize's; `guards.py`
the body-size bound and JSON decoding; `kv_events.py` the KV events' format.
"""

from pagoda.wire.base import (
    ERROR_SCOPE_HEADER,
    REQUEST_SCOPE,
    Kind,
    OpenAIError,
    WireModel,
    first_invalid_text,
    now,
    random_id,
    usage,
)
from pagoda.wire.chat import ChatCompletionRequest, FunctionDefinition, NamedToolChoice, ToolDefinition
from pagoda.wire.completions import CompletionRequest
from pagoda.wire.limits import MAX_TOOLS, WIRE_LIMITS, ServerLimits, WireLimits, wire_limits
from pagoda.wire.messages import ROLES, AnyMessage, ChatMessage
from pagoda.wire.sampling import ResponseFormat, SamplingRequest, StreamOptions
from pagoda.wire.tokens import DetokenizeRequest, TokenizeRequest

__all__ = [
    "ERROR_SCOPE_HEADER", "MAX_TOOLS", "REQUEST_SCOPE", "ROLES", "WIRE_LIMITS", "AnyMessage",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "FunctionDefinition", "Kind",
    "NamedToolChoice", "OpenAIError", "ResponseFormat", "SamplingRequest", "ServerLimits", "StreamOptions",
    "TokenizeRequest", "ToolDefinition", "WireLimits", "WireModel", "first_invalid_text", "now", "random_id",
    "usage", "wire_limits",
]
