"""The command line shared by the 1M-chunk benchmarks (hybrid_bench, lexical_scale_bench,
startup_bench): corpus size options, a temporary data dir, and the JSON report."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def scale_parser(description: str) -> argparse.ArgumentParser:
    """--total chunks built from --base real chunk texts, and --tmp, where the data goes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--total", type=int, default=1_000_000)
    parser.add_argument("--base", type=int, default=20_000)
    parser.add_argument("--tmp", default=None, help="where the data goes (default: a tmp dir)")
    return parser


def run_in_tmp(
    args: argparse.Namespace, run: Callable[[argparse.Namespace, Path], dict], results: Path
) -> None:
    """Run the bench in a temporary dir under --tmp, write its report with the arguments to
    `results` and print it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tmp is not None:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        report = run(args, Path(tmp))
    report["args"] = vars(args)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1))
