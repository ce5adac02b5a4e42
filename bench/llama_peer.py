"""llama.cpp (llama-cpp-python) as a benchmark peer: a small server on stdin/stdout, JSON lines.

Runs in the peers' own venv (bench/setup_peers.sh), never in the service's, so it imports
nothing from prefixrag. bench/engine_bench.py starts it once:

    .venv-peers/bin/python bench/llama_peer.py --model X.gguf --threads 2

It loads the model once, writes one line {"ready": true, "info": {...}}, then answers one line
per command line (every reply has "ok"; a failed command replies {"ok": false, "error": ...}):

    {"cmd": "info"}
    {"cmd": "decode", "prompt": [ids], "new_tokens": N}
        greedy; the prompt's KV is reused where the previous ids share a prefix with it (that
        part is untimed); decode tok/s = (N - 1) / time of the N - 1 one-token evals after the
        first token, the same definition as our engine's 1 / tpot
    {"cmd": "ttft_pair", "prefix": [ids], "suffix_a": [ids], "suffix_b": [ids]}
        cold: an empty KV, then prefix + suffix_a, timed to the first greedy token;
        warm: the prefix's KV from the cold run kept, suffix_b evaluated on top of it, timed
    {"cmd": "generate", "prompt": [ids], "max_tokens": N, "stop_ids": [ids]}
        greedy until a stop id (left out of the reply) or N tokens, KV reused as for decode
    {"cmd": "next_logprobs", "prompt": [ids], "candidates": [ids]}
        the log-probabilities (nats) of each candidate as the token after the prompt
    {"cmd": "quit"}

Sampling is an argmax over the last position's logits (numpy), the same greedy choice as our
engine at temperature 0, without llama-cpp-python's sampler chain in the timed loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import llama_cpp
import numpy as np

GGML_TYPES = {0: "f32", 1: "f16", 8: "q8_0"}


class Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.llm = llama_cpp.Llama(
            model_path=args.model,
            n_ctx=args.n_ctx,
            # llama.cpp's own CLI defaults: logical batch 2048, physical (compute) batch 512
            n_batch=args.n_batch,
            n_ubatch=args.n_ubatch,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            # only the last position's logits, like our engine and logits_to_keep=1
            logits_all=False,
            # the weights read into memory at load: no page faults inside a timed eval
            use_mmap=False,
            # llama.cpp's own default (auto) turns flash attention on for the CPU backend, but
            # llama-cpp-python only offers on/off, so the caller picks and reports it
            flash_attn=args.flash_attn == "on",
            verbose=False,
        )
        self.args = args
        self.n_vocab = self.llm.n_vocab()
        self.memory = llama_cpp.llama_get_memory(self.llm.ctx)

    def info(self) -> dict:
        ctx = self.llm.ctx
        return {
            "llama_cpp_python": llama_cpp.__version__,
            "n_threads": llama_cpp.llama_n_threads(ctx),
            "n_threads_batch": llama_cpp.llama_n_threads_batch(ctx),
            "n_ctx": self.llm.n_ctx(),
            "n_batch": self.llm.n_batch,
            "n_ubatch": self.args.n_ubatch,
            "flash_attn": self.args.flash_attn,
            "use_mmap": False,
            # llama.cpp's default KV type (f16), left unchanged; ours keeps float32 KV
            "kv_type": GGML_TYPES.get(self.llm.context_params.type_k, "other"),
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        }

    # -- primitives -------------------------------------------------------------------------

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,)
        )
        return int(logits.argmax())

    def _kv_last_pos(self) -> int:
        """The largest position held in sequence 0's KV (-1 when empty)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, 0))

    def _keep(self, n: int) -> None:
        """Keep the KV of the first n evaluated tokens and drop the rest. Llama.eval() drops
        everything from n_tokens on before it decodes, so this is what a later eval builds on;
        dropping here too lets the caller check what is really kept."""
        self.llm.n_tokens = n
        self.llm._ctx.kv_cache_seq_rm(0, n, -1)
        if self._kv_last_pos() != n - 1:
            raise RuntimeError(f"KV holds up to position {self._kv_last_pos()}, not {n - 1}")

    def _shared_prefix(self, ids: list[int]) -> int:
        n = min(self.llm.n_tokens, len(ids))
        held = self.llm.input_ids[:n]
        diff = np.nonzero(held != np.asarray(ids[:n], dtype=held.dtype))[0]
        return int(diff[0]) if len(diff) else n

    # -- commands ---------------------------------------------------------------------------

    def decode(self, prompt: list[int], new_tokens: int) -> dict:
        if new_tokens < 2:
            raise ValueError("decode needs new_tokens >= 2 (tok/s is timed after the first)")
        # reuse the shared prefix, but always evaluate the prompt's last token for its logits
        kept = min(self._shared_prefix(prompt), len(prompt) - 1)
        self._eval_prompt(prompt)
        tokens = [self._argmax()]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval(tokens[-1:])
            tokens.append(self._argmax())
        elapsed = time.perf_counter() - start
        return {"tok_s": (new_tokens - 1) / elapsed, "token_ids": tokens, "reused_tokens": kept}

    def _eval_prompt(self, prompt: list[int]) -> None:
        """The prompt's last logits, on the KV of the longest prefix already held."""
        kept = min(self._shared_prefix(prompt), len(prompt) - 1)
        self._keep(kept)
        self.llm.eval(prompt[kept:])

    def generate(self, prompt: list[int], max_tokens: int, stop_ids: list[int]) -> dict:
        self._eval_prompt(prompt)
        tokens: list[int] = []
        stops = set(stop_ids)
        while len(tokens) < max_tokens:
            token = self._argmax()
            if token in stops:
                break
            tokens.append(token)
            self.llm.eval([token])
        return {"token_ids": tokens}

    def next_logprobs(self, prompt: list[int], candidates: list[int]) -> dict:
        self._eval_prompt(prompt)
        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,)
        ).astype(np.float64)
        top = logits.max()
        log_total = top + np.log(np.exp(logits - top).sum())
        return {"logprobs": [float(logits[c] - log_total) for c in candidates]}

    def ttft_pair(self, prefix: list[int], suffix_a: list[int], suffix_b: list[int]) -> dict:
        # cold: reset() only zeroes n_tokens; the _keep(0) drops the KV itself and checks it
        self.llm.reset()
        self._keep(0)
        start = time.perf_counter()
        self.llm.eval(prefix + suffix_a)
        cold_token = self._argmax()
        cold_s = time.perf_counter() - start
        # warm: only suffix_b is evaluated, on top of the prefix's kept KV
        self._keep(len(prefix))
        start = time.perf_counter()
        self.llm.eval(suffix_b)
        warm_token = self._argmax()
        warm_s = time.perf_counter() - start
        if self._kv_last_pos() != len(prefix) + len(suffix_b) - 1:
            raise RuntimeError("the warm eval did not extend the kept prefix")
        return {
            "cold_s": cold_s,
            "warm_s": warm_s,
            "warm_cached_tokens": len(prefix),
            "warm_evaluated_tokens": len(suffix_b),
            "cold_token": cold_token,
            "warm_token": warm_token,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument("--n-ubatch", type=int, default=512)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="on")
    args = parser.parse_args()

    # The replies own the real stdout; anything native code prints goes to stderr instead, so
    # a stray line can never corrupt the protocol.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")

    peer = Peer(args)
    reply({"ready": True, "info": peer.info()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            cmd = msg.get("cmd")
            if cmd == "quit":
                reply({"ok": True})
                break
            if cmd == "info":
                out = peer.info()
            elif cmd == "decode":
                out = peer.decode(msg["prompt"], msg["new_tokens"])
            elif cmd == "generate":
                out = peer.generate(msg["prompt"], msg["max_tokens"], msg["stop_ids"])
            elif cmd == "next_logprobs":
                out = peer.next_logprobs(msg["prompt"], msg["candidates"])
            elif cmd == "ttft_pair":
                out = peer.ttft_pair(msg["prefix"], msg["suffix_a"], msg["suffix_b"])
            else:
                raise ValueError(f"unknown command {cmd!r}")
            reply({"ok": True, **out})
        except Exception as exc:  # the caller decides; the peer stays up for the next command
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
