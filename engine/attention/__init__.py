"""Attention over the paged KV cache: per-step metadata and the backends that read and write it.

KV layout (shared with kernels/): per layer ``k_cache``/``v_cache`` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; position p of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A step packs decode tokens first (one new token per sequence), then extend tokens (prefill chunks,
possibly after a cached prefix). Metadata is built once per step and shared by every layer.

- ``metadata``: :class:`AttentionMetadata` and how a step's spans become it;
- ``backend``: the :class:`AttentionBackend` protocol and the :class:`FusedOps` a backend brings;
- ``torch_backend``: plain torch and SDPA (CPU, any dtype);
- ``cpu_backend``: the C kernels of kernels/cpu_ops (the ``native`` setting; float32 on CPU);
- ``triton_backend``: the Triton kernels of kernels/, or their plain-torch references;
- ``sdpa``: the extend (prefill) path the torch and C backends share;
- ``factory``: :func:`make_backend`, which picks one by name.
"""
