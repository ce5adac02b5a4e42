"""Errors the services raise; app.main maps each to an HTTP status with a JSON body."""

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
