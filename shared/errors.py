"""Exceptions that cross service boundaries: bad wire messages and upstream failures with HTTP status."""

from __future__ import annotations


class MessageError(ValueError):
    """A message on the wire could not be encoded or decoded.

    `reason` is a short, bounded label for metrics: "malformed" (not MessagePack or not a map),
    "type" (wrong tag), "version" (unknown major version), "field" (missing or mistyped field,
    or a broken invariant) or "size" (over the size limit).
    """

    def __init__(self, message: str, reason: str = "field", type_tag: str = ""):
        super().__init__(message)
        self.reason = reason
        self.type_tag = type_tag


class ServiceError(Exception):
    """A request could not be served by the service behind NATS; carries the HTTP status to answer."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, status: int | None = None, error_type: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if error_type is not None:
            self.error_type = error_type
        self.retry_after = retry_after


class ServiceUnavailable(ServiceError):
    """Nobody answered: no responders, a timeout, or the NATS connection is down (HTTP 503)."""

    status = 503
    error_type = "service_unavailable"


class NoResponders(ServiceUnavailable):
    """Nobody subscribes to the subject right now (e.g. a service is between reconnects): safe to
    retry, since the message reached no one."""


class Overloaded(ServiceError):
    """Admission control refused the request; the client should retry after `retry_after` (HTTP 429)."""

    status = 429
    error_type = "rate_limit_exceeded"


class BadRequest(ServiceError):
    """The request itself cannot be served, e.g. an unknown model or a prompt too long (HTTP 400)."""

    status = 400
    error_type = "invalid_request_error"


def service_error(status: int, error_type: str, message: str, retry_after: float | None = None) -> ServiceError:
    """The ServiceError subclass for an HTTP status reported over the wire (e.g. a RouteReply)."""
    cls = {503: ServiceUnavailable, 429: Overloaded, 400: BadRequest}.get(status, ServiceError)
    return cls(message, status=status, error_type=error_type or None, retry_after=retry_after)
