"""OpenAI-shaped errors at the API's edge: one exception type, its JSON body and its headers."""

from __future__ import annotations

import json
import math

from shared.errors import ServiceError
from shared.sampling_params import SamplingParamsError

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """A request that gets an error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.extra_headers = headers or {}  # e.g. a tenant's x-ratelimit-* on a 429
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return dict(self.extra_headers)
        # Retry-After takes whole seconds; round up so a client never retries too early.
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after)))}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def from_sampling_error(e: SamplingParamsError) -> ApiError:
    return invalid(str(e), param=e.param)


def from_service_error(e: ServiceError) -> ApiError:
    """A failure reported by the scheduler or NATS (429, 503, 400, ...), with its Retry-After."""
    code = {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(e.status)
    return ApiError(e.status, e.message, type=e.error_type, code=code, retry_after=e.retry_after)


def too_large(max_body_bytes: int) -> ApiError:
    return ApiError(413, f"The request body exceeds the limit of {max_body_bytes} bytes.", code="request_too_large")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unavailable(message: str, retry_after: float | None = 1.0) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="service_unavailable",
                    retry_after=retry_after)


def context_length_exceeded(max_model_len: int, prompt_tokens: int, max_tokens: int | None,
                            param: str) -> ApiError:
    if max_tokens is None:
        detail = f"your prompt has {prompt_tokens} tokens, which leaves no room for a completion"
    else:
        detail = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                  f"{max_tokens} for the completion)")
    return invalid(f"This model's maximum context length is {max_model_len} tokens. However, {detail}. "
                   "Please reduce the length of the prompt or of the completion.",
                   param=param, code="context_length_exceeded")


def stream_error_event(status: int, message: str, type: str) -> dict:
    """The body of the `data: {"error": ...}` event that ends a stream which failed after it began."""
    return {"error": {"message": message, "type": type, "param": None, "code": status}}
