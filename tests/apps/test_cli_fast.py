"""`snlp --help`, `snlp CMD --help` and argument errors answer without importing torch (it took seconds to load
before any argument was read); the commands' lists that stand in for the library's constants agree with them."""

import subprocess
import sys
from pathlib import Path

import pytest

from snlp.apps.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
FAST = list(COMMANDS)  # adapt, analyze, calibrate and tune loaded torch for --help too, until their flags' defaults
# stood in for the library's (test_stand_in_defaults_equal_the_librarys)
PROBE = ("import sys\nfrom snlp.apps.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")


def probe(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("argv", [["--help"], ["bogus"], *[[c, "--help"] for c in FAST],
                                  ["train", "--bogus-flag"], ["eval", "ckpt", "--runs", "x"],
                                  ["bench", "--bogus-flag"], ["bench", "--runs", "x"], ["speedrun"],
                                  ["speedrun", "--out", "o", "--budget", "x"]])
def test_help_and_argument_errors_do_not_import_torch(argv):
    r = probe(*argv)
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH", r.stderr
    if argv == ["--help"]:
        for c in FAST:
            assert f"    {c}" in r.stdout  # every command is listed with its summary
    if argv[-1].startswith("--bogus") or argv in (["bogus"], ["speedrun"]) or "x" in argv:
        assert "error" in r.stderr


def test_stand_in_constants_equal_the_librarys():
    import snlp.apps.adapt as adapt
    import snlp.apps.analyze as analyze
    import snlp.apps.calibrate as calibrate
    import snlp.apps.convert as convert
    import snlp.apps.generate as generate
    import snlp.apps.sft as sft
    import snlp.eval.analysis.common as analysis
    import snlp.method.preheat as preheat
    import snlp.train.adapt as adapting
    from snlp.decode.generate import MODES
    from snlp.io.hf import SUPPORTED
    from snlp.train.sft import SEQUENTIAL

    assert generate.MODES == MODES and convert.SUPPORTED == SUPPORTED and sft.SEQUENTIAL == SEQUENTIAL
    assert (adapt.KV_MODES, adapt.LOSS_ON, adapt.SAVE_EVERY) == (adapting.KV_MODES, adapting.LOSS_ON,
                                                                 adapting.SAVE_EVERY)
    assert analyze.SECTIONS == analysis.SECTIONS and calibrate.FILENAME == preheat.FILENAME
    assert analyze.USED_BY["seq_len"] == analysis.WINDOWED  # the refusal and the past-the-context warning agree


@pytest.mark.parametrize("name, config", [("adapt", "snlp.train.adapt:AdaptConfig"),
                                          ("analyze", "snlp.eval.analysis.common:AnalysisConfig"),
                                          ("calibrate", "snlp.method.preheat:CalibrateConfig"),
                                          ("tune", "snlp.bench.tune:TuneConfig")])
def test_stand_in_defaults_equal_the_librarys(name, config):
    """A flag named as a field of the config the command builds defaults to that field's default (the commands
    write them out so that --help loads no torch); `--blocks 2,3,4` stands for a tuple (2, 3, 4), None for ()."""
    import dataclasses
    import importlib

    modname, cls = config.split(":")
    fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(modname), cls))}
    sub = build_parser(name).commands[name]
    checked = 0
    for a in sub._actions:
        f = fields.get(a.dest)
        if f is None or f.default is dataclasses.MISSING:
            continue
        default = a.default
        if isinstance(f.default, tuple):  # a comma-separated list, None for none
            default = tuple(int(x) if x.isdigit() else x for x in (a.default or "").split(",") if x)
        assert default == f.default, f"snlp {name} --{a.dest.replace('_', '-')}: {a.default!r} != {f.default!r}"
        checked += 1
    assert checked >= 3


def test_the_library_still_loads_on_use():
    r = subprocess.run([sys.executable, "-c", "import sys, snlp\nassert 'torch' not in sys.modules\n"
                        "print(snlp.GPT.__module__, snlp.Plan.parse('4xF1-h0-K1'), 'torch' in sys.modules)\n"
                        "print(sorted(set(snlp.__all__) - set(dir(snlp))))"],
                       cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.stdout.splitlines() == ["snlp.model.gpt 4xF1-h0-K1 True", "[]"], r.stderr


@pytest.mark.parametrize("argv, typed", [
    (["train", "--out", "x", "--resume", "--steps", "5"], {"out", "resume", "steps"}),
    (["train", "--out=x", "--res", "--reg-r", "0.5", "--seq-len", "256"], {"out", "resume", "reg_rows", "seq_len"}),
    (["sft", "ck", "--data", "d", "--out", "o", "--no-reg-detach"], {"ckpt", "data", "out", "reg_detach"}),
    (["sft-grid", "ck", "--data", "d", "--plan", "p", "--out", "o", "--task", "a", "--task", "b"],
     {"ckpt", "data", "plan", "out", "task"}),
    (["adapt", "--out", "d", "--resume"], {"out", "resume"}),  # an optional positional left out: not typed
    (["adapt", "base", "--out", "d", "--resume"], {"src", "out", "resume"}),
])
def test_given_flags_are_the_ones_typed_even_at_their_default_value(argv, typed):
    """What `--resume` keeps from the saved run hangs on this: a flag typed at its default value (--seq-len 256)
    counts as typed, abbreviations and --flag=value are argparse's own, and the parsed values are untouched."""
    from snlp.apps.cli import build_parser, command_of, given_flags

    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    before = dict(vars(args))
    assert given_flags(parser, argv, args) == typed
    assert vars(args) == before
    if "task" in typed:
        assert args.task == ["a", "b"]
