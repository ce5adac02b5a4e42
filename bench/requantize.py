"""GGUF files in the formats people download (Q4_K_M, Q5_K_M, ...), made from the packaged model
by llama.cpp's own quantizer: llama-cpp-python's ``llama_model_quantize`` in the benchmark peer's
venv (bash bench/setup_peers.sh), as ``llama-quantize --allow-requantize`` would. Benchmarks and
tests only; the files are kept out of git.

    python -m bench.requantize Q4_K_M [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from prefixrag.app.core.settings import packaged_llm_path

ROOT = Path(__file__).resolve().parents[1]
PEERS_VENV = Path(os.environ.get("PREFIXRAG_PEERS_VENV", ROOT / ".venv-peers"))
CACHE = ROOT / "bench" / ".cache"
# run by the peer venv's python: source, destination, llama.cpp's LLAMA_FTYPE_MOSTLY_* name
_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.allow_requantize = True
params.nthread = 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


class PeerMissing(RuntimeError):
    """No llama.cpp peer venv to quantize with."""


def peer_python() -> Path:
    python = PEERS_VENV / "bin" / "python"
    if not python.is_file():
        raise PeerMissing(f"no llama.cpp peer venv at {PEERS_VENV} (bash bench/setup_peers.sh)")
    return python


def requantize(file_type: str, out: Path, source: Path | None = None) -> Path:
    """``source`` (default: the packaged model) as ``file_type`` (Q4_K_M, Q5_K_M, Q8_0, ...)
    at ``out``, written to a temporary name first so that a failed run leaves nothing behind.
    Raises PeerMissing without the peer venv, RuntimeError if llama.cpp fails."""
    source = source or Path(packaged_llm_path())
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(peer_python()), "-c", _QUANTIZE, str(source), str(tmp), file_type],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize to {file_type}: {done.stderr[-2000:]}")
    tmp.replace(out)
    return out


def cached(file_type: str) -> Path:
    """The packaged model as ``file_type`` in bench/.cache, made once."""
    out = CACHE / f"{Path(packaged_llm_path()).stem.rsplit('.', 1)[0]}.{file_type}.gguf"
    return out if out.is_file() else requantize(file_type, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file_type", help="llama.cpp's name: Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    path = requantize(args.file_type, args.out) if args.out else cached(args.file_type)
    print(path)


if __name__ == "__main__":
    main()
