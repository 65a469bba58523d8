"""The client's exceptions, shaped like the openai package's (APIStatusError and its subclasses)."""

from __future__ import annotations


class InfernoError(Exception):
    """Every error the client raises."""


class APIError(InfernoError):
    """An error answer, or no answer. `body` is the OpenAI error object ({"message", "type", "param",
    "code"}) when the gateway sent one."""

    def __init__(self, message: str, *, body: dict | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.body = body
        self.request_id = request_id  # the x-request-id the client sent
        body = body or {}
        self.type: str | None = body.get("type")
        self.param: str | None = body.get("param")
        self.code = body.get("code")


class APIStatusError(APIError):
    """The gateway answered with an error status (x-status): 400, 401, 404, 413, 429, 499, 503, 504, ..."""

    def __init__(self, message: str, *, status_code: int, body: dict | None = None, request_id: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message, body=body, request_id=request_id)
        self.status_code = status_code
        self.retry_after = retry_after  # seconds, from Retry-After (429, 503)

    def __str__(self) -> str:
        return f"Error code: {self.status_code} - {self.message}"


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


class APIConnectionError(APIError):
    """No answer: no gateway listens on the subject, or the NATS connection failed."""


class APITimeoutError(APIConnectionError):
    """No terminal message within the request's timeout (the request is cancelled)."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
              409: ConflictError, 422: UnprocessableEntityError, 429: RateLimitError}


def status_error(status: int, body: dict | None, request_id: str | None, retry_after: float | None) -> APIStatusError:
    cls = _BY_STATUS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    message = (body or {}).get("message") or f"the gateway answered with status {status}"
    return cls(message, status_code=status, body=body, request_id=request_id, retry_after=retry_after)
