"""Our engine against its peers, like with like: same file, same token ids, same thread count.

Two comparisons, measured in one run, interleaved (each repeat runs ours and theirs back to back,
alternating who goes first, so machine noise hits both), medians over --repeats:

- GGUF blocks: ours with ``weight_quant=gguf`` (the packaged SmolLM2 Q4_1 file's own blocks)
  against llama.cpp (llama-cpp-python) on that same file. llama.cpp lives in its own venv
  (bash bench/setup_peers.sh) and runs as a child process, bench/llama_peer.py; without that venv
  its columns read "not installed" and everything else still runs. Its flash attention is
  whichever of on and off runs a probe prompt faster on this host (--llama-flash-attn best, the
  default; the JSON keeps the probe's times).
- float32: ours with ``weight_quant=none`` against Hugging Face transformers in float32 on the same
  dequantized weights.

Figures, each ours vs theirs:
- decode tok/s at batch 1, after a short (64-token) and a long (2,048-token) context;
- cold TTFT of a 2,048-token prefix + 32 new tokens (empty cache), time to the first token;
- warm TTFT: the same 2,048-token prefix cached, 32 other new tokens on top of it; warm/cold;
- float32 only: aggregate tok/s of 8 concurrent requests, transformers batched (the 8 prompts
  have equal length, so they are one batch with no padding);
- a RAG-sized prompt (272 + 560 tokens) with its first third cached, TTFT against the same
  prompt cold: each side's own ratio, side by side.

Every side samples greedily and only computes the last position's logits (logits_to_keep=1 for
transformers, logits_all=False for llama.cpp). Decode tok/s is (N - 1) / the time from the first
token to the last everywhere (our engine's 1 / tpot). Greedy agreement between each pair is
reported too: a check that both ran the same model on the same ids. Our TTFT is the engine's own
(request arrival to first token: scheduling, prefill, sampling); the peers' is their forward or
eval plus an argmax.

KV cache: ours on GGUF blocks stores it as --kv-cache-dtype (default auto: float16 on CPU, as
llama.cpp's own default f16 cache); --also-kv-dtypes adds more of our GGUF engines, one per KV
dtype, each against the same llama.cpp; ours fp32 keeps a float32 cache (like transformers). The
JSON reports every engine's KV dtype. --gguf-type Q4_K_M runs both GGUF sides on the packaged
model requantized by llama.cpp's own quantizer (bench/requantize.py). --int8-activations adds our
GGUF engine with int8 decode activations (EngineConfig.int8_activations), the arithmetic
llama.cpp's own CPU decode uses, as one more side against the same llama.cpp. --figures runs
only some figures (e.g. decode_long) and --no-fp32 leaves out the fp32/transformers comparison,
for a narrow run on a busy machine.

Threads: --threads for every side. llama.cpp gets n_threads = n_threads_batch = it; our side gets
OMP_NUM_THREADS (the C kernels are OpenMP, sharing torch's libgomp; the process restarts itself
once to set it before torch loads) and torch.set_num_threads. The JSON reports what each side
actually got. `make bench-peers` builds the llama.cpp venv.

Writes bench/results/engine_bench.json and .png and prints a table of ours, theirs and the
speed-up, saying where we lose.

    python -m bench.engine_bench [--threads 2] [--repeats 5] [--quick]
    python -m bench.engine_bench --figures decode_long --no-fp32 --also-kv-dtypes float32
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from bench.decode_bandwidth import bandwidth_rows, stream_gb_per_s, weight_bytes_per_token
from bench.requantize import cached
from prefixrag.app.core.settings import get_settings, packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.outputs import GenerationResult
from prefixrag.engine.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
PEER_SCRIPT = Path(__file__).parent / "llama_peer.py"
NOT_INSTALLED = "not installed (run bash bench/setup_peers.sh)"
# A real long English text that every Debian machine has (about 7,600 tokens).
SOURCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
# Where in SOURCE_TEXT's tokens the prompts that are not the shared prefix start (the prefix and
# its suffixes take the first ~2,100 + 32 per repeat).
CONCURRENT_OFFSET, SHORT_OFFSET = 4000, 6000
# the partly cached prompt (its head, then two different rests) sits between the two
PARTIAL_OFFSET = 2400
# the probe that picks llama.cpp's flash-attention setting (--llama-flash-attn best): a
# 1,024-token prefix, two 32-token suffixes and a decode, after the short prompt
PROBE_OFFSET, PROBE_PREFIX, PROBE_STEP = 6100, 1024, 32

FULL = {
    "prefix_tokens": 2048,
    "suffix_tokens": 32,
    "short_context": 64,
    "decode_tokens": 64,
    "concurrency": 8,
    "concurrent_prompt_tokens": 64,
    # a RAG-sized prompt whose first third is cached: 272 + 560 tokens
    "partial_cached_tokens": 272,
    "partial_new_tokens": 560,
    "repeats": 5,
}
# the quick suffix stays at 32: up to BLOCK_KERNEL_MAX_ROWS (16) rows the gguf matmuls take the
# block kernel, above it the dense GEMM (engine/quant.py), and a smoke run should take the full
# run's path
QUICK = {
    "prefix_tokens": 256,
    "suffix_tokens": 32,
    "short_context": 32,
    "decode_tokens": 8,
    "concurrency": 8,
    "concurrent_prompt_tokens": 32,
    "partial_cached_tokens": 64,
    "partial_new_tokens": 128,
    "repeats": 2,
}
# (key, label, unit, higher is better); the label's {} are filled from the sizes
METRICS = (
    ("decode_b1_short_tok_s", "decode b=1, {short_context}-token ctx", "tok/s", True),
    ("decode_b1_long_tok_s", "decode b=1, {prefix_tokens}-token ctx", "tok/s", True),
    ("cold_ttft_ms", "cold TTFT {prefix_tokens}+{suffix_tokens}", "ms", False),
    ("warm_ttft_ms", "warm TTFT {prefix_tokens} cached+{suffix_tokens}", "ms", False),
    ("warm_over_cold", "warm/cold TTFT", "x", False),
    ("concurrent_tok_s", "{concurrency} concurrent (theirs batched)", "tok/s", True),
    (
        "partial_warm_over_cold",
        "{partial_cached_tokens} cached+{partial_new_tokens} vs cold",
        "x",
        False,
    ),
)
# the vector path of the C block kernels, by lanes (kernels.block_quant_matmul.simd_lanes)
KERNEL_PATHS = {16: "AVX-512", 8: "AVX2+FMA", 1: "plain C loops"}
# within this relative margin a difference is called a tie: run-to-run noise on a shared machine
TIE = 0.05


# -- ours ----------------------------------------------------------------------------------------


def gguf_type_of(path: str) -> str:
    """The file type in a GGUF file name such as SmolLM2-135M-Instruct.Q4_K_M.gguf."""
    return Path(path).stem.rsplit(".", 1)[-1]


def build_engine(config: EngineConfig, weight_quant: str, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(
        dataclasses.replace(config, weight_quant=weight_quant, kv_cache_dtype=kv_cache_dtype)
    )


def fresh_scope() -> CacheScope:
    """A namespace no earlier request wrote: its prompt sees an empty prefix cache."""
    return CacheScope(namespace=uuid.uuid4().hex)


class Ours:
    """Our engine, measured the way the peers are (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.scope = fresh_scope()  # the last TTFT pair's: the long decode reuses its prefix

    def run_one(self, ids: list[int], max_tokens: int, scope: CacheScope) -> GenerationResult:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq_id = self.engine.add_request(ids, params, cache_scope=scope)
        while True:
            for event in self.engine.step():
                if event.seq_id == seq_id and isinstance(event.output, GenerationResult):
                    return event.output

    def ttft_pair(self, prefix: list[int], suffix_a: list[int], suffix_b: list[int]) -> dict:
        self.scope = fresh_scope()
        cold = self.run_one(prefix + suffix_a, 1, self.scope)
        warm = self.run_one(prefix + suffix_b, 1, self.scope)
        if warm.cached_tokens < len(prefix) - self.engine.runner.block_size:
            raise RuntimeError(f"warm run reused {warm.cached_tokens} of {len(prefix)} tokens")
        return {
            "cold_ttft_ms": 1000 * cold.ttft_s,
            "warm_ttft_ms": 1000 * warm.ttft_s,
            "warm_cached_tokens": warm.cached_tokens,
        }

    def decode(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        # the last TTFT pair's scope: a prompt it holds (the prefix) is not prefilled again;
        # either way only the steps after the first token are timed
        out = self.run_one(prompt, new_tokens, self.scope)
        return 1 / out.tpot_s, out.token_ids

    def concurrent(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        scope = fresh_scope()  # no prefix hits: transformers prefills every repeat too
        start = time.perf_counter()
        seq_ids = [self.engine.add_request(p, params, cache_scope=scope) for p in prompts]
        done: dict[int, GenerationResult] = {}
        while len(done) < len(seq_ids):
            for event in self.engine.step():
                if isinstance(event.output, GenerationResult):
                    done[event.seq_id] = event.output
        elapsed = time.perf_counter() - start
        results = [done[i] for i in seq_ids]
        return sum(r.completion_tokens for r in results) / elapsed, [r.token_ids for r in results]


# -- transformers (in this process) ---------------------------------------------------------------


def load_transformers():
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(packaged_llm_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class Transformers:
    """transformers float32 with one DynamicCache kept between calls, so a prompt that extends
    what the cache holds is not prefilled again (untimed work only, as for llama.cpp)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache = None
        self.ids: list[int] = []

    def _keep(self, n: int) -> None:
        if n == 0:
            self.cache, self.ids = None, []
        elif len(self.ids) > n:
            # transformers 5's crop takes minus the number of tokens to drop
            self.cache.crop(n - len(self.ids))
            self.ids = self.ids[:n]

    @torch.inference_mode()
    def _eval(self, ids: list[int]) -> int:
        # transformers 5 names the KV cache `cache` (past_key_values is deprecated)
        out = self.model(
            input_ids=torch.tensor([ids]), cache=self.cache, use_cache=True, logits_to_keep=1
        )
        self.cache = out.cache
        self.ids += ids
        # a cache that was silently not used would make every warm figure a lie
        if self.cache.get_seq_length() != len(self.ids):
            raise RuntimeError(f"KV cache holds {self.cache.get_seq_length()}, not {len(self.ids)}")
        return int(out.logits[0, -1].argmax())

    def ttft_pair(self, prefix: list[int], suffix_a: list[int], suffix_b: list[int]) -> dict:
        self._keep(0)
        start = time.perf_counter()
        self._eval(prefix + suffix_a)
        cold_s = time.perf_counter() - start
        self._keep(len(prefix))
        start = time.perf_counter()
        self._eval(suffix_b)
        warm_s = time.perf_counter() - start
        return {
            "cold_ttft_ms": 1000 * cold_s,
            "warm_ttft_ms": 1000 * warm_s,
            "warm_cached_tokens": len(prefix),  # checked by _eval: the cache held it
        }

    def decode(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        # the prompt's last token is always evaluated: its logits give the first new token
        kept = min(shared_prefix(self.ids, prompt), len(prompt) - 1)
        self._keep(kept)
        tokens = [self._eval(prompt[kept:])]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            tokens.append(self._eval(tokens[-1:]))
        return (new_tokens - 1) / (time.perf_counter() - start), tokens

    @torch.inference_mode()
    def batched(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
        x = torch.tensor(prompts)  # equal lengths: one batch, no padding
        start = time.perf_counter()
        out = self.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
        return len(prompts) * new_tokens / elapsed, out[:, x.shape[1] :].tolist()


# -- llama.cpp (a child process in .venv-peers) ---------------------------------------------------


class LlamaCpp:
    """The client of bench/llama_peer.py: one JSON line per command, one per reply."""

    def __init__(self, python: Path, model: str, threads: int, n_ctx: int, flash_attn: str):
        cmd = [str(python), str(PEER_SCRIPT), "--model", model, "--threads", str(threads)]
        cmd += ["--n-ctx", str(n_ctx), "--flash-attn", flash_attn]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        # stderr is inherited: llama.cpp's own messages and any traceback show up in the console
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.info = self._read()["info"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp peer exited (code {self.proc.wait()})")
        return json.loads(line)

    def call(self, cmd: str, **kwargs) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"llama.cpp peer, {cmd}: {reply.get('error')}")
        return reply

    def ttft_pair(self, prefix: list[int], suffix_a: list[int], suffix_b: list[int]) -> dict:
        r = self.call("ttft_pair", prefix=prefix, suffix_a=suffix_a, suffix_b=suffix_b)
        return {
            "cold_ttft_ms": 1000 * r["cold_s"],
            "warm_ttft_ms": 1000 * r["warm_s"],
            "warm_cached_tokens": r["warm_cached_tokens"],
        }

    def decode(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        r = self.call("decode", prompt=prompt, new_tokens=new_tokens)
        return r["tok_s"], r["token_ids"]

    def generate(self, prompt: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
        """Greedy ids after ``prompt``, up to a stop id (left out) or ``max_tokens``."""
        reply = self.call("generate", prompt=prompt, max_tokens=max_tokens, stop_ids=stop_ids)
        return reply["token_ids"]

    def next_logprobs(self, prompt: list[int], candidates: list[int]) -> list[float]:
        """The peer's log-probabilities (nats) of each candidate as the token after ``prompt``."""
        return self.call("next_logprobs", prompt=prompt, candidates=candidates)["logprobs"]

    def close(self) -> None:
        try:
            self.call("quit")
            self.proc.wait(timeout=30)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def start_llama_cpp(
    args: argparse.Namespace, sizes: dict, model: str, probe: list[int]
) -> LlamaCpp | str:
    """The peer, or why there is none (the text that goes in its columns). With
    --llama-flash-attn best, both settings run ``probe`` and the faster one is kept."""
    python = args.peers_venv / "bin" / "python"
    if not python.is_file():
        return NOT_INSTALLED
    longest = sizes["prefix_tokens"] + max(sizes["suffix_tokens"], sizes["decode_tokens"])
    longest = max(longest, sizes["partial_cached_tokens"] + sizes["partial_new_tokens"])
    n_ctx = -(-(longest + 64) // 256) * 256  # room for every prompt, in whole 256s
    try:
        if args.llama_flash_attn != "best":
            return LlamaCpp(python, model, args.threads, n_ctx, args.llama_flash_attn)
        return best_flash_attn(python, model, args.threads, n_ctx, probe)
    except (RuntimeError, OSError, json.JSONDecodeError) as exc:
        return f"{NOT_INSTALLED}: {exc}"


def probe_seconds(peer: LlamaCpp, probe: list[int]) -> dict:
    """One TTFT pair and one decode over ``probe``: seconds of each, and their sum."""
    prefix = probe[: -2 * PROBE_STEP]
    pair = peer.ttft_pair(prefix, probe[-2 * PROBE_STEP : -PROBE_STEP], probe[-PROBE_STEP:])
    tok_s, _ = peer.decode(prefix, PROBE_STEP)
    times = {
        "cold_s": pair["cold_ttft_ms"] / 1000,
        "warm_s": pair["warm_ttft_ms"] / 1000,
        "decode_s": (PROBE_STEP - 1) / tok_s,
    }
    return times | {"total_s": sum(times.values())}


def flash_attn_choice(timed: dict[str, dict]) -> str:
    """The setting whose probe parts are faster by the geometric mean of their on/off ratios.
    Each part counts alike: a sum of seconds is mostly the cold prefill, and on one 2-core Xeon
    a noisy probe once kept flash attention on for a cold prefill 18% faster, with a warm TTFT
    2.4x and a decode 1.7x slower."""
    parts = ("cold_s", "warm_s", "decode_s")
    log_ratio = sum(math.log(timed["on"][p] / timed["off"][p]) for p in parts) / len(parts)
    return "on" if log_ratio < 0 else "off"


def best_flash_attn(python: Path, model: str, threads: int, n_ctx: int, probe: list[int]):
    """llama.cpp with flash attention on and off: each runs the probe twice (the first is its
    warm-up), the faster (flash_attn_choice) is kept and the other closed. The winner differs
    by CPU: on one 2-core Xeon, flash attention made llama.cpp's decode at a 2k context 2.4x
    slower and its warm TTFT 6x slower, where on other hosts it helps."""
    timed: dict[str, dict] = {}
    peers: dict[str, LlamaCpp] = {}
    try:
        for setting in ("on", "off"):
            peers[setting] = LlamaCpp(python, model, threads, n_ctx, setting)
            probe_seconds(peers[setting], probe)
            timed[setting] = probe_seconds(peers[setting], probe)
        best = flash_attn_choice(timed)
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    for setting, peer in peers.items():
        if setting != best:
            peer.close()
    winner = peers[best]
    winner.info["flash_attn"] = f"{best} (best of on/off on a probe, geometric mean of its parts)"
    winner.info["flash_attn_probe"] = timed
    return winner


# -- the run -------------------------------------------------------------------------------------


def corpus_ids(engine: LLMEngine, num_tokens: int, offset: int = 0) -> list[int]:
    ids = engine.tokenizer.encode(SOURCE_TEXT.read_text())
    if len(ids) < offset + num_tokens:
        raise ValueError(f"{SOURCE_TEXT} is too short for {offset + num_tokens} tokens")
    return ids[offset : offset + num_tokens]


def omp_max_threads() -> int | None:
    """The OpenMP team size our C kernels get from this thread: they link the libgomp torch has
    loaded (kernels/native_build.py), so asking that library by its soname asks theirs."""
    try:
        return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())
    except (OSError, AttributeError):
        return None


def pin_threads(threads: int) -> None:
    """Give our side exactly ``threads`` threads. libgomp reads OMP_NUM_THREADS once, when torch's
    import loads it, so when it differs the process starts again with it set;
    torch.set_num_threads then fixes the main thread's team size (the engine runs there)."""
    if os.environ.get("OMP_NUM_THREADS") != str(threads):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    torch.set_num_threads(threads)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict | None:
    """Position-wise identical tokens, and tokens before each sequence's first difference (after
    one the two continue from different text, so both are reported); None without tokens (a
    run of figures that decode nothing on both sides)."""
    if not any(ours):
        return None
    same = total = prefix = 0
    for a, b in zip(ours, theirs, strict=True):
        total += len(a)
        same += sum(x == y for x, y in zip(a, b, strict=True))
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {
        "num_sequences": len(ours),
        "num_tokens": total,
        "identical_fraction": same / total,
        "before_first_difference_fraction": prefix / total,
    }


FIGURES = ("ttft", "decode_long", "decode_short", "concurrent", "partial")


def measure(
    sides: dict[str, dict[str, object]], prompts: dict, sizes: dict, only: tuple[str, ...] = FIGURES
) -> tuple[dict, dict]:
    """Interleaved repeats. ``sides``: comparison -> {"ours": side, "theirs": side or a reason}.
    Returns every sample (comparison -> ours/theirs -> metric -> list) and the last repeat's
    greedy tokens (comparison -> ours/theirs -> list of token lists)."""
    n = sizes["decode_tokens"]
    prefix, suffixes = prompts["prefix"], prompts["suffixes"]

    def ttft(side, r):
        return side.ttft_pair(prefix, suffixes[r], suffixes[r + 1])

    def decode(key, prompt):
        def run(side, r):
            tok_s, ids = side.decode(prompt, n)
            return {key: tok_s, "_tokens": [ids]}

        return run

    def concurrent(side, r):
        fn = side.concurrent if isinstance(side, Ours) else side.batched
        tok_s, ids = fn(prompts["concurrent"], n)
        return {"concurrent_tok_s": tok_s, "_tokens": ids}

    def partial(side, r):
        # the same prompt cold, then another with the same head cached: what a new question
        # over a cached system prompt and first source costs against no cache at all
        head, rest_a, rest_b = prompts["partial"]
        pair = side.ttft_pair(head, rest_a, rest_b)
        return {
            "partial_cold_ttft_ms": pair["cold_ttft_ms"],
            "partial_warm_ttft_ms": pair["warm_ttft_ms"],
        }

    # the long decode right after the TTFT pair: every side still holds the prefix's KV
    figures: list[tuple[str, Callable]] = [
        ("ttft", ttft),
        ("decode_long", decode("decode_b1_long_tok_s", prefix)),
        ("decode_short", decode("decode_b1_short_tok_s", prompts["short"])),
        ("concurrent", concurrent),
        ("partial", partial),
    ]
    plan = [
        (comparison, name, fn)
        for name, fn in figures
        for comparison in sides
        if name in only and (name != "concurrent" or comparison == "fp32_vs_transformers")
    ]
    samples: dict = {c: {"ours": {}, "theirs": {}} for c in sides}
    tokens: dict = {c: {"ours": {}, "theirs": {}} for c in sides}
    with tqdm(total=sizes["repeats"] * len(plan), desc="interleaved ours/theirs") as bar:
        for r in range(sizes["repeats"]):
            for comparison, name, fn in plan:
                # alternate who goes first: a drift in machine speed favours neither
                order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
                for who in order:
                    side = sides[comparison][who]
                    if isinstance(side, str):  # not installed
                        continue
                    bar.set_postfix_str(f"{comparison} {name} {who}")
                    for key, value in fn(side, r).items():
                        if key == "_tokens":
                            tokens[comparison][who][name] = value
                        else:
                            samples[comparison][who].setdefault(key, []).append(value)
                bar.update()
    return samples, tokens


def summarize_metrics(samples: dict, theirs_missing: str | None) -> dict:
    """Medians, the speed-up (> 1: ours is faster or better) and a plain verdict per metric."""
    out = {}
    ours_s, theirs_s = samples["ours"], samples["theirs"]
    for side in (ours_s, theirs_s):
        if "cold_ttft_ms" in side:  # per repeat: its warm run reuses its own cold run's prefix
            side["warm_over_cold"] = [
                w / c for w, c in zip(side["warm_ttft_ms"], side["cold_ttft_ms"], strict=True)
            ]
        if "partial_cold_ttft_ms" in side:
            side["partial_warm_over_cold"] = [
                w / c
                for w, c in zip(
                    side["partial_warm_ttft_ms"], side["partial_cold_ttft_ms"], strict=True
                )
            ]
    for key, _, unit, higher in METRICS:
        if key not in ours_s:
            continue
        ours = statistics.median(ours_s[key])
        row: dict = {"unit": unit, "better": "higher" if higher else "lower", "ours": ours}
        if theirs_missing is not None:
            row |= {"theirs": theirs_missing, "speedup": None, "verdict": "no peer"}
        else:
            theirs = statistics.median(theirs_s[key])
            speedup = ours / theirs if higher else theirs / ours
            verdict = "tie" if abs(speedup - 1) <= TIE else "we win" if speedup > 1 else "WE LOSE"
            row |= {"theirs": theirs, "speedup": speedup, "verdict": verdict}
            row["theirs_samples"] = theirs_s[key]
        row["ours_samples"] = ours_s[key]
        out[key] = row
    return out


def cached_tokens(samples: dict) -> dict:
    """How many prompt tokens each side's warm runs reused (the prefix, when it works)."""
    return {
        who: statistics.median(side["warm_cached_tokens"])
        for who, side in samples.items()
        if "warm_cached_tokens" in side
    }


def cpu_info() -> dict:
    """The host, and the vector path our C block kernels took on it (AVX-512, AVX2+FMA or plain
    C loops)."""
    from prefixrag.kernels.block_quant_matmul import simd_lanes

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []

    def field(name: str) -> str:
        return next(
            (ln.split(":", 1)[1].strip() for ln in lines if ln.split(":")[0].strip() == name), ""
        )

    flags = set(field("flags").split())
    return {
        "model": field("model name"),
        "logical_cpus": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "block_kernel_lanes": simd_lanes(),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), width_ratios=(3, 2))
    labels, values, colors = [], [], []
    palette = ("#2a7", "#36c", "#c63", "#a3a")
    for comparison, color in zip(result["comparisons"], palette, strict=False):
        block = result["comparisons"][comparison]
        for row in block["metrics"].values():
            if row["speedup"] is None:
                continue
            labels.append(f"{block['label']}: {row['label']}")
            values.append(row["speedup"])
            colors.append(color)
    y = range(len(labels))
    left.barh(list(y), values, color=colors)
    # log scale: 0.5x and 2x sit equally far from a tie
    left.set_xscale("log")
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    left.axvline(1.0, color="red", linestyle="--", linewidth=1)
    for i, v in enumerate(values):
        left.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
    left.set_yticks(list(y), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("ours vs theirs (> 1: ours faster; medians)")
    title = f"same file, same ids, {result['threads']['requested']} threads each"
    peer = result["comparisons"]["gguf_vs_llama_cpp"]["peer"]
    left.set_title(title + ("\nllama.cpp: " + peer if isinstance(peer, str) else ""))

    names, cold, warm = [], [], []
    for block in result["comparisons"].values():
        rows = block["metrics"]
        for who in ("ours", "theirs"):
            if "cold_ttft_ms" in rows and isinstance(rows["cold_ttft_ms"][who], float):
                names.append(block[who])
                cold.append(rows["cold_ttft_ms"][who])
                warm.append(rows["warm_ttft_ms"][who])
    x = range(len(names))
    right.bar([i - 0.2 for i in x], cold, 0.4, color="#888", label="cold")
    right.bar([i + 0.2 for i in x], warm, 0.4, color="#2a7", label="warm (prefix cached)")
    # one line per word group: "ours (gguf blocks, int8 activations)" would run into its neighbours
    names = [n.replace(" (", "\n(").replace(", ", ",\n") for n in names]
    right.set_xticks(list(x), names, fontsize=7)
    right.set_yscale("log")
    right.set_ylabel("TTFT (ms, log)")
    s = result["sizes"]
    right.set_title(f"TTFT, {s['prefix_tokens']}-token prefix + {s['suffix_tokens']} new")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    cpu, threads = result["cpu"], result["threads"]
    print(
        f"\nhost: {cpu['model']}, {cpu['logical_cpus']} CPUs; our block kernels: "
        f"{KERNEL_PATHS.get(cpu.get('block_kernel_lanes', 0), 'unknown')}; "
        f"threads each: ours {threads['ours_omp_max_threads']} (OpenMP), "
        f"llama.cpp {threads['llama_n_threads']}/{threads['llama_n_threads_batch']}"
    )
    losses = []
    for comparison in result["comparisons"].values():
        print(f"\n{comparison['label']}: {comparison['ours']} vs {comparison['theirs']}")
        print(f"  {'figure':<36} {'unit':>6} {'ours':>10} {'theirs':>10} {'speed-up':>9}  verdict")
        for row in comparison["metrics"].values():
            theirs = row["theirs"]
            theirs_text = f"{theirs:10.3g}" if isinstance(theirs, float) else f"{'-':>10}"
            speedup = f"{row['speedup']:8.2f}x" if row["speedup"] is not None else f"{'-':>9}"
            print(
                f"  {row['label']:<36} {row['unit']:>6} {row['ours']:10.3g} {theirs_text} "
                f"{speedup}  {row['verdict']}"
            )
            if row["verdict"] == "WE LOSE":
                losses.append(f"{comparison['label']} {row['label']} ({row['speedup']:.2f}x)")
        if isinstance(comparison["peer"], str):
            print(f"  {comparison['theirs']}: {comparison['peer']}")
    print()
    if losses:
        print("Where we lose: " + "; ".join(losses))
    else:
        print(f"We lose nowhere (ties are within {TIE:.0%}).")
    for name, agreement in result["greedy_agreement"].items():
        print(f"greedy agreement {name}: {agreement}")
    bandwidth = result.get("bandwidth")
    if bandwidth:
        print(
            f"memory bandwidth: {bandwidth['weight_bytes_per_token'] / 1e6:.0f} MB of weights "
            f"a token; a streaming read of them here: {bandwidth['stream_gb_per_s']:.1f} GB/s"
        )
        for name, rows in bandwidth["decode"].items():
            for key, sides in rows.items():
                text = ", ".join(
                    f"{who} {v['gb_per_s']:.1f} GB/s ({v['of_stream']:.0%})"
                    for who, v in sides.items()
                )
                print(f"  {name} {key}: {text}")


def resolve_sizes(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else FULL
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if sizes["decode_tokens"] < 2:
        raise SystemExit("--decode-tokens must be >= 2 (decode speed is timed after the first)")
    need = sizes["prefix_tokens"] + (sizes["repeats"] + 1) * sizes["suffix_tokens"]
    if need > PARTIAL_OFFSET:
        raise SystemExit(f"prefix + suffixes need {need} corpus tokens, > {PARTIAL_OFFSET}")
    partial = sizes["partial_cached_tokens"] + 2 * sizes["partial_new_tokens"]
    if PARTIAL_OFFSET + partial > CONCURRENT_OFFSET:
        raise SystemExit(f"the partly cached prompts need {partial} corpus tokens, > 1600")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads for every side")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    for key in FULL:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    parser.add_argument(
        "--llama-flash-attn",
        choices=("best", "on", "off"),
        default="best",
        help="llama.cpp flash attention; best (default): both run a probe and the faster is "
        "kept (llama.cpp's own default, auto, is on for CPU, which is not always the faster)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="auto",
        help="our GGUF engine's KV cache (auto: float16 on CPU)",
    )
    parser.add_argument(
        "--also-kv-dtypes",
        default="",
        help="comma-separated KV dtypes of more GGUF engines of ours, each against llama.cpp",
    )
    parser.add_argument(
        "--gguf-type",
        default=None,
        help="the packaged model requantized by llama.cpp (Q4_K_M, Q5_K_M, ...; bench/requantize"
        ".py) for both GGUF sides, instead of its own Q4_1 file; needs --no-fp32",
    )
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="also ours GGUF with int8 decode activations (as llama.cpp) against llama.cpp",
    )
    parser.add_argument(
        "--figures", default=",".join(FIGURES), help=f"comma-separated subset of {FIGURES}"
    )
    parser.add_argument(
        "--no-fp32", action="store_true", help="leave out ours fp32 vs transformers"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF file of real size for both GGUF sides (bench/setup_qwen.sh 1.5b), instead "
        "of the packaged model; needs --no-fp32",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_bench.json")
    args = parser.parse_args()
    args.figures = tuple(f for f in args.figures.split(",") if f)
    args.also_kv_dtypes = tuple(d for d in args.also_kv_dtypes.split(",") if d)
    for name in args.figures:
        if name not in FIGURES:
            raise SystemExit(f"unknown figure {name!r}; choose from {FIGURES}")
    if args.gguf_type and not args.no_fp32:
        raise SystemExit("--gguf-type compares the GGUF sides only: add --no-fp32")
    if args.model and not args.no_fp32:
        raise SystemExit("--model compares the GGUF sides only: add --no-fp32")
    pin_threads(args.threads)
    sizes = resolve_sizes(args)

    settings = get_settings()
    model_path = args.model or str(
        cached(args.gguf_type) if args.gguf_type else packaged_llm_path()
    )
    config = EngineConfig(
        model=model_path,
        cache_dir=str(settings.cache_dir / "models"),
        kv_cache_gb=0.5,
        # a cold prompt is prefilled in one step, as transformers does in one forward
        max_num_batched_tokens=max(4096, sizes["prefix_tokens"] + sizes["suffix_tokens"]),
        # float32 activations on the gguf side whatever the file; --int8-activations adds the
        # side that the default (auto) gives a K-quant file
        int8_activations=False,
    )
    # others' work on a shared machine skews every figure: the load before and after is kept
    load_before = os.getloadavg()[0]
    print("loading: ours gguf, ours fp32, transformers fp32, llama.cpp", file=sys.stderr)
    gguf = build_engine(config, "gguf", args.kv_cache_dtype)
    more_gguf = {
        f"gguf_kv_{dtype}": build_engine(config, "gguf", dtype) for dtype in args.also_kv_dtypes
    }
    if args.int8_activations:
        q8_config = dataclasses.replace(config, int8_activations=True)
        more_gguf["gguf_int8_act"] = build_engine(q8_config, "gguf", args.kv_cache_dtype)
    fp32 = None if args.no_fp32 else build_engine(config, "none", "float32")
    transformers_model = None if args.no_fp32 else load_transformers()
    probe_prefix = min(PROBE_PREFIX, sizes["prefix_tokens"])  # within n_ctx, --quick too
    probe = corpus_ids(gguf, probe_prefix + 2 * PROBE_STEP, PROBE_OFFSET)
    llama = start_llama_cpp(args, sizes, model_path, probe)
    try:
        result = run(args, sizes, gguf, fp32, transformers_model, llama, more_gguf)
    finally:
        if isinstance(llama, LlamaCpp):
            llama.close()
    result["model_path"] = model_path
    result["load_avg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print_table(result)
    if load_before > 0.5:
        print(
            f"note: the machine was busy before this run (1-minute load {load_before:.1f}); "
            "with every core in use, threads that wait for each other slow down by far more "
            "than their share, so these figures are not a quiet machine's"
        )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def run(
    args,
    sizes: dict,
    gguf: LLMEngine,
    fp32: LLMEngine | None,
    transformers_model,
    llama,
    more_gguf: dict[str, LLMEngine],
) -> dict:
    step = sizes["suffix_tokens"]
    prompts = {
        "prefix": corpus_ids(gguf, sizes["prefix_tokens"]),
        "suffixes": [
            corpus_ids(gguf, step, sizes["prefix_tokens"] + i * step)
            for i in range(sizes["repeats"] + 1)
        ],
        "short": corpus_ids(gguf, sizes["short_context"], SHORT_OFFSET),
        "concurrent": [
            corpus_ids(gguf, sizes["concurrent_prompt_tokens"], CONCURRENT_OFFSET + i * 64)
            for i in range(sizes["concurrency"])
        ],
        "partial": [
            corpus_ids(gguf, sizes["partial_cached_tokens"], PARTIAL_OFFSET),
            *(
                corpus_ids(gguf, sizes["partial_new_tokens"], PARTIAL_OFFSET + offset)
                for offset in (
                    sizes["partial_cached_tokens"],
                    sizes["partial_cached_tokens"] + sizes["partial_new_tokens"],
                )
            ),
        ],
    }
    peer_missing = llama if isinstance(llama, str) else None
    sides: dict[str, dict[str, object]] = {
        "gguf_vs_llama_cpp": {"ours": Ours(gguf), "theirs": llama}
    }
    for name, engine in more_gguf.items():
        sides[f"{name}_vs_llama_cpp"] = {"ours": Ours(engine), "theirs": llama}
    if fp32 is not None:
        sides["fp32_vs_transformers"] = {
            "ours": Ours(fp32),
            "theirs": Transformers(transformers_model),
        }
    # warm-up, untimed: kernels built, buffers allocated, every prefill and decode path run once
    warm_prefix = prompts["prefix"][:64]
    for pair in tqdm(sides.values(), desc="warm-up"):
        for side in pair.values():
            if not isinstance(side, str):
                side.ttft_pair(warm_prefix, prompts["suffixes"][0], prompts["suffixes"][1])
                side.decode(prompts["short"], 4)
    # the ceiling a decode is held to: a streaming read of the same bytes, before and after
    path = gguf.runner.model_path
    stream = stream_gb_per_s(path)
    samples, tokens = measure(sides, prompts, sizes, args.figures)
    stream += stream_gb_per_s(path)

    labels = {k: label.format(**sizes) for k, label, _, _ in METRICS}
    engines = {"gguf_vs_llama_cpp": gguf} | {
        f"{name}_vs_llama_cpp": engine for name, engine in more_gguf.items()
    }
    comparisons = {
        name: {
            "label": f"GGUF {gguf_type_of(engine.runner.model_path)}, KV "
            f"{str(engine.runner.kv_dtype).removeprefix('torch.')}"
            + (", int8 activations" if engine.runner.int8_activations else ""),
            "ours": "ours (gguf blocks"
            + (", int8 activations)" if engine.runner.int8_activations else ")"),
            "theirs": "llama.cpp",
            "peer": llama.info if isinstance(llama, LlamaCpp) else llama,
            "metrics": summarize_metrics(samples[name], peer_missing),
            "warm_cached_tokens": cached_tokens(samples[name]),
        }
        for name, engine in engines.items()
    }
    if fp32 is not None:
        import transformers

        comparisons["fp32_vs_transformers"] = {
            "label": "fp32",
            "ours": "ours (fp32)",
            "theirs": "transformers",
            "peer": {"transformers": transformers.__version__, "dtype": "float32"},
            "metrics": summarize_metrics(samples["fp32_vs_transformers"], None),
            "warm_cached_tokens": cached_tokens(samples["fp32_vs_transformers"]),
        }
    for block in comparisons.values():
        for key, row in block["metrics"].items():
            row["label"] = labels[key]
    bytes_per_token, stream_median = weight_bytes_per_token(path), statistics.median(stream)
    bandwidth = {
        "weight_bytes_per_token": bytes_per_token,
        "stream_gb_per_s": stream_median,
        "stream_samples": stream,
        "decode": {
            name: bandwidth_rows(comparisons[name]["metrics"], bytes_per_token, stream_median)
            for name in engines
        },
    }

    def agreement(comparison: str, a: str, b: str, names=("decode_short", "decode_long")):
        ta, tb = tokens[comparison][a], tokens[comparison][b]
        pairs = [
            (x, y) for n in names if n in ta and n in tb for x, y in zip(ta[n], tb[n], strict=True)
        ]
        return greedy_agreement([x for x, _ in pairs], [y for _, y in pairs]) if pairs else None

    greedy = {name: agreement(name, "ours", "theirs") for name in engines}
    ours_gguf = tokens["gguf_vs_llama_cpp"]["ours"]
    decodes = [n for n in ("decode_short", "decode_long") if n in ours_gguf]
    if fp32 is not None:
        greedy["fp32_vs_transformers"] = agreement(
            "fp32_vs_transformers", "ours", "theirs", ("decode_short", "decode_long", "concurrent")
        )
        ours_fp32 = tokens["fp32_vs_transformers"]["ours"]
        # the same matrices: all equal, barring ties in the logits (and 16-bit KV rounding)
        greedy["gguf_vs_fp32"] = greedy_agreement(
            [t for n in decodes for t in ours_gguf[n]], [t for n in decodes for t in ours_fp32[n]]
        )
    for name in more_gguf:
        other = tokens[f"{name}_vs_llama_cpp"]["ours"]
        greedy[f"{name}_vs_gguf"] = greedy_agreement(
            [t for n in decodes for t in other[n]], [t for n in decodes for t in ours_gguf[n]]
        )
    runner = gguf.runner
    return {
        "model": os.path.basename(runner.model_path),
        "cpu": cpu_info(),
        "threads": {
            "requested": args.threads,
            "ours_torch_threads": torch.get_num_threads(),
            "ours_omp_max_threads": omp_max_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "llama_n_threads": llama.info["n_threads"] if isinstance(llama, LlamaCpp) else None,
            "llama_n_threads_batch": (
                llama.info["n_threads_batch"] if isinstance(llama, LlamaCpp) else None
            ),
        },
        "sizes": {**sizes, "quick": args.quick, "figures": list(args.figures)},
        "ours": {
            name: {
                "weight_quant": engine.runner.weight_quant,
                "attention_backend": type(engine.runner.backend).__name__,
                "dtype": str(engine.runner.dtype),
                "kv_dtype": str(engine.runner.kv_dtype),
                "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
                "int8_activations": engine.runner.int8_activations,
            }
            for name, engine in (
                ("gguf", gguf),
                *more_gguf.items(),
                *((("fp32", fp32),) if fp32 is not None else ()),
            )
        },
        "comparisons": comparisons,
        "greedy_agreement": greedy,
        "bandwidth": bandwidth,
    }


if __name__ == "__main__":
    main()
