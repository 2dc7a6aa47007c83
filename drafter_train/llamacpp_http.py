"""llama-server as a subprocess: started on a free port, waited for (/health), stopped by its own pid; and one
`/completion` request on token ids. Shared by the llama.cpp datagen backend (data/llamacpp_backend.py), which sits below
the engines, and the llama.cpp engine (engines/llamacpp_server.py)."""

from __future__ import annotations

import ctypes
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from drafter_train.errors import DrafterTrainError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when the thread that started it dies (Linux)


def _death_signal():
    """A preexec_fn that has the server die with the process that started it (Linux): a drafter-datagen or engine
    check ended by SIGTERM or SIGKILL skips its finally blocks, and the server it started would live on, holding its
    cores and port. None where prctl is not there. prctl is looked up here, in the parent: the child, forked from a
    process with threads, only calls it before exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


BIND_FAILED = "couldn't bind HTTP server socket"  # llama-server's line when its port was taken (server-http.cpp)


@contextmanager
def running_server(command: list[str], log: Path, startup_s: float = 180, attempts: int = 3) -> Iterator[str]:
    """Start llama-server, wait for /health, yield its URL; stopped (by its own pid) on exit. free_port() only
    names a port that was free when asked: if another process binds it first, llama-server says so and exits, and
    it is started again on another free port (up to `attempts` starts). A /health answer counts only while our own
    process lives (else another server answered on that port). The server dies with the thread that started it
    (_death_signal), so start it from a thread that outlives its use."""
    command = list(command)
    preexec = _death_signal()
    at = command.index("--port") + 1
    for attempt in range(attempts):
        with log.open("w") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=preexec)
        try:
            url = _wait_ready(proc, f"http://127.0.0.1:{command[at]}", log, startup_s)
            if url is None and attempt + 1 < attempts:  # the port was taken: try another
                command[at] = str(free_port())
                continue
            if url is None:
                raise RuntimeError(f"llama-server could not bind a port in {attempts} starts (log: {log})")
            yield url
            return
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, startup_s: float) -> Optional[str]:
    """url once our llama-server answers /health; None when it exited because its port was taken; raises when it
    exited otherwise or is not ready in startup_s."""
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            text = log.read_text(errors="replace")
            if BIND_FAILED in text:
                return None
            tail = text.strip().splitlines()[-3:]
            raise RuntimeError(f"llama-server exited ({proc.returncode}): {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200 and proc.poll() is None:
                    return url
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server not ready after {startup_s:.0f} s (log: {log})")
        time.sleep(0.5)


# How long a /completion may go without an answer before it counts as hung: REQUEST_S, plus time for each token
# asked, so a long generation on a slow or busy CPU is not cut at a fixed time (a fixed 600 s was: 192 tokens of a
# 1.5B target at nice 19 beside other work). Prompt tokens are evaluated in batches, so they cost far less.
REQUEST_S, REQUEST_S_PER_NEW_TOKEN, REQUEST_S_PER_PROMPT_TOKEN = 120.0, 5.0, 0.5


class ServerTimeout(DrafterTrainError, TimeoutError):
    """llama-server gave no answer within the time a request was allowed."""


def request_timeout(body: dict) -> float:
    """The seconds a /completion of `body` may take: REQUEST_S, plus per prompt token (a text prompt counts its
    characters, more than its tokens) and per token to generate (n_predict)."""
    return (REQUEST_S + REQUEST_S_PER_PROMPT_TOKEN * len(body.get("prompt", ()))
            + REQUEST_S_PER_NEW_TOKEN * max(int(body.get("n_predict", 0)), 0))


def post(url: str, body: dict, timeout: Optional[float] = None) -> dict:
    """POST a JSON body, return the JSON reply. `timeout`: seconds (None: request_timeout(body)); past it, one line."""
    timeout = request_timeout(body) if timeout is None else timeout
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except TimeoutError:
        asked = f"{len(body.get('prompt', ()))} prompt tokens, n_predict {body.get('n_predict')}"
        raise ServerTimeout(f"llama-server gave no answer within {timeout:.0f} s to {url} ({asked}); the limit grows "
                            "with the tokens asked (llamacpp_http.request_timeout): is the machine busy?") from None


def complete(url: str, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False, n_probs: int = 0,
             cache_prompt: bool = False) -> dict:
    """One greedy /completion on token ids -> {"tokens": [...], "timings": {...}}; ignore_eos: make all
    max_new_tokens (timing runs whose output does not matter). n_probs: also "logprobs", each generated position's
    top n_probs tokens {token: log-probability} before any sampler (the softmax of the raw logits: a difference of
    two is the difference of their logits). cache_prompt: the server (one slot) reuses the KV cache of the longest
    prefix it shares with the last request and evaluates the rest of the prompt as one batch (timings.prompt_n)."""
    body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "return_tokens": True,
            "cache_prompt": cache_prompt, "seed": 0, "ignore_eos": ignore_eos}
    if n_probs:
        body.update(n_probs=n_probs, post_sampling_probs=False)
    reply = post(f"{url}/completion", body)
    out = {"tokens": list(reply.get("tokens", [])), "timings": reply.get("timings", {})}
    if n_probs:
        out["logprobs"] = [{t["id"]: t["logprob"] for t in p["top_logprobs"]}
                           for p in reply.get("completion_probabilities", [])]
    return out
