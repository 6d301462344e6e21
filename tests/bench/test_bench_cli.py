from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from snlp.apps.cli import main

TINY = ["--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97", "--warmup", "1", "--runs", "3"]


def test_bench_writes_records_for_sequential_and_each_plan(tmp_path, capsys):
    out = tmp_path / "sub" / "out.json"
    rc = main(["bench", *TINY, "--tokens", "3", "--window-pattern", "SL",
               "--plans", "1xF2-h0-K1,2xF1-fwd-K1-none", "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())
    assert [r["plan"] for r in records] == ["sequential", "1xF2-h0-K1", "2xF1-fwd-K1-none"]
    for r in records:
        assert {"plan", "median_ms", "speedup", "ideal_layer_speedup"} <= r.keys() and "ideal_speedup" not in r
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["runs"] == 3
        assert r["speedup"] == pytest.approx(records[0]["median_ms"] / r["median_ms"])  # sequential over plan
    assert records[1]["ideal_layer_speedup"] == 4 / 3 and records[2]["ideal_layer_speedup"] == 4 / 4  # L/(S+K+fwd)
    table = capsys.readouterr().out
    assert "1xF2-h0-K1" in table and "ideal" in table


def test_bench_rejects_bad_plans_with_a_message(capsys):
    assert main(["bench", *TINY, "--plans", "3xF2-h0-K1"]) == 2
    err = capsys.readouterr().err
    assert "snlp bench: error:" in err and "model has only L = 4" in err
    assert main(["bench", *TINY, "--plans", "2xF1-h9"]) == 2
    assert "unknown part 'h9'" in capsys.readouterr().err


def test_console_entry_point_runs_as_a_module():
    res = subprocess.run([sys.executable, "-m", "snlp", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--plans" in res.stdout and "--compile" in res.stdout


def test_bench_csv_is_written_from_the_same_records_as_the_json(tmp_path):
    js, cs = tmp_path / "out.json", tmp_path / "out.csv"
    assert main(["bench", *TINY, "--tokens", "2", "--plans", "2xF1-h0-K1", "--json", str(js), "--csv", str(cs)]) == 0
    records = json.loads(js.read_text())
    with cs.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["plan"] for r in rows] == [r["plan"] for r in records] == ["sequential", "2xF1-h0-K1"]
    assert list(rows[0].keys()) == list(records[0].keys())  # one writer per format, the records' keys
    assert float(rows[1]["median_ms"]) == pytest.approx(records[1]["median_ms"])


def test_bench_ops_records_every_op_and_its_ratio_to_forward(tmp_path):
    out = tmp_path / "ops.json"
    assert main(["bench", "--ops", *TINY, "--tokens", "1,2", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["tokens"] for r in records] == [1, 2] and all(r["layer"] == 2 for r in records)  # L // 2
    for r in records:
        for op in ("forward", "fd", "jvp", "vjp", "fd_extra"):
            assert r[f"{op}_ms"] > 0 and r[f"{op}_ratio"] == pytest.approx(r[f"{op}_ms"] / r["forward_ms"])


def test_distributed_rows_keep_the_library_records_keys():
    """apps.dist types distributed_benchmark's dicts: its JSON keeps every key and value, plus rank 0's context."""
    from snlp.apps.dist import DistDecodeRow, DistPrefillRow, dist_bench_row

    base = dict(plan="2xF1-h0-K1", world_size=2, tokens=1, batch=1, runs=3, chunks_per_rank=[[0], [1]],
                max_rank_bytes=10, memory_per_rank=[{"total_bytes": 10}, {"total_bytes": 9}])
    ctx = dict(loadavg=["0.1", "0.2", "0.3"], pinned=True, threads=1)
    prefill = {**base, "what": "prefill", "pipeline_sequential_ms": 2.0, "snlp_ms": 1.0, "speedup": 2.0,
               "h_S_broadcast_ms": 0.1, "prefix_ms_rank0": 0.0}
    decode = {**base, "what": "decode", "mode": "speculative", "block": 4, "ms_per_token": 1.0,
              "speedup_vs_pipeline": 1.5, "matches_sequential": True, "prompt_len": 16, "new_tokens": 8,
              "alpha": 0.5, "tokens_per_round": 2.0, "draft_ms_per_step": 0.3, "verify_ms_per_round": 0.9}
    for rec, cls in ((prefill, DistPrefillRow), (decode, DistDecodeRow)):
        row = dist_bench_row(rec, **ctx)
        assert isinstance(row, cls) and row.to_dict().items() >= {**rec, **ctx}.items()
    with pytest.raises(TypeError):  # a key the row does not know is an error, not silently dropped
        dist_bench_row({**prefill, "new_key": 1}, **ctx)


def test_distributed_speedups_carry_their_noise_rule():
    """bench --distributed times prefill's two sides one loop after the other (not paired): its speedup carries the
    range the p10-p90 spreads allow, a tie where it holds 1; decode runs every mode once per round (paired): the sign
    test's verdict over the runs."""
    from snlp.apps.dist import dist_bench_row

    base = dict(plan="2xF1-h0-K1", world_size=2, tokens=1, batch=1, runs=3, chunks_per_rank=[[0], [1]],
                max_rank_bytes=10, memory_per_rank=[{"total_bytes": 10}, {"total_bytes": 9}])
    ctx = dict(loadavg=[], pinned=False, threads=1)
    prefill = {**base, "what": "prefill", "pipeline_sequential_ms": 2.0, "snlp_ms": 1.5, "speedup": 2.0 / 1.5,
               "h_S_broadcast_ms": 0.1, "prefix_ms_rank0": 0.0}
    # [1, 2, 3]: p10 = 1 + 0.1 x 2 = 1.2, p90 = 2.8 (inclusive); over a flat 1.5: 0.8 .. 1.87, which holds 1
    tie = dist_bench_row({**prefill, "pipeline_sequential_times_ms": [1.0, 2.0, 3.0], "snlp_times_ms": [1.5] * 3},
                         **ctx)
    assert (tie.speedup_lo, tie.speedup_hi, tie.speedup_tie) == (pytest.approx(0.8), pytest.approx(2.8 / 1.5), True)
    # separated spreads: a difference from 4 timings a side; 3 and 3 separate by chance one time in ten (a tie)
    apart = dist_bench_row({**prefill, "pipeline_sequential_times_ms": [2.0] * 4, "snlp_times_ms": [1.0] * 4}, **ctx)
    assert (apart.speedup_lo, apart.speedup_hi, apart.speedup_tie) == (2.0, 2.0, False)
    few = dist_bench_row({**prefill, "pipeline_sequential_times_ms": [2.0] * 3, "snlp_times_ms": [1.0] * 3}, **ctx)
    assert (few.speedup_lo, few.speedup_hi, few.speedup_tie) == (2.0, 2.0, True)
    decode = {**base, "what": "decode", "mode": "snlp", "block": None, "ms_per_token": 1.0,
              "speedup_vs_pipeline": 2.0, "matches_sequential": False, "prompt_len": 16, "new_tokens": 8,
              "ms_per_token_runs": [1.0] * 6, "sequential_ms_per_token_runs": [2.0] * 6}
    row = dist_bench_row(decode, **ctx)  # 6 of 6 paired runs faster: p = 2 / 64
    assert (row.speedup_verdict, row.speedup_wins, row.speedup_p) == ("faster", 6, pytest.approx(2 / 64))
    row = dist_bench_row({**decode, "ms_per_token_runs": [1.0] * 5 + [3.0]}, **ctx)  # 5 of 6: p = 0.22
    assert (row.speedup_verdict, row.speedup_wins, row.speedup_losses) == ("tie", 5, 1)


def test_bench_decode_refuses_a_plan_that_cannot_batch_before_any_work(monkeypatch, capsys):
    """`snlp bench --decode --batch-sizes 1,2 --plans ...-diag` decoded every reference, bound the drafters and timed
    the batch-1 rows before the batch-2 speculative rows refused the plan: now one line before the model is built,
    and batch_decode_benchmark itself checks before any work."""
    import snlp.bench.decode as D
    import snlp.bench.forward as F
    from snlp.bench.decode import batch_decode_benchmark
    from snlp.method.plan import Plan
    from conftest import make_model

    def work(*a, **k):
        raise AssertionError("work began before the plans were checked")
    monkeypatch.setattr(F, "build_model", work)
    assert main(["bench", *TINY, "--decode", "--batch-sizes", "1,2", "--plans", "2xF1-h0-K1-diag"]) == 2
    err = capsys.readouterr().err.strip()
    assert "batched decoding supports the idn, none and hcn surrogates (--batch-sizes 1 runs it)" in err, err
    assert "\n" not in err
    monkeypatch.setattr(D, "sequential_step", work)
    with pytest.raises(ValueError, match="the newton surrogate's probes"):
        batch_decode_benchmark(make_model(n_layer=4), [Plan.parse("2xF1-h0-K1-newton")], batch_sizes=(1, 2))


def test_bench_decode_of_one_new_token_says_alpha_was_not_measured(tmp_path, capsys):
    """`snlp bench --decode --new-tokens 1` crashed ("acceptance rate alpha must lie in [0, 1] (got nan)"): the
    prefill gives the only token, so no round drafts. Now its speculative rows keep their timing, alpha, s and the
    ideal are None (null in the JSON) and a line under the table says why; the batched rows likewise."""
    out = tmp_path / "d.json"
    assert main(["bench", *TINY, "--decode", "--new-tokens", "1", "--prompt-len", "4", "--plans", "2xF2-h0-K1",
                 "--json", str(out)]) == 0
    spec = [r for r in json.loads(out.read_text()) if r["mode"] == "speculative"]
    assert spec and all(r["alpha"] is None and r["drafter_speedup_s"] is None and r["ideal_ssd_speedup"] is None
                        and r["tokens_per_round"] == 1.0 and r["ms_per_token"] > 0 for r in spec)
    assert "alpha, s and SSD ideal: not measured (--new-tokens 1: the prefill gives the first token" in \
        capsys.readouterr().out
    assert main(["bench", *TINY, "--decode", "--new-tokens", "1", "--prompt-len", "4", "--plans", "2xF2-h0-K1",
                 "--batch-sizes", "1,2", "--json", str(out)]) == 0
    assert all(r["alpha"] is None for r in json.loads(out.read_text()))
    assert "alpha: not measured (--new-tokens 1" in capsys.readouterr().out


def test_bench_decode_applies_the_repetition_penalty_to_every_row(tmp_path, capsys, monkeypatch):
    """`snlp bench --decode --repetition-penalty P` (one prompt and --batch-sizes): every decode call of every row,
    the sequential reference's included, decodes with P (so "=seq" compares the same decoding), the rows record P
    and the title says it; a bad P is refused before the model is built, and runs that decode nothing refuse it."""
    import snlp.bench.decode as D
    import snlp.bench.forward as F

    seen = []
    for name in ("sequential_generate", "snlp_generate", "speculative_generate"):
        real = getattr(D, name)
        monkeypatch.setattr(D, name, lambda *a, real=real, **k: seen.append(k.get("repetition_penalty")) or real(*a, **k))
    out = tmp_path / "d.json"
    for extra in ([], ["--batch-sizes", "1,2"]):
        seen.clear()
        assert main(["bench", *TINY, "--decode", "--new-tokens", "6", "--prompt-len", "4", "--plans", "4xF1-h0-K1",
                     "--repetition-penalty", "1.3", "--json", str(out), *extra]) == 0
        rows = json.loads(out.read_text())
        assert seen and set(seen) == {1.3}, seen
        # and its source, as generate --json records it (the rows named the value alone)
        assert all((r["repetition_penalty"], r["repetition_penalty_source"]) == (1.3, "flag") for r in rows)
        assert all(r["matches_sequential"] for r in rows if r["mode"] != "snlp")
        assert "repetition penalty 1.3 on every row" in capsys.readouterr().out
    assert main(["bench", *TINY, "--decode", "--new-tokens", "2", "--prompt-len", "4", "--plans", "4xF1-h0-K1",
                 "--json", str(out)]) == 0
    assert {(r["repetition_penalty"], r["repetition_penalty_source"]) for r in json.loads(out.read_text())} == \
        {(1.0, "default")}
    monkeypatch.setattr(F, "build_model", lambda *a, **k: pytest.fail("the model was built before the refusal"))
    assert main(["bench", *TINY, "--decode", "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty must be a finite number > 0" in capsys.readouterr().err
    assert main(["bench", *TINY, "--repetition-penalty", "1.3"]) == 2
    assert "--repetition-penalty is not read by `snlp bench`" in capsys.readouterr().err


@pytest.mark.parametrize("decode", [False, True])
def test_a_preheat_plan_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys, decode):
    """The forward and decode benchmarks bind their plans without a calibration: a -preheat- plan reached the solve
    after the model was built and was refused there, asking for `snlp calibrate CKPT` then load_preheat, also for a
    --ckpt that `snlp calibrate` had given its preheat.pt (here a nanochat checkpoint, which only `snlp bench` takes).
    It is refused in one line before any model is built, naming the plan."""
    import shutil
    from pathlib import Path

    import snlp.bench.forward as forward

    ckpt = tmp_path / "nc"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "nanochat" / "nanochat-L", ckpt)
    assert main(["calibrate", str(ckpt), "--rank", "4", "--batch", "2", "--seq-len", "16"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(forward, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    extra = ["--decode", "--new-tokens", "2"] if decode else []
    for argv in (["--ckpt", str(ckpt)], TINY):
        assert main(["bench", *argv, *extra, "--plans", "2xF1-h0-K1,3xF1-preheat-K1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "3xF1-preheat-K1: snlp bench times plans without a preheat calibration" in err[0]


def test_the_decode_suite_refuses_a_preheat_plan_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """--suite decode --suite-plans with a -preheat- plan loaded the checkpoint (its calibration beside it) and then
    failed in the solve asking for `snlp calibrate`: refused in one line before the load, as the other benchmarks."""
    import shutil
    from pathlib import Path

    import snlp.bench.decode_suite as suite

    ckpt = tmp_path / "nc"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "nanochat" / "nanochat-L", ckpt)
    assert main(["calibrate", str(ckpt), "--rank", "4", "--batch", "2", "--seq-len", "16"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(suite, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["bench", "--suite", "decode", "--ckpt", str(ckpt), "--quick", "--out", str(tmp_path / "ds"),
                 "--suite-plans", "3xF1-preheat-K1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3xF1-preheat-K1: snlp bench times plans without a preheat calibration" in err[0], err


def test_a_signal_in_the_programs_teardown_keeps_the_finished_runs_status(tmp_path):
    """A SIGTERM after `snlp bench` had written its files complete but before the interpreter had torn down (1.5-2.5
    s for the decode suite: torch's and transformers' finalisers) ended the program with 143, which a requeue script
    reruns; docs/benchmarks.md promises status 0 for a run that had finished. The program here signals itself right
    after main() returned, as a Slurm time limit arriving then would."""
    import os

    out = tmp_path / "b.json"
    prog = ("import os, signal, sys, time\n"
            f"sys.argv = ['snlp', 'bench', '--depth', '2', '--width', '32', '--head-dim', '16', '--tokens', '1', "
            f"'--plans', '1xF1-h0-K1', '--warmup', '0', '--runs', '1', '--json', {str(out)!r}]\n"
            "from snlp.apps.cli import main\n"
            "rc = main()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.5)\n"
            "sys.exit(rc)\n")
    run = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert json.loads(out.read_text())[0]["plan"] == "sequential"


def test_bench_decode_json_keeps_the_steps_behind_s(tmp_path):
    """bench --decode's s is median(sequential step) / median(drafter step) over the timed runs, but its record kept
    the two medians and the paired per-run ratios only: the runs' steps now stand in the JSON, and s and both medians
    recompute from them."""
    from statistics import median

    out = tmp_path / "d.json"
    assert main(["bench", *TINY, "--decode", "--new-tokens", "4", "--prompt-len", "4", "--plans", "2xF1-h0-K1",
                 "--blocks", "2", "--json", str(out)]) == 0
    spec = [r for r in json.loads(out.read_text()) if r["mode"] == "speculative"]
    assert len(spec) == 1
    r = spec[0]
    seq, draft = r["sequential_ms_per_step_runs"], r["drafter_ms_per_step_runs"]
    assert len(seq) == len(draft) == 3
    assert (median(seq), median(draft)) == pytest.approx((r["sequential_ms_per_step"], r["drafter_ms_per_step"]))
    assert r["drafter_speedup_s"] == pytest.approx(median(seq) / median(draft))
    assert r["drafter_speedup_rounds"] == pytest.approx([a / b for a, b in zip(seq, draft)])
