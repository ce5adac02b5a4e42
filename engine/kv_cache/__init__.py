"""The paged KV cache's bookkeeping, free of torch: physical blocks (``block_pool``), the
hash-keyed radix tree of cached blocks (``radix_cache``), the per-sequence block tables on top of
both (``block_manager``), and the tenant namespace every block key is salted with
(``cache_scope``)."""
