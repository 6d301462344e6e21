"""Hub loads on a box that cannot reach the hub (snlp.io.hub): the probe's answers, the caches read at once instead of
after the hub client's retries, and one-line refusals for what no cache holds."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import snlp.io.hub as hub

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def probe(monkeypatch):
    """unreachable() asked afresh (it is cached per process), with no proxy and no offline flag set."""
    for v in (*hub.PROXY_VARS, "NO_PROXY", "no_proxy", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    fn = hub.unreachable  # (a test may replace the module's name before this teardown runs)
    fn.cache_clear()
    yield fn
    fn.cache_clear()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: nothing listens there


def test_the_probe_tells_a_listening_endpoint_from_a_closed_one(probe, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert probe() is None
    probe.cache_clear()
    port = closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    why = probe()
    assert why is not None and f"127.0.0.1:{port}" in why and "not reachable" in why
    probe.cache_clear()
    monkeypatch.setenv("HF_ENDPOINT", f"https://127.0.0.1:{port}")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # a direct connection says nothing there
    assert probe() is None


def test_the_probe_follows_the_clients_proxies(probe, monkeypatch):
    """HTTP_PROXY carries an http:// endpoint's requests: the probe's direct connection said unreachable, and a hub id
    the cache lacked was refused though the clients would have fetched it. NO_PROXY naming the host: they connect
    directly, so the probe asks."""
    port = closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert probe() is None
    probe.cache_clear()
    monkeypatch.setenv("HF_ENDPOINT", f"https://127.0.0.1:{port}")  # HTTP_PROXY does not carry https
    assert "not reachable" in probe()
    probe.cache_clear()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert "not reachable" in probe()


def test_the_probes_timeout_bounds_the_name_resolution_too(probe, monkeypatch):
    """socket.create_connection's timeout bounds the connect only: a nameserver that does not answer held the probe
    for the resolver's own timeouts (5 s per try and server), past the probe's. Here a resolver that answers only when
    the test lets it: the probe returns first, saying the name did not resolve."""
    release = threading.Event()
    real = socket.getaddrinfo

    def stuck(host, *a, **k):
        if host == "hub.invalid":
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    try:
        why = probe(0.05)
        answered_first = not release.is_set()
    finally:
        release.set()
    assert answered_first and "hub.invalid:443" in why and "did not resolve within 0.05 s" in why


def test_cache_only_sets_the_clients_flags_and_restores_them():
    import datasets.config
    import huggingface_hub.constants as constants

    before = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    with hub.cache_only():
        assert constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE is True
        from huggingface_hub import is_offline_mode

        assert is_offline_mode()  # what transformers asks
    assert (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before


def test_cache_only_in_two_threads_restores_the_flags_when_the_last_block_closes():
    """Each block restored what it found: thread A's block opened, then B's (finding the flags set), A's closed
    (restoring them), B's closed (setting them again): the hub stayed offline for the rest of the process."""
    import huggingface_hub.constants as constants

    before = constants.HF_HUB_OFFLINE
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with hub.cache_only():
            a_in.set()
            b_in.wait(60)
        a_out.set()

    def b():
        a_in.wait(60)
        with hub.cache_only():
            b_in.set()
            a_out.wait(60)
            seen["b after a closed"] = constants.HF_HUB_OFFLINE  # B's block is still open: offline still

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen == {"b after a closed": True}
    assert constants.HF_HUB_OFFLINE == before


def test_cache_only_restores_the_flags_after_an_exception():
    import huggingface_hub.constants as constants

    before = constants.HF_HUB_OFFLINE
    with pytest.raises(KeyError):
        with hub.cache_only():
            with hub.cache_only():
                raise KeyError("x")
    assert constants.HF_HUB_OFFLINE == before


