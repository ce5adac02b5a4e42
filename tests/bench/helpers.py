"""What the kernel benches' tests share."""

from __future__ import annotations


class RecordingLibrary:
    """Stands in for a ctypes library: records which entry points were called, each returning
    0 (success) and writing nothing."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def entry(*args):
            self.calls.append(name)
            return 0

        return entry
