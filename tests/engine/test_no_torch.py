"""The pure-Python heart of the engine must import without torch."""

import subprocess
import sys

PURE_MODULES = [
    "prefixrag.engine.config",
    "prefixrag.engine.sampling.params",
    "prefixrag.engine.kv_cache.cache_scope",
    "prefixrag.engine.sequence",
    "prefixrag.engine.kv_cache.block_pool",
    "prefixrag.engine.kv_cache.radix_cache",
    "prefixrag.engine.kv_cache.block_manager",
    "prefixrag.engine.scheduler",
    "prefixrag.engine.chunks.store",
    "prefixrag.engine.chunks.reuse_plan",
    "prefixrag.app.replicas.prefix_affinity",
]


def test_pure_modules_do_not_import_torch() -> None:
    # a fresh interpreter: this test process may already hold torch from other tests
    code = (
        "import importlib, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "", f"pure engine modules pulled in: {result.stdout.strip()}"
