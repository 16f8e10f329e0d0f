"""OpenAI request/response shapes (with vLLM's extensions), validated at the door.

`wire.py` holds what every model shares (the error shape, strict types, size bounds, the Unicode check),
`sampling.py` the fields both generation routes take, `completions.py` and `chat.py` (with `messages.py`)
each route's own, and `tokens.py` /tokenize's and /detokenize's.
"""

from pagoda.server.protocol.chat import ChatCompletionRequest, FunctionDefinition, NamedToolChoice, ToolDefinition
from pagoda.server.protocol.completions import CompletionRequest
from pagoda.server.protocol.messages import ROLES, AnyMessage, ChatMessage
from pagoda.server.protocol.sampling import ResponseFormat, SamplingRequest, StreamOptions
from pagoda.server.protocol.tokens import DetokenizeRequest, TokenizeRequest
from pagoda.server.protocol.wire import (
    MAX_TOOLS,
    WIRE_LIMITS,
    Kind,
    OpenAIError,
    WireLimits,
    WireModel,
    first_invalid_text,
    now,
    random_id,
    usage,
    wire_limits,
)

__all__ = [
    "MAX_TOOLS", "ROLES", "WIRE_LIMITS", "AnyMessage", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
    "DetokenizeRequest", "FunctionDefinition", "Kind", "NamedToolChoice", "OpenAIError", "ResponseFormat",
    "SamplingRequest", "StreamOptions", "TokenizeRequest", "ToolDefinition", "WireLimits", "WireModel",
    "first_invalid_text", "now", "random_id", "usage", "wire_limits",
]
