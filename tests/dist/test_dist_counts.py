"""What layer-parallel decoding reports about itself (snlp.dist, gloo on CPU): the memory figures count the KV window a
decode holds, and the decode counters equal the single-process decoder's. fp64, tiny models, 1 and 2 ranks."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import init_gloo as _init
from conftest import make_model
from conftest import spawn_ranks as _spawn

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = "5xF1-h0-K1"  # 5 chunks: uneven blocks over 2 ranks
PROMPT_LEN, NEW = 4, 5
RUNS = 2


def _model():
    return make_model(seed=0, vocab_size=17)


def _bench_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import distributed_benchmark

    _init(rank, world, port)
    from snlp.method.plan import Plan

    recs = distributed_benchmark(_model, [Plan.parse(PLAN)], tokens=3, batch=2, warmup=0, runs=RUNS, seed=0,
                                 decode=True, prompt_len=PROMPT_LEN, new_tokens=NEW, blocks=(2, 2))
    torch.save(recs, os.path.join(out, f"bench{rank}.pt"))
    dist.destroy_process_group()


def _kv_bytes(model, layers: int, positions: int) -> int:
    cfg = model.config
    return 2 * layers * cfg.n_kv_head * positions * cfg.head_dim * model.wte.weight.element_size()


@pytest.mark.parametrize("world", [1, 2])
def test_bench_decode_rows_count_the_kv_window(world, tmp_path):
    """The decode rows' memory_per_rank / max_rank_bytes counted the weights only (kv_bytes 0) while every decode
    held a KV window of prompt + new tokens on each rank; the prefill rows run without a cache and count none."""
    _spawn(_bench_worker, world, str(tmp_path))
    recs = torch.load(tmp_path / "bench0.pt", weights_only=False)
    model = _model()
    prefill = [r for r in recs if r["what"] == "prefill"]
    decode = [r for r in recs if r["what"] == "decode"]
    assert len(prefill) == 1 and {r["mode"] for r in decode} == {"sequential", "snlp", "speculative"}
    assert all(m["kv_bytes"] == 0 for m in prefill[0]["memory_per_rank"])
    # the prefill runs --batch rows; a decode one prompt (its rows said batch 2)
    assert prefill[0]["batch"] == 2 and all(r["batch"] == 1 for r in decode)
    for r in decode:
        kv = [m["kv_bytes"] for m in r["memory_per_rank"]]
        assert sum(kv) == _kv_bytes(model, model.config.n_layer, PROMPT_LEN + NEW), r["mode"]  # every layer once
        assert min(kv) > 0
        assert r["max_rank_bytes"] == max(m["total_bytes"] for m in r["memory_per_rank"])
        assert r["max_rank_bytes"] > prefill[0]["max_rank_bytes"]


@pytest.mark.parametrize("world", [1])
def test_bench_block_named_twice_is_one_row_of_paired_runs(world, tmp_path):
    """--blocks 2,2: the single-process decode benchmark keys its runs by block (one row); the distributed one ran
    the block twice a round into the same row, whose per-run list then held 2 x runs entries paired by position
    with the sequential runs of other rounds."""
    _spawn(_bench_worker, world, str(tmp_path))
    spec = [r for r in torch.load(tmp_path / "bench0.pt", weights_only=False) if r.get("mode") == "speculative"]
    assert len(spec) == 1 and spec[0]["block"] == 2
    assert len(spec[0]["ms_per_token_runs"]) == len(spec[0]["sequential_ms_per_token_runs"]) == RUNS


STOP_AT = 3  # the callbacks below end the decode once this many tokens were streamed


def _stopper(seen: list):
    def on_tokens(new):
        seen.extend(new)
        return len(seen) >= STOP_AT
    return on_tokens


def _decode_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port, timeout_s=20.0)  # a rank left waiting fails in 20 s, not a minute
    runner = DistributedSNLP(_model(), PLAN, keep_layers=True)
    res = {}
    for mode in ("sequential", "snlp", "speculative"):
        for name, kw in (("free", dict(max_new_tokens=NEW)), ("eos", dict(max_new_tokens=NEW, eos_id=3)),
                         ("max_len", dict(max_new_tokens=NEW, max_len=PROMPT_LEN + 3))):
            r = runner.generate(list(range(1, PROMPT_LEN + 1)), mode, block=2, **kw)
            res[(mode, name)] = (r.tokens, r.stop, r.steps, r.forwards, r.step_s > 0 if r.steps else None)
        # the stop vote: the callback of one rank only (the first, the last), or of every rank with only the
        # first's saying stop
        for who in ("first", "last", "all"):
            mine = rank == 0 if who == "first" else rank == world - 1 if who == "last" else True
            cb = (_stopper([]) if rank == 0 or who != "all" else (lambda new: None)) if mine else None
            r = runner.generate(list(range(1, PROMPT_LEN + 1)), mode, NEW, block=2, on_tokens=cb)
            res[(mode, "stop-" + who)] = (r.tokens, r.stop)
    torch.save(res, os.path.join(out, f"dec{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_decode_counters_and_the_stop_vote_equal_single_process(world, tmp_path):
    """steps (single-token decode steps of sequential / snlp decoding) were never counted: 0 in every distributed
    result and in `snlp generate --distributed --json`; now they equal the single-process decoder's, with
    step_s > 0. An on_tokens callback returning True on one rank only ended that rank's decode and left the others
    waiting in the next collective (the ranks parted); now any rank's True ends every rank's decode after the same
    tokens, as the single-process decoder with that callback ends."""
    from snlp.decode import sequential_generate, snlp_generate, speculative_generate

    _spawn(_decode_worker, world, str(tmp_path))
    model = _model()
    prompt = list(range(1, PROMPT_LEN + 1))
    run = {"sequential": lambda **kw: sequential_generate(model, prompt, **kw),
           "snlp": lambda **kw: snlp_generate(model, prompt, PLAN, **kw),
           "speculative": lambda **kw: speculative_generate(model, prompt, PLAN, block=2, **kw)}
    ranks = [torch.load(tmp_path / f"dec{r}.pt") for r in range(world)]
    for mode, fn in run.items():
        for name, kw in (("free", dict(max_new_tokens=NEW)), ("eos", dict(max_new_tokens=NEW, eos_id=3)),
                         ("max_len", dict(max_new_tokens=NEW, max_len=PROMPT_LEN + 3))):
            ref = fn(**kw)
            for rk in ranks:
                tokens, stop, steps, forwards, timed = rk[(mode, name)]
                assert (tokens, stop, steps, forwards) == (ref.tokens, ref.stop, ref.steps, ref.forwards), (mode, name)
                assert timed in (True, None)
        ref = fn(max_new_tokens=NEW, on_tokens=_stopper([]))
        assert ref.stop == "on_tokens" and len(ref.tokens) < NEW  # the callback ends this decode early
        for rk in ranks:
            for who in ("first", "last", "all"):
                assert rk[(mode, "stop-" + who)] == (ref.tokens, "on_tokens"), (mode, who, world)


@pytest.mark.parametrize("seq, par, why", [
    ([10.0, 10.1], [5.0, 5.1], "2 runs a side are too few"),  # spreads clear of 1: a tie by the count alone
    ([10.0, 11.0, 10.5], [9.0, 12.0, 10.0], ": tie)"),  # spreads holding 1
])
def test_prefill_line_says_why_a_speedup_ties(seq, par, why):
    """bench --distributed printed "p10-p90 spreads allow 1.27-1.99x: tie": a range clear of 1 called a tie with no
    reason (too few runs for separated spreads to mean a difference); the line now says which rule tied it."""
    from snlp.apps.dist import dist_bench_row, prefill_line

    rec = dict(what="prefill", plan="4xF1-h0-K1", world_size=2, tokens=4, batch=1, runs=len(seq),
               chunks_per_rank=[[0, 2], [2, 4]], max_rank_bytes=1, memory_per_rank=[], pipeline_sequential_ms=10.0,
               snlp_ms=5.0, speedup=2.0, h_S_broadcast_ms=0.1, prefix_ms_rank0=0.0, pipeline_sequential_times_ms=seq,
               snlp_times_ms=par)
    row = dist_bench_row(rec, loadavg=[], pinned=False, threads=1)
    assert row.speedup_tie
    assert why in prefill_line(2, row)


def _varying_worker(rank: int, world: int, port: int, out: str, what: str) -> None:
    """The benchmark with its runs made to differ: `what` = "alpha" (speculative run 1 accepts no draft, run 2 every
    one) or "seq" (the second timed sequential run's last token changed)."""
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP, distributed_benchmark
    from snlp.method.plan import Plan

    _init(rank, world, port)
    real, seen = DistributedSNLP.generate, []

    def generate(self, prompt, mode, *a, **k):
        r = real(self, prompt, mode, *a, **k)
        if what == "alpha" and mode == "speculative":
            r.accepted = 0 if not seen else r.examined
            seen.append((r.accepted, r.examined, len(r.tokens), r.rounds))
        elif what == "seq" and mode == "sequential":
            seen.append(1)
            if len(seen) == 2:
                r.tokens = r.tokens[:-1] + [r.tokens[-1] + 1]
        return r

    DistributedSNLP.generate = generate
    recs = distributed_benchmark(_model, [Plan.parse(PLAN)], tokens=3, batch=1, warmup=0, runs=RUNS, seed=0,
                                 decode=True, prompt_len=PROMPT_LEN, new_tokens=NEW, blocks=(2,))
    torch.save((recs, seen), os.path.join(out, f"{what}{rank}.pt"))
    dist.destroy_process_group()


def test_bench_decode_alpha_comes_from_the_timed_runs_of_the_medians(tmp_path):
    """The speculative row's alpha and tokens/round were the first timed run's while its times are medians over
    every timed run: they are now pooled over those same runs (accepted / examined, tokens / rounds), each run's
    alpha recorded beside."""
    _spawn(_varying_worker, 1, str(tmp_path), "alpha")
    recs, seen = torch.load(tmp_path / "alpha0.pt", weights_only=False)
    spec = next(r for r in recs if r.get("mode") == "speculative")
    assert len(seen) == RUNS and seen[1][1] > 0
    assert spec["alpha"] == sum(a for a, *_ in seen) / sum(e for _, e, *_ in seen) > 0
    assert spec["alpha_runs"] == [a / e if e else None for a, e, *_ in seen]
    assert spec["tokens_per_round"] == sum(t for *_, t, _ in seen) / sum(r for *_, r in seen)
    # every record is the CLI's row with every key kept (a key the row lacked stopped `snlp bench --distributed
    # --decode` with a TypeError after every timing had run)
    from snlp.apps.dist import dist_bench_row

    for rec in recs:
        row = dist_bench_row(rec, loadavg=[], pinned=False, threads=1).to_dict()
        assert {k: row[k] for k in rec} == rec


def test_bench_decode_rows_match_only_a_sequential_reference_every_run_agrees_on(tmp_path):
    """=seq compared every row with sequential's first timed run only: a later sequential run that differed left the
    speculative row "identical"."""
    _spawn(_varying_worker, 1, str(tmp_path), "seq")
    recs, _ = torch.load(tmp_path / "seq0.pt", weights_only=False)
    rows = [r for r in recs if r.get("what") == "decode"]
    assert rows and not any(r["matches_sequential"] for r in rows)


def _prefix_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import distributed_benchmark
    from snlp.method.plan import Plan

    _init(rank, world, port)
    recs = distributed_benchmark(_model, [Plan.parse("6xF1-h0-K1"), Plan.parse(PLAN)], tokens=3, batch=1, warmup=0,
                                 runs=1, seed=0)
    torch.save(recs, os.path.join(out, f"prefix{rank}.pt"))
    dist.destroy_process_group()


def test_prefill_records_no_h_s_broadcast_for_a_plan_without_a_prefix(tmp_path):
    """h_S_broadcast_ms is what replicating the prefix would save: a plan with S = 0 broadcasts no h_S (every rank
    starts from x0), yet the record timed a broadcast its solve never makes; it is now 0 there, as prefix_ms_rank0."""
    _spawn(_prefix_worker, 1, str(tmp_path))
    none, some = torch.load(tmp_path / "prefix0.pt", weights_only=False)
    assert none["h_S_broadcast_ms"] == none["prefix_ms_rank0"] == 0.0
    assert some["h_S_broadcast_ms"] > 0.0 and some["prefix_ms_rank0"] > 0.0  # 5xF1 on 6 layers: S = 1


def _batch_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    runner = DistributedSNLP(_model(), PLAN)
    res = {}
    for name, prompts in (("lists", [[1, 2, 3], [4]]), ("tensors", [torch.tensor([1, 2]), torch.tensor([3])])):
        try:
            runner.generate(prompts, "snlp", max_new_tokens=2)
            res[name] = "decoded"
        except ValueError as e:
            res[name] = str(e)
    res["one"] = runner.generate([1, 2, 3], "snlp", max_new_tokens=2).tokens  # still decodes: no collective was left
    # a list of 0-d tensors is one prompt (is_batch and DecodeSession read each as an id): decoded, not refused
    res["scalars"] = runner.generate(list(torch.tensor([1, 2, 3])), "snlp", max_new_tokens=2).tokens
    torch.save(res, os.path.join(out, f"batch{rank}.pt"))
    dist.destroy_process_group()


def test_a_list_of_prompts_is_refused_as_a_batch(tmp_path):
    """The single-process decoders take a list of prompts as a ragged batch; the distributed one decodes one prompt and
    said "prompt token ids must be integers, got [1, 2, 3] (list)" (the first prompt read as a bad id): it now says it
    takes one prompt, on every rank before any collective."""
    from snlp.decode import snlp_generate

    _spawn(_batch_worker, 1, str(tmp_path))
    res = torch.load(tmp_path / "batch0.pt", weights_only=False)
    for name in ("lists", "tensors"):
        assert "distributed decoding takes one prompt (a list of token ids), got a list of 2 prompts" in res[name]
    assert res["one"] == snlp_generate(_model(), [1, 2, 3], PLAN, 2).tokens
    assert res["scalars"] == snlp_generate(_model(), list(torch.tensor([1, 2, 3])), PLAN, 2).tokens == res["one"]
