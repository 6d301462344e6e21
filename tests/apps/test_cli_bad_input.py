"""A newcomer's mistakes on the command line get one clear line before any work, and lose nothing: a --device
typo, a folder of the wrong kind where a checkpoint is expected, an --out that already holds another run."""

import pytest

from snlp.apps.cli import main


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"snlp {command}: error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("argv", [
    ["train", "--out", "{o}", "--device", "cdu"],
    ["generate", "{o}", "--device", "cdu"],
    ["eval", "{o}", "--plans", "1xF1-h0-K1", "--device", "cdu"],
    ["sft", "{o}", "--data", "chats.jsonl", "--out", "{o}/sft", "--device", "cdu"],
    ["adapt", "{o}", "--plan", "1xF1-h0-K1", "--out", "{o}/d", "--device", "cdu"],
    ["speedrun", "--out", "{o}", "--quick", "--device", "cdu"],
    ["bench", "--device", "cdu"],
    ["selfcheck", "--device", "cdu"],
])
def test_a_device_typo_is_one_line_before_any_work(argv, tmp_path, capsys):
    out = tmp_path / "o"
    rc = main([a.replace("{o}", str(out)) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and "--device 'cdu' is not a device" in line, line
    assert not out.exists()  # nothing was created


@pytest.mark.parametrize("name", ["cdu", "gpu", "cuda:x", ""])
def test_cli_device_refuses_what_torch_does_not_parse(name):
    from snlp.runtime.device import cli_device

    if name:
        with pytest.raises(ValueError, match="is not a device"):
            cli_device(name)
    assert str(cli_device("cpu")) == "cpu"


@pytest.mark.parametrize("name", ["meta", "hpu", "xpu"])
def test_cli_device_refuses_a_back_end_this_machine_lacks(name):
    """torch parses xpu, hpu and meta, but a model sent there fails after loading (an assertion, a missing module, a
    meta copy): refused up front where the back-end does not run here (meta never does)."""
    import torch

    from snlp.runtime.device import cli_device

    if getattr(getattr(torch, name, None), "is_available", lambda: False)():
        pytest.skip(f"this machine has {name}")
    with pytest.raises(ValueError, match=f"no {name} device on this machine"):
        cli_device(name)


def test_setup_dist_refuses_a_device_typo_in_one_line():
    from snlp.train.distributed import setup_dist

    with pytest.raises(ValueError, match="is not a device"):
        setup_dist("cdu")


def test_a_folder_given_as_prompts_file_is_named_a_folder(tmp_path, capsys):
    """--prompts-file FOLDER said "does not exist" of a folder that exists."""
    assert main(["generate", str(tmp_path / "ck"), "--prompts-file", str(tmp_path)]) == 2
    line = one_error_line(capsys, "generate")
    assert "is a folder; name a file" in line and "does not exist" not in line


def test_ctrl_c_in_the_speedrun_says_how_to_continue(tmp_path, capsys, monkeypatch):
    """Ctrl-C during `snlp speedrun` printed "snlp speedrun: interrupted" and nothing about the saved training or
    the stage records that a re-run of the same command picks up (it does: finished stages reused, training resumed
    from its last save)."""
    import snlp.apps.speedrun as speedrun

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(speedrun, "run", interrupted)
    assert main(["speedrun", "--out", str(tmp_path / "sr"), "--quick"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["snlp speedrun: interrupted; run the same command again to continue: finished stages are reused "
                   "and a training saved part-way resumes from its save"]
    assert main(["speedrun", "--out", str(tmp_path / "sr"), "--quick", "--force"]) == 130
    err = capsys.readouterr().err  # the same command would redo every stage: the hint says to drop --force
    assert "run the same command without --force again to continue" in err


def test_a_run_into_a_drafter_folder_is_refused(tmp_path, capsys):
    """`snlp train --out DRAFTER_DIR` wrote its log.jsonl over the drafter's and its checkpoint beside it."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "drafter.json").write_text("{}")
    (d / "log.jsonl").write_text("the drafter's log\n")
    (tmp_path / "t.txt").write_text("def f(x):\n    return x\n" * 200)
    assert main(["train", "--out", str(d), "--depth", "2", "--steps", "1", "--data", str(tmp_path / "t.txt")]) == 2
    assert "holds a drafter (snlp adapt)" in one_error_line(capsys, "train")
    assert (d / "log.jsonl").read_text() == "the drafter's log\n"
    assert sorted(p.name for p in d.iterdir()) == ["drafter.json", "log.jsonl"]


@pytest.mark.parametrize("extra,says", [
    (["--num-fewshot", "5"], "--num-fewshot is not read without --drafter, --task or --harness (it is for --harness)"),
    (["--harness-out", "h"], "--harness-out is not read without --drafter, --task or --harness"),
    (["--harness", "arc_easy", "--runs", "50", "--time-tokens", "8"],
     "--runs, --time-tokens are not read with --harness (--runs is for the LM metrics or --drafter"),
    (["--harness", "arc_easy", "--data", "x.txt"], "--data is not read with --harness"),
    (["--task", "mc:x.jsonl", "--csv", "r.csv"], "--csv is not read with --task (it is for the LM metrics)"),
    (["--drafter", "d", "--seed", "3"], "--seed is not read with --drafter"),
    (["--mc-limit", "3"], "--mc-limit is not read without --drafter, --task or --harness (it is for --task)"),
    (["--force"], "--force is not read without --drafter, --task or --harness (it is for --harness)"),
    (["--harness", "arc_easy", "--harness-block", "8"], "--harness-block is the draft block of speculative decoding"),
    (["--harness", "arc_easy", "--harness-decode", "snlp"], "without --plans there is no plan to decode"),
])
def test_eval_refuses_a_flag_its_mode_does_not_read(extra, says, tmp_path, capsys):
    """`snlp eval` has four modes (the LM metrics, --drafter, --task, --harness), each reading its own flags: a flag
    of another mode changed nothing (`--num-fewshot 5` without --harness ran the LM metrics; `--runs 50` with
    --harness ran the harness as before). One line before the checkpoint is read (here it does not even exist)."""
    rc = main(["eval", str(tmp_path / "no-such-ckpt"), *(["--plans", "1xF1-h0-K1"] if "--harness-decode" not in extra
                                                          else []), *extra])
    line = one_error_line(capsys, "eval")
    assert rc == 2 and says in line, line


@pytest.mark.parametrize("extra,says", [
    (["--mode", "sequential", "--block", "8"], "--block is the draft block of --mode speculative and jacobi"),
    (["--mode", "snlp", "--plan", "1xF1-h0-K1", "--block", "8"], "--mode snlp drafts nothing"),
    (["--mode", "sequential", "--plan", "1xF1-h0-K1"], "--mode sequential decodes with the model alone"),
    (["--mode", "snlp", "--plan", "1xF1-h0-K1", "--no-baseline"], "--mode snlp has none"),
    (["--mode", "snlp", "--plan", "1xF1-h0-K1", "--repeats", "9"], "--repeats sets the timed rounds"),
    (["--mode", "speculative", "--plan", "1xF1-h0-K1", "--no-baseline", "--repeats", "9"], "which --no-baseline skips"),
    (["--seed", "3"], "greedy decoding (--temperature 0) draws nothing"),
    (["--dist-timeout", "5"], "a single process has no peers"),
    (["--prompts-encoding", "latin-1"], "--prompts-encoding reads --prompts-file"),
])
def test_generate_refuses_a_flag_its_run_does_not_read(extra, says, tmp_path, capsys):
    """`--block 8` with sequential or snlp decoding, `--plan` with sequential, `--repeats` outside speculative's
    comparison, `--seed` with greedy decoding...: each ran and changed nothing. One line before the checkpoint is
    read (here it does not even exist)."""
    rc = main(["generate", str(tmp_path / "no-such-ckpt"), *extra])
    line = one_error_line(capsys, "generate")
    assert rc == 2 and says in line, line


@pytest.mark.parametrize("argv,says", [
    (["--suite", "paper", "--quick", "--ckpt", "{o}"], "--ckpt is not read by `snlp bench --suite paper`"),
    (["--suite", "paper", "--quick", "--plans", "1xF1-h0-K1", "--decode"], "--plans, --decode are not read by"),
    (["--suite", "train", "--quick", "--depth", "2"], "--depth is not read by `snlp bench --suite train`"),
    (["--ops", "--plans", "1xF1-h0-K1"], "--plans is not read by `snlp bench --ops`"),
    (["--decode", "--tokens", "8"], "--tokens is not read by `snlp bench --decode`"),
    (["--blocks", "2"], "--blocks is not read by `snlp bench` (the forward benchmark)"),
    (["--quick"], "--quick is not read by `snlp bench` (the forward benchmark)"),
    (["--ckpt", "{o}", "--depth", "4"], "--depth shapes a random-weights model; --ckpt"),
    (["--ops", "--decode"], "two runs, give one"),
])
def test_bench_refuses_a_flag_its_run_does_not_read(argv, says, tmp_path, capsys):
    """`snlp bench --suite paper --ckpt X` timed random weights at the paper's shapes, `--ops --plans P` one layer,
    `--ckpt X --depth 4` the checkpoint's own depth: each ran and ignored the flag. One line before any work."""
    out = tmp_path / "o"
    rc = main(["bench", *[a.replace("{o}", str(out)) for a in argv]])
    line = one_error_line(capsys, "bench")
    assert rc == 2 and says in line, line
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["eval", "{ck}", "--plans", "4xF1-h0-K1,4xF1-h0-K1-tol:-1"],
    ["eval", "{ck}", "--task", "mc:x.jsonl", "--plans", "4xF1-h0-K1-tol:-1"],
    ["eval", "{ck}", "--drafter", "{ck}", "--plans", "4xF1-h0-K1-tol:-1"],
    ["bench", "--ckpt", "{ck}", "--plans", "4xF1-h0-K1-tol:-1"],
    ["bench", "--ckpt", "{ck}", "--decode", "--plans", "4xF1-h0-K1-tol:-1"],
])
def test_a_malformed_plan_is_refused_before_the_checkpoint_loads(argv, tmp_path, capsys):
    """`snlp eval` and `snlp bench` read --plans only after loading the checkpoint (or building the model): a
    malformed plan there was refused after that work (here the checkpoint does not even exist, so the old code said
    so instead). Now one line naming the plan's bad part first."""
    assert main([a.replace("{ck}", str(tmp_path / "no-such-ckpt")) for a in argv]) == 2
    assert "tol must be a positive number, got '-1'" in one_error_line(capsys, argv[0])


@pytest.fixture(scope="module")
def depth4_unloadable(tmp_path_factory):
    """A depth-4 snlp checkpoint whose weights file is garbage: a command that loads the weights says so, so a
    refusal naming the depth proves it came from the config alone, before the load."""
    import torch

    from snlp import GPT, GPTConfig, save_checkpoint
    from snlp.io.tokenizer import Tokenizer

    m = GPT(GPTConfig.from_depth(4, head_dim=8, width=16, vocab_size=300, sequence_len=16))
    m.init_weights(seed=0)
    ck = save_checkpoint(tmp_path_factory.mktemp("depth4") / "ck", m.to(torch.float32),
                         Tokenizer.train(["to be or not to be, that is the question"] * 30, vocab_size=300))
    (ck / "model.safetensors").write_bytes(b"not safetensors")
    return ck


@pytest.mark.parametrize("argv", [
    ["generate", "{ck}", "--mode", "snlp", "--plan", "40xF1-h0-K1", "--prompt", "to be"],
    ["generate", "{ck}", "--mode", "speculative", "--plan", "2xF4-h0-K1", "--prompt", "to be"],
    ["eval", "{ck}", "--plans", "2xF1-h0-K1,40xF1-h0-K1"],
    ["eval", "{ck}", "--task", "mc:x.jsonl", "--plans", "40xF1-h0-K1"],
    ["bench", "--ckpt", "{ck}", "--plans", "40xF1-h0-K1"],
    ["bench", "--ckpt", "{ck}", "--decode", "--plans", "40xF1-h0-K1"],
    ["bench", "--suite", "decode", "--ckpt", "{ck}", "--suite-plans", "40xF1-h0-K1"],
    ["tune", "{ck}", "--plans", "40xF1-h0-K1"],
    ["adapt", "{ck}", "--plan", "40xF1-h0-K1", "--out", "{o}/d"],
    ["sft", "{ck}", "--data", "chats.jsonl", "--out", "{o}/sft", "--forward", "40xF1-h0-K1"],
    ["generate", "{ck}", "--distributed", "--mode", "snlp", "--plan", "40xF1-h0-K1", "--prompt", "to be"],
])
def test_a_plan_too_deep_for_the_checkpoint_is_refused_before_its_weights_load(argv, depth4_unloadable, tmp_path,
                                                                               capsys):
    """`--plan 40xF1-h0-K1` on a depth-4 checkpoint: refused in one line naming the depth, read from the checkpoint's
    config alone (snlp.io.checkpoint.checkpoint_depth), before its weights load (they used to load first: here
    they are garbage, so the old code reported a corrupt weights file instead), and nothing is written."""
    out = tmp_path / "o"
    rc = main([a.replace("{ck}", str(depth4_unloadable)).replace("{o}", str(out)) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and "but the model has only L = 4" in line, line
    assert not out.exists()


def test_sigterm_to_the_speedrun_unwinds_it_like_ctrl_c_and_exits_143(tmp_path, capsys, monkeypatch):
    """SIGTERM (kill, Slurm, docker stop) ended `snlp speedrun` at once: no stage unwound (its training processes
    trained on, orphaned) and no hint. It now raises in the speedrun as Ctrl-C does (the training stage then stops its
    processes, saved: tests/apps/test_speedrun.py), names the signal and exits 143; the handler is restored after."""
    import os
    import signal

    import snlp.apps.speedrun as speedrun

    def run(args):
        with speedrun.stops_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(speedrun, "run", run)
    assert main(["speedrun", "--out", str(tmp_path / "sr"), "--quick"]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["snlp speedrun: interrupted by SIGTERM; run the same command again to continue: finished stages "
                   "are reused and a training saved part-way resumes from its save"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ----------------------------------------------------------------------------- paths: a quoted `~`, empty values,
# typos of a drafter, a cache that is a file; numbers: nan; flags a run cannot honour


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A home folder holding a real tiny checkpoint `ck`, a drafter of it `drafter-8` (its own suffix: M = 1) and a
    prompts file, for the `~/...` paths the shell leaves unexpanded inside quotes and after `--flag=`."""
    from conftest import text_checkpoint

    from snlp.io.checkpoint import load
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    root = tmp_path_factory.mktemp("home")
    ck, _, _ = text_checkpoint(root)
    ck = ck.rename(root / "ck")
    model, _ = load(ck)
    save_drafter(root / "drafter-8", make_drafter(model, "2xF1-h0-K1"))
    (root / "p.txt").write_text("First Citizen:\nAll:\n")
    return root


@pytest.fixture
def in_home(home, tmp_path, monkeypatch):
    """HOME = `home`, the working directory an empty folder (where a `~` taken literally would land)."""
    monkeypatch.setenv("HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.mark.parametrize("target,from_model", [("text.txt", False), ("chats.jsonl", False),
                                               ("docs/b.txt", False), ("tuned.txt", True)])
def test_eval_drafter_output_over_its_recorded_data_is_refused(home, tmp_path, capsys, monkeypatch, target, from_model):
    """`snlp eval CKPT --drafter D --markdown DATA` wrote the table over the training text the drafter records (eval
    reads that data with no flag naming it, so the output check did not compare with it): refused in one line
    before the checkpoint loads, the file unchanged. Text, chat: and folder parts; a --from-model drafter's tuned
    split."""
    import snlp.io.checkpoint as ckpt
    from snlp.io.checkpoint import load
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    (tmp_path / "docs").mkdir()
    for name in ("text.txt", "chats.jsonl", "docs/b.txt", "tuned.txt"):
        (tmp_path / name).write_text("the user's data\n")
    data = f"{tmp_path / 'text.txt'},chat:{tmp_path / 'chats.jsonl'},{tmp_path / 'docs'}"
    record = {"config": {"data": data, "val_frac": 0.05}}
    if from_model:
        record = {"config": {"data": data, "val_frac": 0.05, "from_model": "tuned"},
                  "tuned": {"split": {"data": str(tmp_path / "tuned.txt"), "val_frac": 0.05}}}
    model, _ = load(home / "ck")
    save_drafter(tmp_path / "d", make_drafter(model, "2xF1-h0-K1"), record=record)

    def no_load(*a, **k):
        raise AssertionError("the checkpoint loaded before the refusal")

    monkeypatch.setattr(ckpt, "load", no_load)
    for flag in ("--markdown", "--json"):
        assert main(["eval", str(home / "ck"), "--drafter", str(tmp_path / "d"), flag, str(tmp_path / target)]) == 2
        assert "is a file of the data drafter" in one_error_line(capsys, "eval")
        assert (tmp_path / target).read_text() == "the user's data\n"


@pytest.mark.parametrize("target", ["text.txt", "docs/b.txt"])
def test_eval_output_over_the_checkpoints_recorded_data_is_refused(home, tmp_path, capsys, monkeypatch, target):
    """`snlp eval CKPT --plans P --json DATA` without --data reads the data the checkpoint was trained on (its
    train_state.pt), which no flag names: the table was written over it. Refused in one line before the checkpoint
    loads, the file unchanged; with --data naming other data the output may go there."""
    import snlp.io.checkpoint as ckpt
    from snlp.io.checkpoint import load, save_checkpoint

    (tmp_path / "docs").mkdir()
    for name in ("text.txt", "docs/b.txt"):
        (tmp_path / name).write_text("the user's data\n" * 50)
    (tmp_path / "other.txt").write_text("\n\n".join(f"Paragraph {i}: some other text, long enough to fill a few documents." for i in range(400)))
    model, tok = load(home / "ck")
    save_checkpoint(tmp_path / "ck", model, tok,
                    train_state={"args": {"data": f"{tmp_path / 'text.txt'},{tmp_path / 'docs'}"}})
    real = ckpt.load

    def no_load(*a, **k):
        raise AssertionError("the checkpoint loaded before the refusal")

    monkeypatch.setattr(ckpt, "load", no_load)
    for flag in ("--markdown", "--json", "--csv"):
        assert main(["eval", str(tmp_path / "ck"), "--plans", "1xF1-h0-K1", flag, str(tmp_path / target)]) == 2
        assert "is a file of the data checkpoint" in one_error_line(capsys, "eval")
        assert (tmp_path / target).read_text() == "the user's data\n" * 50
    monkeypatch.setattr(ckpt, "load", real)
    assert main(["eval", str(tmp_path / "ck"), "--plans", "1xF1-h0-K1", "--data", str(tmp_path / "other.txt"),
                 "--max-tokens", "64", "--seq-len", "16", "--json", str(tmp_path / target)]) == 0


def test_eval_drafter_without_a_split_refuses_an_output_over_the_checkpoints_recorded_data(home, tmp_path, capsys,
                                                                                            monkeypatch):
    """A drafter that records no adaptation split (made by make_drafter, saved by hand) is measured on the
    checkpoint's recorded training data (run_drafter_eval), which no flag names: `--json DATA` was written over it.
    Refused in one line before the checkpoint loads, the file unchanged."""
    import snlp.io.checkpoint as ckpt
    from snlp.io.checkpoint import load, save_checkpoint

    (tmp_path / "text.txt").write_text("the user's data\n" * 50)
    model, tok = load(home / "ck")
    save_checkpoint(tmp_path / "ck", model, tok, train_state={"args": {"data": str(tmp_path / "text.txt")}})

    def no_load(*a, **k):
        raise AssertionError("the checkpoint loaded before the refusal")

    monkeypatch.setattr(ckpt, "load", no_load)
    for flag in ("--markdown", "--json"):
        assert main(["eval", str(tmp_path / "ck"), "--drafter", str(home / "drafter-8"), flag,
                     str(tmp_path / "text.txt")]) == 2
        assert "is a file of the data checkpoint" in one_error_line(capsys, "eval")
        assert (tmp_path / "text.txt").read_text() == "the user's data\n" * 50


@pytest.mark.parametrize("argv", [
    ["generate", "~/ck", "--prompt", "All:", "--max-new-tokens", "2", "--json", "~/g.json"],
    ["generate", "--prompts-file=~/p.txt", "~/ck", "--max-new-tokens", "2", "--json=~/g.json"],
    ["generate", "~/ck", "--mode", "speculative", "--drafter", "~/drafter-8", "--no-baseline", "--max-new-tokens", "2",
     "--json", "~/g.json"],
])
def test_a_quoted_home_is_the_home_for_inputs_and_outputs(argv, home, in_home, capsys):
    """`snlp generate '~/ck'` said "checkpoint ~/ck does not exist" (the name check found it, the loader did not),
    `--drafter '~/d'` "is not a drafter directory", `--prompts-file '~/p.txt'` "does not exist", and `--json
    '~/g.json'` passed the output check (which expanded it) and then wrote a folder named `~` in the working
    directory. Each now reads and writes under the home."""
    (home / "g.json").unlink(missing_ok=True)
    assert main(argv) == 0, capsys.readouterr().err
    assert (home / "g.json").is_file()
    assert list(in_home.iterdir()) == []  # no folder named `~`


@pytest.mark.parametrize("argv", [
    ["eval", "~/ck", "--plans", "9xF1-h0-K1"],
    ["bench", "--ckpt", "~/ck", "--plans", "9xF1-h0-K1"],
    ["tune", "~/ck", "--plans", "9xF1-h0-K1"],
    ["sft", "~/ck", "--data", "chats.jsonl", "--out", "~/sft", "--forward", "9xF1-h0-K1"],
    ["calibrate", "~/ck", "--rank", "0"],
])
def test_a_quoted_home_checkpoint_is_found_by_every_command(argv, home, in_home, capsys):
    """The commands that read a checkpoint found `~/ck` by the name check and then said it does not exist (or, where
    the plan's depth is read from its config, skipped that check). Here each gets as far as a refusal that reads the
    checkpoint's config: the depth 4 beside a 9-layer plan, or calibrate's --rank."""
    assert main(argv) == 2
    line = one_error_line(capsys, argv[0])
    assert "does not exist" not in line and ("model has only L = 4" in line or "rank" in line), line
    assert not (home / "sft").exists() and list(in_home.iterdir()) == []


def test_the_library_loads_a_checkpoint_and_drafter_under_a_quoted_home(home, in_home):
    """snlp.load('~/ck') said "does not exist" while snlp.io.source (the name check before it) expanded `~`."""
    from snlp.io.checkpoint import load
    from snlp.io.drafter import load_drafter

    model, tok = load("~/ck")
    assert tok is not None and load_drafter("~/drafter-8", model).plan.chunks == 2


@pytest.mark.parametrize("argv", [
    ["generate", "{ck}", "--mode", "speculative", "--drafter", "{home}/drafter-9", "--no-baseline"],
    ["generate", "{ck}", "--mode", "snlp", "--drafter", "{home}/drafter-9"],
    ["eval", "{ck}", "--drafter", "{home}/drafter-9"],
    ["bench", "--suite", "decode", "--ckpt", "{ck}", "--drafter", "{home}/drafter-9", "--quick", "--out", "{o}"],
    ["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", "{o}", "--init-drafter", "{home}/drafter-9"],
])
def test_a_drafter_typo_names_the_closest_drafter(argv, home, tmp_path, capsys):
    """A checkpoint typo got "does not exist; did you mean X?" (snlp.io.source), a drafter typo "is not a drafter
    directory (no drafter.json); make one with `snlp adapt`", as if the folder were there and of the wrong kind.
    Now the drafter's typo is answered as the checkpoint's, before the checkpoint loads."""
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", home=home, o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and f"drafter {home}/drafter-9 does not exist; did you mean {home}/drafter-8?" in line, line
    assert not out.exists()


def test_a_prompts_file_typo_names_the_closest_file(home, capsys):
    """`--prompts-file p.tx` said "does not exist" with no suggestion, where a checkpoint typo names the closest."""
    assert main(["generate", str(home / "ck"), "--prompts-file", str(home / "p.tx")]) == 2
    assert f"--prompts-file {home}/p.tx does not exist; did you mean {home}/p.txt?" in one_error_line(capsys, "generate")


@pytest.mark.parametrize("argv,says", [
    (["generate", "{ck}", "--prompt", "a", "--json", ""], "--json is empty"),
    (["generate", "", "--prompt", "a"], "CKPT is empty"),
    (["generate", "{ck}", "--mode", "speculative", "--drafter", "", "--plan", "2xF1-h0-K1"], "--drafter is empty"),
    (["generate", "{ck}", "--prompts-file", ""], "--prompts-file is empty"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--json", ""], "--json is empty"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--csv", " "], "--csv is empty"),
    (["bench", "--depth", "2", "--json", ""], "--json is empty"),
    (["train", "--out", "{o}", "--init-from", ""], "--init-from is empty"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", ""], "--out is empty"),
])
def test_an_empty_path_is_refused(argv, says, home, tmp_path, capsys):
    """An empty path read as the working directory, or as no path: `--json ""` ran the whole evaluation and wrote
    nothing, `generate ""` said ". is not a checkpoint". One line naming the flag, before any work."""
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and says in line, line
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["eval", "{ck}", "--plans", "2xF1-h0-K1", "--cache-dir", "{f}"],
    ["train", "--out", "{o}", "--depth", "2", "--steps", "1", "--data", "{f}", "--cache-dir", "{f}"],
    ["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", "{o}", "--steps", "1", "--cache-dir", "{f}"],
    ["tune", "{ck}", "--cache-dir", "{f}"],
])
def test_a_cache_folder_that_is_a_file_is_refused_before_any_work(argv, home, tmp_path, capsys):
    """`--cache-dir FILE` failed with a FileExistsError traceback after the model loaded and the data was read."""
    f = tmp_path / "data.txt"
    f.write_text("to be or not to be\n" * 50)
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", f=f, o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and f"--cache-dir {f} is a file; name a folder" in line, line
    assert not out.exists() and f.read_text() == "to be or not to be\n" * 50


@pytest.mark.parametrize("argv,flag", [
    (["train", "--out", "{o}", "--depth", "2", "--minutes", "nan"], "--minutes"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", "{o}", "--minutes", "nan"], "--minutes"),
    (["speedrun", "--out", "{o}", "--quick", "--budget", "nan"], "--budget"),
    (["generate", "{ck}", "--mode", "speculative", "--plan", "2xF1-h0-K1", "--min-confidence", "nan"],
     "--min-confidence"),
    (["bench", "--simulate-devices", "2", "--link-gbps", "nan"], "--link-gbps"),
])
def test_nan_is_refused_for_every_number_flag(argv, flag, home, tmp_path, capsys):
    """argparse's float() reads "nan", and a range check `x <= 0` is False for it: `--minutes nan` trained until
    killed (adapt) and `--budget nan` ran the speedrun. One rule for every float flag, before any work."""
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and f"{flag} must be a number (got nan)" in line, line
    assert not out.exists()


@pytest.mark.parametrize("argv,says", [
    (["train", "--out", "{o}", "--depth", "2", "--minutes", "inf"], "--minutes must be a finite number > 0"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", "{o}", "--minutes", "inf"],
     "--minutes must be a finite number > 0"),
    (["speedrun", "--out", "{o}", "--quick", "--budget", "inf"], "--budget must be a finite number of minutes"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", "{o}", "--steps", "0"], "--steps must be >= 1 (got 0)"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--seq-len", "0"], "--seq-len must be >= 1 (got 0"),
    (["generate", "{ck}", "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0 generates nothing"),
    # the library's own check named its argument (max_new_tokens must be an integer >= 0), not the flag
    (["generate", "{ck}", "--prompt", "a", "--max-new-tokens", "-3"], "--max-new-tokens -3 generates nothing"),
    (["generate", "{ck}", "--distributed", "--plan", "2xF1-h0-K1", "--mode", "snlp", "--prompt", "a",
      "--max-new-tokens", "0"], "--max-new-tokens 0 generates nothing"),
    (["eval", "{ck}", "--drafter", "{home}/drafter-8", "--chat-prompts", "chat:x.jsonl", "--blocks", "0"],
     "--blocks must be draft block sizes B >= 1"),
    (["eval", "{ck}", "--drafter", "{home}/drafter-8", "--chat-prompts", "chat:x.jsonl", "--blocks", "4,x"],
     "--blocks must be draft block sizes B >= 1"),
    (["eval", "{ck}", "--drafter", "{home}/drafter-8", "--chat-prompts", "chat:x.jsonl", "--prompts", "0"],
     "--prompts must be >= 1 with --chat-prompts (got 0)"),
    # the split holds out every round(1 / f)-th document, every other one at most: 0.6 held out half and said 0.6
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--val-frac", "0.6"], "--val-frac must lie in (0, 0.5]"),
    (["train", "--out", "{o}", "--depth", "2", "--val-frac", "0.75"], "--val-frac must lie in (0, 0.5]"),
    (["sft", "{ck}", "--data", "chats.jsonl", "--out", "{o}", "--val-frac", "0.9"], "--val-frac must lie in (0, 0.5]"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--out", "{o}", "--val-frac", "0.6"], "--val-frac must lie in (0, 0.5]"),
])
def test_a_number_out_of_range_is_refused_not_read_as_the_default(argv, says, home, tmp_path, capsys):
    """`adapt --steps 0` trained the default 200 steps and `eval --seq-len 0` used the default window (an `x or
    default`), `--minutes inf` had no LR schedule to follow, `generate --max-new-tokens 0` printed "0 tokens, nan
    tok/s", `eval --drafter --blocks 0` ran and `--blocks x` said "invalid literal for int()"."""
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", home=home, o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and says in line, line
    assert not out.exists()


@pytest.mark.parametrize("argv,says", [
    (["eval", "{ck}", "--drafter", "{home}/drafter-8", "--blocks", "4"], "--blocks sets the SSD decoding"),
    (["eval", "{ck}", "--drafter", "{home}/drafter-8", "--gen-tokens", "8", "--runs", "3"],
     "--gen-tokens, --runs set the SSD decoding"),
    (["train", "--out", "{o}", "--depth", "2", "--reg-lambda", "0.1"], "--reg-lambda sets the SNLP-aware regulariser"),
    (["train", "--out", "{o}", "--depth", "2", "--reg", "none", "--reg-stride", "2", "--reg-warmup", "5"],
     "--reg-stride, --reg-warmup set the SNLP-aware regulariser"),
    (["sft", "{ck}", "--data", "chats.jsonl", "--out", "{o}", "--reg-lambda", "0.1"],
     "--reg-lambda sets the SNLP-aware regulariser"),
])
def test_a_flag_the_run_does_not_read_is_refused(argv, says, home, tmp_path, capsys):
    """`eval --drafter D --blocks 4` without --chat-prompts decodes nothing (no SSD rows: the flag changed nothing),
    `train --reg-lambda 0.1` without --reg trained without the regulariser (--reg-n is read without it: the
    validation's gap_N suffixes). One line before any work."""
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", home=home, o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and says in line, line
    assert not out.exists()


def test_bench_tokens_says_why_it_is_refused(capsys):
    """argparse replaces a type function's ValueError by "invalid _token_counts value: '0'"; its ArgumentTypeError
    keeps the reason."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--tokens", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --tokens/-T: must be >= 1, got '0'" in err and "_token_counts" not in err


def test_a_generation_budget_beyond_memory_is_one_line(home, capsys):
    """`--max-new-tokens 100000000000` ended in the allocator's RuntimeError traceback ("can't allocate memory")
    after the model loaded; the KV cache now refuses a size beyond the device's memory in one line."""
    rc = main(["generate", str(home / "ck"), "--prompt", "a", "--max-new-tokens", "100000000000"])
    line = one_error_line(capsys, "generate")
    assert rc == 2 and "a KV cache of 100,000,000,00" in line and "more than the" in line, line


def test_drafter_eval_config_refuses_out_of_range_settings():
    from snlp.eval.drafter import DrafterEvalConfig

    for bad in (dict(blocks=(0,)), dict(blocks=4), dict(seq_len=0), dict(warmup=-1),
                dict(repeats=0), dict(progress="yes")):
        with pytest.raises(ValueError, match="out of range|True or False"):
            DrafterEvalConfig(**bad)
    import numpy as np

    assert DrafterEvalConfig(blocks=[np.int64(2), 4]).blocks == (2, 4)


@pytest.fixture(scope="module")
def inputs(home):
    """A folder of input files beside `home`'s checkpoint: text, chat, a multiple-choice task, decode prompts."""
    root = home / "inputs"
    (root / "yaml").mkdir(parents=True, exist_ok=True)  # a folder of harness task files
    (root / "corpus.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20)
    (root / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                      '{"role": "assistant", "content": "hello"}]}\n' * 8)
    (root / "task.jsonl").write_text('{"question": "2+2?", "choices": ["3", "4"], "answer": 1}\n')
    (root / "prompts.json").write_text('["First Citizen:"]')
    return root


@pytest.mark.parametrize("argv,typed,meant", [
    (["train", "--data", "{i}/corpus.tx", "--out", "{o}"], "corpus.tx", "corpus.txt"),
    (["train", "--data", "{i}/corpus.txt,{i}/corpus.tx", "--out", "{o}"], "corpus.tx", "corpus.txt"),
    (["sft", "{ck}", "--data", "{i}/chats.jsonn", "--out", "{o}"], "chats.jsonn", "chats.jsonl"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--data", "{i}/corpus.tx", "--out", "{o}"], "corpus.tx",
     "corpus.txt"),
    (["adapt", "{ck}", "--plan", "2xF1-h0-K1", "--data", "chat:{i}/chats.jsonn", "--out", "{o}"], "chats.jsonn",
     "chats.jsonl"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--data", "{i}/corpus.tx"], "corpus.tx", "corpus.txt"),
    (["tune", "{ck}", "--plans", "2xF1-h0-K1", "--data", "{i}/corpus.tx"], "corpus.tx", "corpus.txt"),
    (["analyze", "{ck}", "--data", "{i}/corpus.tx", "--out", "{o}"], "corpus.tx", "corpus.txt"),
    (["calibrate", "{ck}", "--data", "{i}/corpus.tx"], "corpus.tx", "corpus.txt"),
    (["speedrun", "--quick", "--data", "{i}/corpus.tx", "--out", "{o}"], "corpus.tx", "corpus.txt"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--task", "mc:{i}/task.jsonn"], "task.jsonn", "task.jsonl"),
    (["sft-grid", "{ck}", "--plan", "2xF1-h0-K1", "--data", "{i}/chats.jsonl", "--task", "mc:{i}/task.jsonn", "--out", "{o}"], "task.jsonn",
     "task.jsonl"),
    (["bench", "--suite", "decode", "--ckpt", "{ck}", "--prompts-file", "{i}/prompts.jsn", "--quick", "--out", "{o}"],
     "prompts.jsn", "prompts.json"),
    (["eval", "{ck}", "--drafter", "{home}/drafter-8", "--chat-prompts", "{i}/chats.jsonn"], "chats.jsonn",
     "chats.jsonl"),
    (["eval", "{ck}", "--harness", "arc_easy", "--harness-include", "{i}/yam", "--harness-out", "{o}"], "yam",
     "yaml"),
])
def test_an_input_file_typo_names_the_closest_file(argv, typed, meant, home, inputs, tmp_path, capsys):
    """A checkpoint, drafter or generate --prompts-file typo got "; did you mean X?" (snlp.io.source.did_you_mean); a
    --data, --task mc:, bench --prompts-file or --chat-prompts typo said only that the file is not there. Each now
    names the closest file, in one line before any work, and makes no --out."""
    out = tmp_path / "o"
    rc = main([a.format(ck=home / "ck", home=home, i=inputs, o=out) for a in argv])
    line = one_error_line(capsys, argv[0])
    assert rc == 2 and typed in line and f"did you mean {inputs}/{meant}" in line, line
    assert not out.exists()


@pytest.mark.parametrize("existed", [False, True])
def test_a_refused_adapt_leaves_no_out_folder_it_made(existed, home, inputs, tmp_path, capsys):
    """`snlp adapt` locks --out (making the folder) before it reads the base and its data, so a data typo left an
    empty --out (and its parents) behind. The folders this run made are removed when it refuses; one that was there
    before stays."""
    out = tmp_path / "runs" / "d"
    if existed:
        out.mkdir(parents=True)
    argv = ["adapt", str(home / "ck"), "--plan", "2xF1-h0-K1", "--data", f"{inputs}/corpus.tx", "--out", str(out)]
    assert main(argv) == 2 and "did you mean" in one_error_line(capsys, "adapt")
    assert out.is_dir() == existed and (tmp_path / "runs").exists() == existed


def test_a_name_whose_tilde_names_no_user_is_the_folder_as_typed(home, tmp_path, monkeypatch, capsys):
    """`~old` names the user `old`'s home only where that user exists; the shell and os.path.expanduser leave it as
    typed otherwise, and pathlib's expanduser raises RuntimeError("Could not determine home directory"). snlp.load,
    load_drafter and read_meta used pathlib's: a checkpoint or drafter folder named `~ck` (it exists, here) failed
    with that RuntimeError, and `snlp generate ~ck ... --drafter ~d` with its traceback."""
    import pwd
    import shutil

    from snlp.io.checkpoint import load
    from snlp.io.drafter import load_drafter, read_meta

    names = ("~snlp-no-user-ck", "~snlp-no-user-d")
    for name in names:
        try:
            pwd.getpwnam(name[1:])
            pytest.skip(f"this machine has a user {name[1:]}")
        except KeyError:
            pass
    monkeypatch.chdir(tmp_path)
    shutil.copytree(home / "ck", tmp_path / names[0])
    shutil.copytree(home / "drafter-8", tmp_path / names[1])
    model, tok = load(names[0])
    assert tok is not None and load_drafter(names[1], model).plan.chunks == 2 and read_meta(names[1])["plan"]
    argv = ["generate", names[0], "--mode", "speculative", "--drafter", names[1], "--no-baseline", "--prompt", "All:",
            "--max-new-tokens", "2", "--json", "~snlp-no-user-g.json"]
    assert main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "~snlp-no-user-g.json").is_file()


def test_an_init_drafter_typo_is_refused_before_the_base_loads(home, tmp_path, monkeypatch, capsys):
    """`adapt --init-drafter` was read after the base's weights loaded (snlp.train.adapt.init_state): a typo cost a
    whole model load before its one line. AdaptConfig.check reads it first, as eval and bench read --drafter."""
    import snlp.train.adapt as A

    monkeypatch.setattr(A, "load_base", lambda *a, **k: pytest.fail("the base loaded before the refusal"))
    out = tmp_path / "o"
    rc = main(["adapt", str(home / "ck"), "--plan", "2xF1-h0-K1", "--out", str(out), "--init-drafter",
               str(home / "drafter-9")])
    line = one_error_line(capsys, "adapt")
    assert rc == 2 and f"drafter {home}/drafter-9 does not exist; did you mean {home}/drafter-8?" in line, line
    assert not out.exists()
    with pytest.raises(ValueError, match="does not exist"):
        A.AdaptConfig(src=str(home / "ck"), plan="2xF1-h0-K1", out=str(out), init_drafter=str(home / "drafter-9")).check()


def test_a_quoted_home_harness_include_is_the_home(home, in_home, capsys, monkeypatch):
    """--harness-include names a folder of task YAML files and was no path flag: `--harness-include '~/tasks'` said
    "is not a folder of task YAML files" of a folder that exists (and `--harness-include ""` was dropped unsaid).
    Here the run gets as far as the task lookup (stubbed: it says which folder it was given)."""
    pytest.importorskip("lm_eval")
    import snlp.eval.harness as H

    def lookup(tasks, include):
        raise ValueError(f"task lookup in {include}")

    monkeypatch.setattr(H, "task_manager", lookup)
    (home / "tasks").mkdir(exist_ok=True)
    assert main(["eval", str(home / "ck"), "--harness", "nosuchtask_xyz", "--harness-include", "~/tasks"]) == 2
    line = one_error_line(capsys, "eval")
    assert line.endswith(f"task lookup in {home}/tasks"), line
    assert main(["eval", str(home / "ck"), "--harness", "nosuchtask_xyz", "--harness-include", ""]) == 2
    assert "--harness-include is empty" in one_error_line(capsys, "eval")


def test_the_library_loads_what_it_saved_under_a_literal_tilde(home, in_home):
    """save_checkpoint / save_drafter write a `~/x` they are given as typed (a folder `~` in the working directory,
    as they always did); snlp.load and load_drafter read `~/x` as $HOME/x since the CLI's `~` change, so the round
    trip said "does not exist", or, where $HOME/x held another checkpoint, loaded THAT one. A name that exists as
    typed is read as typed; one that does not is the home's (test_the_library_loads_..._under_a_quoted_home)."""
    import torch
    from conftest import make_model

    from snlp.io.checkpoint import load, save_checkpoint
    from snlp.io.drafter import load_drafter, save_drafter
    from snlp.method.drafter import make_drafter

    theirs, _ = load(home / "ck")
    mine = make_model(seed=11, dtype=torch.float32, vocab_size=theirs.config.vocab_size, n_layer=4, n_head=2,
                      n_kv_head=1, n_embd=32, sequence_len=128, scale=0.15)
    save_checkpoint("~/ck", mine)
    save_drafter("~/drafter-8", make_drafter(mine, "2xF1-h0-K1"))
    assert (in_home / "~" / "ck").is_dir()  # written as typed
    loaded, _ = load("~/ck")
    assert torch.equal(loaded.wte.weight, mine.wte.weight) and not torch.equal(loaded.wte.weight, theirs.wte.weight)
    assert load_drafter("~/drafter-8", loaded).plan.chunks == 2  # home's drafter-8 is of another base: refused


@pytest.mark.parametrize("argv,meant", [
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--data", "chat:{i}/chats.jsonn"], "chat:{i}/chats.jsonl"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--data", "{i}/corpus.txt,chat:{i}/chats.jsonn"], "chat:{i}/chats.jsonl"),
    (["sft", "{ck}", "--data", "chat:{i}/chats.jsonn", "--out", "{o}"], "{i}/chats.jsonl"),
    (["train", "--data", "{home}/inputz/corpus.txt", "--out", "{o}"], "{i}/corpus.txt"),
    (["eval", "{ck}", "--plans", "2xF1-h0-K1", "--task", "mc:{home}/inputz/task.jsonl"], "{i}/task.jsonl"),
])
def test_a_typo_in_a_prefixed_part_or_a_folder_names_the_whole_path(argv, meant, home, inputs, tmp_path, capsys):
    """did_you_mean read `chat:/abs/chats.jsonn` as a path whose first part `chat:` is missing, and suggested a name
    close to "chat:" in the working folder (or nothing); a typo in a folder on the path was answered with the folder
    alone (`inputz/corpus.txt`: "did you mean inputs?"). The suggestion is now the path to type: the part's prefix
    kept, the folder's files' name kept where the close folder holds it."""
    fill = dict(ck=home / "ck", home=home, i=inputs, o=tmp_path / "o")
    assert main([a.format(**fill) for a in argv]) == 2
    line = one_error_line(capsys, argv[0])
    assert f"; did you mean {meant.format(**fill)}" in line, line


def test_sft_reads_a_chat_prefixed_part_as_the_same_chat_set(inputs):
    """snlp.io.chat's missing_parts and resolve_part read `chat:FILE` as FILE (the adapt form), the loader named it an
    unknown data source: `snlp sft --data chat:chats.jsonl` refused a file that is there."""
    from snlp.io.chat import load_conversations

    path = str(inputs / "chats.jsonl")
    assert load_conversations("chat:" + path) == load_conversations(path) != []


def test_a_dangling_symlink_is_named_as_one_not_suggested_as_itself(tmp_path, capsys):
    """did_you_mean listed the folder's names, a dangling symlink's own name among them (it does not "exist"), so a
    --data, --stop-file or checkpoint that is a broken link was answered "did you mean <the same name>?". The line
    now says it is a symlink and to what."""
    link = tmp_path / "corpus.txt"
    link.symlink_to(tmp_path / "moved" / "corpus.txt")
    assert main(["train", "--data", str(link), "--out", str(tmp_path / "o")]) == 2
    line = one_error_line(capsys, "train")
    assert line.endswith(f"; {link} is a symlink to {tmp_path}/moved/corpus.txt, which does not exist"), line
    assert main(["generate", str(link), "--prompt", "hi"]) == 2
    line = one_error_line(capsys, "generate")
    assert "did you mean" not in line and "is a symlink to" in line, line


def test_a_speedrun_rerun_refuses_a_missing_data_before_any_work(inputs, tmp_path, capsys):
    """A rerun (its --out holds finished stages) skipped the up-front --data check a first run makes, so a typo
    there reached the first stage to redo after the kept ones. Refused in one line, as on a first run, the folder
    left as it was."""
    out = tmp_path / "o"
    (out / "stages").mkdir(parents=True)
    (out / "stages" / "tokenizer.json").write_text("{}")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    rc = main(["speedrun", "--quick", "--data", f"{inputs}/corpus.tx", "--out", str(out)])
    got = capsys.readouterr()
    err = got.err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("snlp speedrun: error: "), err
    assert f"did you mean {inputs}/corpus.txt" in err[0] and got.out == "", got.out  # no banner, no stage begun
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_a_refused_run_removes_only_the_folders_it_made(tmp_path, monkeypatch, capsys):
    """A run refused after its output folders were listed removed every one of them still empty, so an empty folder
    another process made between this run's start and its refusal (a second run about to write there) was deleted
    under it. Only the folders this process made (snlp.runtime.outputs.make_folders) are removed now."""
    import os

    import snlp.apps.selfcheck as selfcheck
    from snlp.apps.cli import new_folders, remove_empty

    out = tmp_path / "runs" / "sc"

    def refused(args):  # our lock made runs/; another process makes runs/sc, then this run is refused
        assert (tmp_path / "runs").is_dir() and not out.exists()
        os.mkdir(out)
        raise ValueError("refused for bad input")

    monkeypatch.setattr(selfcheck, "run", refused)
    assert main(["selfcheck", "--out", str(out)]) == 2 and "refused for bad input" in one_error_line(capsys, "selfcheck")
    assert out.is_dir()  # the other process's folder stays (and so its parent)
    os.rmdir(out)
    os.rmdir(tmp_path / "runs")
    monkeypatch.setattr(selfcheck, "run", lambda args: (_ for _ in ()).throw(ValueError("bad")))
    assert main(["selfcheck", "--out", str(out)]) == 2
    assert not (tmp_path / "runs").exists()  # what this run made alone is still removed

    other = tmp_path / "a" / "b"
    made = new_folders(str(other))  # both missing at this run's start
    os.makedirs(other)  # another process makes them both
    remove_empty(made)
    assert other.is_dir()


@pytest.mark.parametrize("argv, says", [
    (["tune", "{o}", "--max-dppl", "-1%"], "--max-dppl must be >= 0 and finite, got '-1%'"),
    (["train", "--out", "{o}", "--minutes", "-1.5"], "--minutes must be a finite number > 0 (got -1.5)"),
    (["tune", "{o}", "--max-dp", "-1%"], "--max-dppl must be >= 0 and finite, got '-1%'"),  # argparse's abbreviation
    (["tune", "{o}", "--max-dppl", "-inf"], "--max-dppl must be >= 0 and finite, got '-inf'"),
])
def test_a_negative_value_gets_the_flags_own_check_not_argparses_expected_one_argument(argv, says, tmp_path,
                                                                                       capsys):
    """argparse reads `-1%` (not a plain negative number) as an option, and answered "expected one argument"."""
    rc = main([a.replace("{o}", str(tmp_path / "o")) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and says in err[-1], err


def test_a_prompt_starting_with_a_minus_and_a_digit_is_the_prompt(monkeypatch):
    from snlp.apps import cli

    parser = cli.build_parser("generate")
    argv = cli.attach_negative_values(parser, ["generate", "ckpt", "--prompt", "-5 apples", "--", "-x"])
    assert argv == ["generate", "ckpt", "--prompt=-5 apples", "--", "-x"]
    assert parser.parse_args(argv[:-2]).prompt == "-5 apples"


@pytest.mark.parametrize("argv, says", [
    (["generate", "{o}", "--prompt", "hi", "--temprature", "0.5"],
     "unrecognized arguments: --temprature 0.5 (did you mean --temperature?)"),
    (["eval", "{o}", "--plans", "1xF1-h0-K1", "--max-tokns=64"],
     "unrecognized arguments: --max-tokns=64 (did you mean --max-tokens?)"),
    (["generate", "{o}", "extra"], "unrecognized arguments: extra; `snlp generate --help` lists its options"),
    (["eval", "{o}", "--plans", "1xF1-h0-K1,", "1xF1-h0-K2"],
     "unrecognized arguments: 1xF1-h0-K2 (a comma-separated list is one word: no space after its commas)"),
])
def test_an_unknown_flag_is_one_line_of_its_command_with_the_flag_meant(argv, says, tmp_path, capsys):
    """argparse answered a misspelt flag with the top-level usage ('usage: snlp [-h] COMMAND ...') and 'snlp: error:
    unrecognized arguments', naming neither the command nor the flag meant."""
    rc = main([a.replace("{o}", str(tmp_path / "o")) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"snlp {argv[0]}: error: ") and says in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["eval", "tune"])
def test_an_fd_eps_the_dtype_cannot_take_is_refused_before_the_validation_text_is_read(command, tmp_path, capsys):
    """eval and tune read and tokenized their validation text before the plans' first solve refused a diag:fd eps below
    the FD step floor of the --dtype (fp32: 3.45e-4); both refuse it once the weights are cast, before any text is
    read (the line that counts the validation tokens never comes)."""
    from conftest import text_checkpoint

    ckpt, data, _ = text_checkpoint(tmp_path)
    argv = [command, str(ckpt), "--data", str(data), "--dtype", "float32", "--device", "cpu", "--plans",
            "2xF1-h0-K1,2xF1-h0-K1-diag-eps:1e-5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "eps:1e-05 is below the smallest FD step of the compute dtype float32" in err
    assert "validation tokens" not in err


def test_adapt_refuses_an_fd_eps_the_dtype_cannot_take_before_the_base_loads(tmp_path, capsys):
    """snlp adapt --kv own trains a diag:fd drafter whose student solve refused an eps below the FD step floor of the
    step's dtype (fp32: 3.45e-4) only after the data was read, the banner printed and --out made. Refused first now:
    --out is never made."""
    from conftest import text_checkpoint

    ckpt, data, _ = text_checkpoint(tmp_path)
    out = tmp_path / "d"
    assert main(["adapt", str(ckpt), "--kv", "own", "--plan", "2xF1-h0-K1-diag-eps:1e-5", "--out", str(out), "--data",
                 str(data), "--steps", "1", "--device", "cpu"]) == 2
    line = one_error_line(capsys, "adapt")
    assert "eps:1e-05 is below the smallest FD step of the compute dtype float32" in line
    assert not out.exists()
