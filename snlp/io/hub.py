"""Loads from the Hugging Face hub that do not wait on a network that is not there.

The hub's clients (huggingface_hub under transformers and datasets) retry a request that cannot connect, with
back-off, before they fail or fall back to their cache: offline without HF_HUB_OFFLINE set, a model the hub cache
already held took minutes to load (5 min for a 2-layer model: one HEAD request per optional file, each retried), a
`--task arc-easy` 25-70 s to fail. One TCP connection to the hub's endpoint with a short timeout says whether the
network path exists; where it does not, the load runs from the caches only, as HF_HUB_OFFLINE=1 would: what they
hold loads at once, anything else fails at once.

Behind a proxy (HTTPS_PROXY, HTTP_PROXY for an http:// endpoint, ALL_PROXY; not where NO_PROXY names the endpoint's
host) a direct connection says nothing about the proxied path: the probe answers reachable there and the clients
behave as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import sys
import threading
import time
import urllib.request
from urllib.parse import urlparse

TRUE = ("1", "on", "yes", "true")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_offline() -> bool:
    """The hub's clients run offline: huggingface_hub reads HF_HUB_OFFLINE, and TRANSFORMERS_OFFLINE only where
    HF_HUB_OFFLINE is unset or empty (`HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=1` is online), as a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in TRUE


def proxied(scheme: str, host: str) -> bool:
    """The hub's clients reach `host` through a proxy: one set for the endpoint's scheme (HTTPS_PROXY, HTTP_PROXY for
    an http:// endpoint) or for all (ALL_PROXY), and NO_PROXY not naming the host (the clients' reading of them)."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)


@functools.cache
def unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub's endpoint (HF_ENDPOINT, default https://huggingface.co) cannot be reached from here, as a phrase,
    or None: it answered a TCP connection within `timeout` s, or the clients go through a proxy (`proxied`: unknown,
    left to them). Asked once per process."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if url.scheme not in ("http", "https") or not url.hostname:
        return None  # an endpoint the clients cannot use either (`hub.example` without a scheme): they say so
    host = url.hostname
    if proxied(url.scheme, host):
        return None
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
    except ValueError:  # a malformed port in HF_ENDPOINT: the clients will say so themselves
        return None
    try:
        connect(host, port, timeout)
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        return f"the Hugging Face hub ({host}:{port}) is not reachable from here: {why}"
    return None


def connect(host: str, port: int, timeout: float) -> None:
    """One TCP connection to host:port, closed, within `timeout` s name resolution included: socket.create_connection
    bounds the connect only, and getaddrinfo waits on a nameserver that does not answer (an offline box's: 5 s per
    try and server) for as long as the resolver's own settings say. Raises OSError (TimeoutError) otherwise."""
    end = time.monotonic() + timeout
    found: dict = {}

    def resolve():
        try:
            found["addrs"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            found["error"] = e

    t = threading.Thread(target=resolve, daemon=True)  # left to finish on its own where it outlives the timeout
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"its name did not resolve within {timeout:g} s")
    if "error" in found:
        raise found["error"]
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, addr in found["addrs"]:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(max(end - time.monotonic(), 1e-3))
            try:
                s.connect(addr)
                return
            except OSError as e:
                error = e
    raise error


_LOCK = threading.Lock()
_HELD: list = []  # [(module, name, value before the first block)] while any block is open
_DEPTH = 0  # the open blocks, of every thread


@contextlib.contextmanager
def cache_only():
    """Inside the block, huggingface_hub, transformers and datasets read their caches only, as with HF_HUB_OFFLINE=1
    set before they were imported: they read the flag from module constants fixed at import, so those are set here
    and restored after (an environment variable set now would not be read). The constants are the process's: blocks
    open in several threads at once share one setting, made by the first and restored by the last to close (each
    restoring what it found left the flags set for good where two threads' blocks overlapped without nesting)."""
    global _DEPTH
    import huggingface_hub.constants as hub_constants

    targets = [hub_constants]
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        import datasets.config  # it keeps its own copy of the flag, read by load_dataset

        targets.append(datasets.config)
    with _LOCK:
        if _DEPTH == 0:
            # datasets' older releases read HF_DATASETS_OFFLINE, newer ones HF_HUB_OFFLINE (the other kept as an alias)
            _HELD[:] = [(t, name, getattr(t, name)) for t in targets
                        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(t, name)]
            for t, name, _ in _HELD:
                setattr(t, name, True)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                for t, name, value in _HELD:
                    setattr(t, name, value)
                _HELD.clear()


def offline_if_unreachable():
    """A context that loads from the caches only where the hub cannot be reached (`unreachable`), else a no-op: wrap
    a hub load in it so an offline box answers from its cache, or fails, at once."""
    if hub_offline() or unreachable() is None:  # offline by choice: the clients already read their caches only
        return contextlib.nullcontext()
    return cache_only()


def blocked() -> str | None:
    """Why a load from the hub would wait on a network that is not there (`unreachable`), or None: the hub answers,
    or the clients run offline by choice (HF_HUB_OFFLINE: they fail at once themselves). For what no cache serves,
    a streamed dataset: refuse it with this reason instead of waiting through the client's retries."""
    return None if hub_offline() else unreachable()