def test_a_hub_id_no_cache_holds_is_refused_at_once_where_the_hub_is_unreachable(monkeypatch):
    from snlp.io.source import missing_source

    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)

    monkeypatch.setattr(hub, "unreachable", lambda timeout=3.0: "the hub (h:443) is not reachable from here: test")
    why = missing_source("nosuchorg-x9/nosuchmodel-x9", "model")
    assert why is not None and "not in the hub cache" in why and "not reachable" in why


def test_a_task_from_the_hub_fails_at_once_where_the_hub_is_unreachable(monkeypatch):
    pytest.importorskip("datasets")
    import datasets.config

    from snlp.io.mctasks import load_task

    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(hub, "unreachable", lambda timeout=3.0: "the hub (h:443) is not reachable from here: test")
    before = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(ValueError, match="not reachable from here: test, and datasets' cache does not hold it"):
        load_task("arc-easy")
    assert datasets.config.HF_HUB_OFFLINE == before


def arc_easy_cache(root: Path) -> Path:
    """datasets' cache of allenai/ai2_arc ARC-Easy (3 test questions) under `root`, as a load from the hub leaves it:
    a json build's arrow file and info, under the hub dataset's folder and config name. Returns the arrow file."""
    import datasets

    rows = [dict(id=f"q{i}", question=f"What is {i}?", answerKey="B",
                 choices=dict(text=["a", "b", "c", "d"], label=["A", "B", "C", "D"])) for i in range(3)]
    src = root / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = datasets.load_dataset_builder("json", data_files={"test": str(src)}, cache_dir=str(root / "build"))
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    into = root / "datasets" / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / "abc123"
    into.mkdir(parents=True)
    info = json.loads((built / "dataset_info.json").read_text())
    (into / "dataset_info.json").write_text(json.dumps(dict(info, config_name="ARC-Easy", dataset_name="ai2_arc")))
    arrow = into / "ai2_arc-test.arrow"
    arrow.write_bytes((built / "json-test.arrow").read_bytes())
    return arrow


