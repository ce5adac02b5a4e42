"""Chunk KV reuse: the KV of a retrieved chunk, computed once, placed into later prompts.

- ``store``: :class:`ChunkStore`, the GPU/CPU-resident entries keyed by chunk text and position
  class, and the :class:`ChunkSpan` a request marks its chunks with (no torch);
- ``reuse_plan``: which spans of a prompt a step takes from the store (no torch);
- ``blend``: placing an entry's KV at a new position (re-rotated keys) and recomputing the
  fraction of tokens that re-attends to the new prefix;
- ``host_tier`` and ``disk_tier``: where evicted entries spill, and are loaded back from;
- ``tiers``: :class:`ChunkTiers`, the one object the scheduler is handed: it spills, loads and
  captures entries across the pool and both tiers.
"""
