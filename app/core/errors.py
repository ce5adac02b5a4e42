"""Every error type of the service, in one place. The services raise ServiceError subclasses;
app/api/error_handlers.py maps each to an HTTP status with a JSON body (OpenAI's envelope on the
OpenAI routes)."""

from __future__ import annotations


class ServiceError(ValueError):
    """Base of every error a service raises on bad input or state; `status_code` is for HTTP."""

    status_code = 400


class InvalidInputError(ServiceError):
    """The input is well-formed HTTP but its content is unusable (empty text, bad metadata)."""

    status_code = 422


class UnsupportedTypeError(ServiceError):
    """The upload is of a type the service does not handle."""

    status_code = 415


class PayloadTooLargeError(ServiceError):
    """The upload exceeds `settings.max_upload_bytes`."""

    status_code = 413


class DocumentNotFoundError(ServiceError):
    """No document has the given id."""

    status_code = 404

    def __init__(self, document_id: int) -> None:
        super().__init__(f"document {document_id} not found")
        self.document_id = document_id


class DuplicateDocumentError(ServiceError):
    """The same content already exists in the collection; `document_id` is the existing one."""

    status_code = 409

    def __init__(self, document_id: int, collection: str) -> None:
        super().__init__(
            f"the same content already exists in collection {collection!r} "
            f"as document {document_id}"
        )
        self.document_id = document_id


class DocumentBusyError(ServiceError):
    """The document is still being ingested and cannot be changed yet."""

    status_code = 409


class AuthenticationError(ServiceError):
    """The request carries no API key, or one that is unknown or revoked."""

    status_code = 401


class QueueFullError(ServiceError):
    """Too much work is queued (ingestion or generation); retry after `retry_after` seconds."""

    status_code = 429

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotReadyError(ServiceError):
    """A component the request needs has not finished loading."""

    status_code = 503


class ReplicaUnavailableError(ServiceError):
    """The engine replica serving a request died or cannot be reached; retry after
    `retry_after` seconds (another replica, or its restart, takes over)."""

    status_code = 503

    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PromptTooLongError(ServiceError):
    """The prompt (plus the tokens asked for) does not fit the model's context window.

    ``param`` names the request field to change: the prompt, or max_tokens.
    """

    status_code = 400

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class HistoryChunkNotFoundError(ServiceError):
    """An earlier turn cites a chunk that no longer exists (its document was deleted)."""

    status_code = 404


class OpenAIError(Exception):
    """An error to report in OpenAI's shape."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param