@pytest.fixture
def arc_cache(tmp_path, monkeypatch):
    """An unreachable hub and datasets' cache holding ARC-Easy."""
    pytest.importorskip("datasets")
    import datasets.config

    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    arrow = arc_easy_cache(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(hub, "unreachable", lambda timeout=3.0: "the hub (h:443) is not reachable from here: test")
    return arrow


def test_a_task_datasets_cache_holds_loads_where_the_hub_is_unreachable(arc_cache):
    from snlp.io.mctasks import load_task

    qs = load_task("arc-easy")
    assert [q.question for q in qs] == ["What is 0?", "What is 1?", "What is 2?"] and {q.answer for q in qs} == {1}


def test_a_broken_task_cache_is_said_as_it_is_not_as_a_missing_one(arc_cache):
    """Every error under an unreachable hub read "datasets' cache does not hold it", a truncated arrow file too."""
    from snlp.io.mctasks import load_task

    arc_cache.write_bytes(arc_cache.read_bytes()[:100])
    with pytest.raises(ValueError) as e:
        load_task("arc-easy")
    assert "not reachable from here: test; datasets' cache: ArrowInvalid" in str(e.value)
    assert "does not hold it" not in str(e.value)


class Counter(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_HEAD(self):
        Counter.seen.append(self.path)
        self.send_response(404)
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


def test_a_model_the_hub_cache_holds_loads_without_a_request_where_the_hub_is_unreachable(tmp_path):
    """The hub client sent a HEAD request per file (config, weights, each optional tokenizer / chat template file),
    each retried with back-off while the network was down: 5 minutes for a cached 2-layer model. With the probe
    saying unreachable, the load asks the endpoint nothing. The endpoint here is a local server that counts requests
    (the probe is told it is unreachable), the cache a hub-layout folder written by save_pretrained."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    snap = tmp_path / "hub" / "models--tinyorg--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "hub" / "models--tinyorg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--tinyorg--tiny" / "refs" / "main").write_text("abc123")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(snap)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Counter.seen = []
    code = ("import json, snlp.io.hub as h\n"
            "h.unreachable = lambda timeout=3.0: 'the hub is not reachable from here: test'\n"
            "import snlp\n"
            "m, t = snlp.from_hf('tinyorg/tiny')\n"
            "print(json.dumps(dict(layers=m.config.n_layer, tokenizer=t is not None)))\n")
    env = {k: v for k, v in os.environ.items() if k not in (*hub.PROXY_VARS, "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                            "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path), HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
               PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == dict(layers=2, tokenizer=False)
    assert Counter.seen == []


@pytest.mark.parametrize("spec, read", [("hf:someorg/somedata", "data"), ("hf:someorg/somechats", "chat")])
def test_a_streamed_dataset_is_refused_at_once_where_the_hub_is_unreachable(monkeypatch, spec, read):
    """`--data hf:NAME` streams (no cache serves it): offline, the client retried every request before failing."""
    pytest.importorskip("datasets")
    import datasets

    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(hub, "unreachable", lambda timeout=3.0: "the hub (h:443) is not reachable from here: test")

    def no_stream(*a, **k):
        raise AssertionError("load_dataset was called")

    monkeypatch.setattr(datasets, "load_dataset", no_stream)
    from snlp.io.chat import load_conversations
    from snlp.io.data import hf_documents

    with pytest.raises(ValueError, match=f"could not stream Hugging Face dataset '{spec}': the hub .* test; use a"):
        next(hf_documents(spec)) if read == "data" else load_conversations(spec)


@pytest.mark.parametrize("env, offline", [
    ({"HF_HUB_OFFLINE": "1"}, True), ({"TRANSFORMERS_OFFLINE": "1"}, True),
    ({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, False),
    ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "yes"}, True),
    ({}, False), ({"HF_HUB_OFFLINE": "false"}, False),
])
def test_hub_offline_reads_the_flags_as_huggingface_hub_does(monkeypatch, env, offline):
    from snlp.io.source import hub_offline

    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert hub_offline() is offline
    # the reference: huggingface_hub's own reading, at its import in a fresh process
    ref = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"],
                         env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert ref.stdout.strip() == str(offline), ref.stderr[-500:]


def test_from_hf_reads_a_folder_written_with_a_tilde(tmp_path, monkeypatch):
    """`snlp.from_hf("~/dir")` passed the name check (which expands `~`) and then failed on the folder."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import snlp

    monkeypatch.setenv("HOME", str(tmp_path))
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "tiny")
    model, _ = snlp.from_hf("~/tiny")
    assert model.config.n_layer == 2


def test_an_endpoint_without_a_scheme_is_left_to_the_clients(probe, monkeypatch):
    """urlparse reads `127.0.0.1:PORT` as a path: the probe tested huggingface.co:443 instead of the endpoint given,
    and its answer named a host the clients never ask. The clients refuse such an endpoint themselves."""
    monkeypatch.setenv("HF_ENDPOINT", f"127.0.0.1:{closed_port()}")
    assert probe() is None


def test_a_partial_hub_cache_says_the_hub_was_not_asked(tmp_path):
    """A cached snapshot with config.json and no weights, the hub unreachable: the load read the cache only and
    failed with "cannot load the weights", leaving the user to guess that a reachable hub would have fetched them."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    repo = tmp_path / "hub" / "models--tinyorg--half"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, architectures=["LlamaForCausalLM"]).save_pretrained(snap)
    code = ("import snlp.io.hub as h\n"
            "h.unreachable = lambda timeout=3.0: 'the Hugging Face hub (test:443) is not reachable from here: test'\n"
            "import snlp\n"
            "try:\n"
            "    snlp.from_hf('tinyorg/half')\n"
            "except ValueError as e:\n"
            "    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k not in (*hub.PROXY_VARS, "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                            "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(ROOT),
               HF_HUB_DISABLE_TELEMETRY="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("ERR cannot load the weights of 'tinyorg/half'"), line
    assert "only the hub cache was read: the Hugging Face hub (test:443) is not reachable" in line, line
