"""Ingest many files from disk through the ingest service, with a progress bar; one bad file
never stops the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from prefixrag.app.core.errors import DuplicateDocumentError, ServiceError
from prefixrag.app.core.models import DEFAULT_TENANT
from prefixrag.app.core.settings import Settings
from prefixrag.app.services.ingest import IngestRequest, IngestService
from prefixrag.app.startup import default_loaders
from prefixrag.app.state import AppState


@dataclass(slots=True)
class BatchReport:
    """What happened to each file: ingested, already there, or failed (with the reason)."""

    ready: list[Path] = field(default_factory=list)
    duplicates: list[tuple[Path, int]] = field(default_factory=list)
    failures: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def num_failed(self) -> int:
        """How many files could not be ingested."""
        return len(self.failures)

    def summary(self) -> str:
        """A human-readable account, one line per duplicate or failure."""
        lines = [
            f"ingested {len(self.ready)}, duplicates {len(self.duplicates)}, "
            f"failed {len(self.failures)}"
        ]
        lines += [f"  duplicate: {p} (document {doc_id})" for p, doc_id in self.duplicates]
        lines += [f"  failed: {p}: {reason}" for p, reason in self.failures]
        return "\n".join(lines)


def ingest_files(
    settings: Settings,
    files: Sequence[Path],
    *,
    collection: str,
    title: str | None = None,
    tenant: str = DEFAULT_TENANT,
) -> BatchReport:
    """Load what ingestion needs (db, embedder, index) and ingest `files` one after another."""
    state = AppState(settings, loaders=default_loaders(settings))
    try:
        state.load_all({"db", "embedder", "index"})
        state.require("db", "embedder", "index")
        if state.ingest is None:
            raise ServiceError("the ingest service did not start")
        report = BatchReport()
        for path in tqdm(files, desc="ingest", unit="file"):
            _ingest_one(state.ingest, path, collection, title, report, tenant)
        return report
    finally:
        state.close()


def _ingest_one(
    ingest: IngestService,
    path: Path,
    collection: str,
    title: str | None,
    report: BatchReport,
    tenant: str,
) -> None:
    try:
        request = IngestRequest(
            data=path.read_bytes(),
            filename=path.name,
            title=title,
            collection=collection,
            tenant=tenant,
        )
        ticket = ingest.submit(request)
    except DuplicateDocumentError as exc:
        report.duplicates.append((path, exc.document_id))
        return
    except (ServiceError, OSError) as exc:
        report.failures.append((path, str(exc)))
        return
    outcome = ticket.future.result()
    if outcome.status == "ready":
        report.ready.append(path)
    else:
        report.failures.append((path, outcome.error or "unknown error"))
