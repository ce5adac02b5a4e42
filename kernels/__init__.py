"""Triton kernels for the GPU path, each module holding one op beside its plain-torch reference:
kv_write, paged_decode, extend_attention, rms_norm, rope. Imports only torch and triton."""
