"""The Python client of Inferno's NATS API, shaped like the openai package's async client:

    client = await inferno.client.connect("nats://127.0.0.1:4222", api_key="...")
    r = await client.chat.completions.create(model="inferno-demo", messages=[...])
    r = await client.chat.completions.parse(model="inferno-demo", messages=[...], response_format=MyPydanticModel)
    async for chunk in await client.chat.completions.create(..., stream=True): ...

The wire contract it speaks is shared/nats_api.py (and the README).
"""

from inferno.client.client import (AsyncInferno, AsyncStream, Chat, ChatCompletions, Completions, Models,
                                   connect)
from inferno.client.errors import (APIConnectionError, APIError, APIStatusError, APITimeoutError,
                                   AuthenticationError, BadRequestError, ConflictError, InfernoError,
                                   InternalServerError, NotFoundError, PermissionDeniedError, RateLimitError,
                                   UnprocessableEntityError)
from inferno.client.types import (ChatCompletion, ChatCompletionChunk, ChatCompletionMessage,
                                  ChatCompletionMessageToolCall, Choice, ChoiceDeltaToolCall, ChunkChoice, Completion,
                                  CompletionChoice, CompletionUsage, Function, Model, ModelList)

__all__ = [
    "connect", "AsyncInferno", "AsyncStream", "Chat", "ChatCompletions", "Completions", "Models",
    "InfernoError", "APIError", "APIStatusError", "APIConnectionError", "APITimeoutError", "BadRequestError",
    "AuthenticationError", "PermissionDeniedError", "NotFoundError", "ConflictError", "UnprocessableEntityError",
    "RateLimitError", "InternalServerError",
    "ChatCompletion", "ChatCompletionChunk", "ChatCompletionMessage", "ChatCompletionMessageToolCall",
    "ChoiceDeltaToolCall", "Function", "Choice", "ChunkChoice", "Completion",
    "CompletionChoice", "CompletionUsage", "Model", "ModelList",
]
