"""The `snlp` command line. Each sub-command lives in its own module, which provides
`add_arguments(parser)` and `run(args) -> int`, and its help as module constants: SUMMARY (one sentence, its line
in `snlp --help`), DESCRIPTION (what `snlp CMD --help` prints above the options: what you run and what you get, a
few example lines) and GUIDE (the docs/*.md page that explains it). The module's docstring keeps the design notes
for readers of the code; --help does not print it.

Only the module of the command given is imported (the list of commands reads the others' SUMMARY from their
source), and the modules import torch and the library inside `run`, so `snlp --help`, `snlp CMD --help`
and argument errors answer without loading torch. Output paths (--out, --json, --csv, --markdown, --plot) are
checked before the command runs, so a result that cannot be written costs no work."""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import importlib.util
import io
import re
import sys
import warnings

from snlp.runtime.ranks import speaks

# sub-command -> module
COMMANDS = {
    "adapt": "snlp.apps.adapt",
    "analyze": "snlp.apps.analyze",
    "bench": "snlp.apps.bench",
    "calibrate": "snlp.apps.calibrate",
    "convert": "snlp.apps.convert",
    "eval": "snlp.apps.eval",
    "export": "snlp.apps.export",
    "generate": "snlp.apps.generate",
    "speedrun": "snlp.apps.speedrun",
    "sft": "snlp.apps.sft",
    "selfcheck": "snlp.apps.selfcheck",
    "sft-grid": "snlp.apps.sft_grid",
    "train": "snlp.apps.train",
    "tune": "snlp.apps.tune",
}
# argparse dests naming a file a command writes; `out` names a folder unless the module's OUTPUT_FILES lists it
# (a module's OUTPUT_DIRS names more folders)
OUTPUT_FILES = ("json", "csv", "markdown", "plot")
# argparse dests naming one local path, read or written (the output flags above, `out` and a module's OUTPUT_DIRS
# too): a leading `~` is expanded (expand_paths) and an empty value refused. The data specs (DATA_SPECS: comma lists,
# globs, chat: / mc: prefixes, hub names) are expanded part by part where snlp.io reads them.
PATH_FLAGS = ("ckpt", "src", "drafter", "prompts_file", "init_from", "init_drafter", "from_model", "base",
              "cache_dir", "stop_file", "vs_paper", "harness_out", "harness_include")
# folders a command reads and writes, shared between runs (a cache): refused where a file stands, never locked
SHARED_DIRS = ("cache_dir",)


HELP_CONSTANTS = ("SUMMARY", "DESCRIPTION", "GUIDE")


def module_help(modname: str) -> dict[str, str]:
    """A command module's help constants (HELP_CONSTANTS: module-level string literals), read from its source
    without importing it."""
    spec = importlib.util.find_spec(modname)
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in HELP_CONSTANTS}


def description(summary: str, text: str, guide: str) -> str:
    """What `snlp CMD --help` prints above the options: the summary, the module's DESCRIPTION, its guide."""
    more = f"Guide: {guide}. Every option with its default: docs/cli.md." if guide else ""
    return "\n\n".join(part.strip("\n") for part in (summary, text, more) if part.strip())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's two formatters combined, as its documentation shows, with two changes.

    Description and epilog: a block of lines between blank lines is re-flowed to the terminal's width as a
    paragraph, unless one of its lines is indented, as example commands and lists are: such a block is printed
    verbatim (RawDescriptionHelpFormatter keeps every line as typed, argparse's default formatter none).

    Defaults: "(default: X)" is added as ArgumentDefaultsHelpFormatter adds it, also to an option without a help
    text (argparse prints nothing for those), but not where it says nothing or is said already: no default (None,
    an empty list or string), a flag's True / False, a help text that states its default itself ("(default 200
    without --minutes)", "default: cuda if available")."""

    STATES_DEFAULT = re.compile(r"(?:^|[(;,.]\s*)default\b", re.IGNORECASE)

    def _fill_text(self, text, width, indent):
        out = []
        for block in re.split(r"\n[ \t]*\n", text.strip("\n")):
            lines = block.splitlines()
            if any(line[:1].isspace() for line in lines):
                out.append("\n".join(indent + line.rstrip() for line in lines))
            else:
                out.append(argparse.HelpFormatter._fill_text(self, block, width, indent))
        return "\n\n".join(out)

    def shows_default(self, action) -> bool:
        d = action.default
        if d is None or d is argparse.SUPPRESS or (isinstance(d, (list, tuple, str)) and not d) or action.nargs == 0:
            return False
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return False  # a required positional
        return not (action.help and self.STATES_DEFAULT.search(action.help))

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or not self.shows_default(action):
            return text
        return (text + " " if text else "") + "(default: %(default)s)"

    def add_argument(self, action):
        super().add_argument(action)
        # argparse measures a sub-command's name without the indent it is listed with, so "calibrate" and
        # "selfcheck" would start their summary on a line of their own
        for sub in getattr(action, "_get_subactions", list)():
            width = len(self._format_action_invocation(sub)) + self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, width)

    def _format_action(self, action):
        if not action.help and self.shows_default(action):  # argparse prints no help column for an empty help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser. `command` None: every sub-command's module is imported and its flags added; a name: only that
    one's (the others are listed from their SUMMARY; "" imports none). `parser.commands` maps each sub-command to
    its sub-parser."""
    parser = argparse.ArgumentParser(
        prog="snlp", formatter_class=HelpFormatter,
        description="Layer-parallel inference of Transformer LMs (Structured Newton Layer Parallelism).",
        epilog="New here: `snlp speedrun --out runs/speedrun` runs the main job (20 minutes on a CPU); on a GPU, start "
               "with `snlp selfcheck`. `snlp COMMAND --help` shows a command's usage and options. Guides: README.md "
               "and docs/usage.md; every option of every command: docs/cli.md.")
    parser.commands = {}
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for name, modname in COMMANDS.items():
        if command is not None and name != command:
            parser.commands[name] = sub.add_parser(name, help=module_help(modname).get("SUMMARY", name))
            continue
        mod = importlib.import_module(modname)
        summary = getattr(mod, "SUMMARY", name)
        p = sub.add_parser(name, help=summary, formatter_class=HelpFormatter,
                           description=description(summary, getattr(mod, "DESCRIPTION", ""), getattr(mod, "GUIDE", "")))
        mod.add_arguments(p)
        for a in p._actions:  # positionals in capitals, as the descriptions and docs/cli.md name them (CKPT, SRC)
            if not a.option_strings and a.metavar is None:
                a.metavar = a.dest.upper()
        p.set_defaults(func=mod.run, module=mod)
        parser.commands[name] = p
    return parser


def command_of(argv: list[str]) -> str:
    """The sub-command `argv` names (its first word that is not an option: `snlp` itself takes only -h), or "" if
    it names none."""
    word = next((a for a in argv if not a.startswith("-")), "")
    return word if word in COMMANDS else ""


def output_dests(args) -> tuple[str, ...]:
    """The dests of `args`' command that name an output: OUTPUT_FILES and the module's, `out`, the module's
    OUTPUT_DIRS."""
    return tuple(dict.fromkeys(OUTPUT_FILES + tuple(getattr(args.module, "OUTPUT_FILES", ())) + ("out",) + tuple(
        getattr(args.module, "OUTPUT_DIRS", ()))))


def path_dests(args) -> tuple[str, ...]:
    """The dests of `args`' command that name one local path (the outputs, PATH_FLAGS)."""
    return tuple(dict.fromkeys(output_dests(args) + PATH_FLAGS))


def expand_paths(parser: argparse.ArgumentParser, args) -> None:
    """Expand a leading `~` (`~/runs/x`, `~user/x`) in every path flag's value, and refuse a path flag given as an
    empty string, in one line before any work. The shell leaves `~` as typed inside quotes and after `--flag=`; the
    output checks expanded it (check_outputs) while the writes did not, so `--json '~/r.json'` wrote a folder
    named `~` in the working directory, and the loaders said "does not exist" of a checkpoint that does. An empty
    path read as the working directory (`--json ""` wrote nothing and said nothing; `generate ""` named `.`)."""
    sub = parser.commands[args.command]
    given = getattr(args, "given", frozenset())
    for dest in path_dests(args):
        value = getattr(args, dest, None)
        if not isinstance(value, str):
            continue
        if not value.strip() and (dest in given or value != sub.get_default(dest)):
            action = next((a for a in sub._actions if a.dest == dest), None)
            name = action.option_strings[-1] if action is not None and action.option_strings else dest.upper()
            raise ValueError(f"{name} is empty: name a path (or leave {name} out)")
        if value.startswith("~"):
            from snlp.io.source import home_path

            setattr(args, dest, str(home_path(value)))


# every command's --seed lies below this: the data / prompt generators are numpy seed sequences (no negative seed)
# and torch generators (64 bits), and runs add offsets to the seed (a prompt's seed + i, a probe's seed + N)
SEED_END = 2 ** 63


def check_numbers(parser: argparse.ArgumentParser, args) -> None:
    """Refuse a number flag given as nan (argparse's float() reads "nan"), in one line before any work: a range
    check `x <= 0` is False for nan, so `--minutes nan` trained until killed and `--lr nan` trained NaN weights.
    Infinity is left to each flag's own check (`--dist-timeout inf` waits forever, as asked). A --seed outside
    [0, SEED_END) is refused here too, whatever the command (generate's failed only once the model had loaded)."""
    import math

    for action in parser.commands[args.command]._actions:
        value = getattr(args, action.dest, None)
        if action.option_strings and isinstance(value, float) and math.isnan(value):
            raise ValueError(f"{action.option_strings[-1]} must be a number (got nan)")
        if action.dest == "seed" and isinstance(value, int) and not 0 <= value < SEED_END:
            raise ValueError(f"{action.option_strings[-1]} must be an integer in [0, 2**63) (got {value}): numpy's "
                             f"seed sequences take no negative seed, torch's generators 64 bits, and runs draw "
                             f"with seed + i")


def check_outputs(parser: argparse.ArgumentParser, args) -> None:
    """Raise a ValueError for the first output path given that cannot be written (snlp.runtime.outputs), and for an
    output file that would overwrite what the run reads or writes besides: another output flag's file (the second
    write replaced the first's result), a file another flag names (a --prompts-file, a --data part), or a file of a
    checkpoint or drafter folder (`--json CKPT/config.json` left a checkpoint that loads as nothing)."""

    from snlp.io.source import home_path
    from snlp.runtime.outputs import check_output_dir, check_output_file

    sub = parser.commands[args.command]
    files = OUTPUT_FILES + tuple(getattr(args.module, "OUTPUT_FILES", ()))
    outputs = output_dests(args)
    written: dict = {}  # resolved output file -> its flag
    # the folder this command writes a model or drafter into (a module's OUT_IS_MODEL): its files are refused as outputs
    # before the folder holds them (`snlp adapt --out D --json D/drafter.json` wrote the result over the new drafter's
    # record, which then no longer loaded)
    own = (home_path(args.out).resolve() if getattr(args.module, "OUT_IS_MODEL", False)
           and isinstance(getattr(args, "out", None), str) and args.out else None)
    for dest in outputs:
        value = getattr(args, dest, None)
        if not isinstance(value, str) or not value or value == sub.get_default(dest):
            continue  # not given (a default folder is created when the command writes there)
        flag = "--" + dest.replace("_", "-")
        (check_output_file if dest in files else check_output_dir)(value, flag)
        if dest in files:
            where = home_path(value).resolve()
            if where in written:
                raise ValueError(f"{flag} {value} is the file {written[where]} writes too: one would replace the "
                                 f"other; give each its own path")
            written[where] = flag
            check_not_a_model_file(where, flag, value, own, preheat_ok=args.command == "calibrate")
    for dest in SHARED_DIRS:  # a cache folder that is a file failed after the data was read, with a traceback (a
        value = getattr(args, dest, None)  # read-only cache stays fine: a run that finds its files writes none)
        if isinstance(value, str) and value and home_path(value).exists() and not home_path(value).is_dir():
            raise ValueError(f"--{dest.replace('_', '-')} {value} is a file; name a folder (it is created if missing)")
    if not written:  # no output file: nothing to compare the inputs with (a --data glob is not expanded for nothing)
        return
    for dest, value in vars(args).items():  # the inputs: every other string a flag holds, comma-separated parts too
        if dest in outputs or dest in ("command", "func", "module", "given", *TEXT_FLAGS) or not isinstance(value, str):
            continue
        for part in value.split(","):
            for where in input_paths(part, spec=dest in DATA_SPECS):
                if where not in written or not where.is_file():
                    continue
                action = next((a for a in sub._actions if a.dest == dest), None)
                flag = (action.option_strings[-1] if action.option_strings else action.metavar) if action else dest
                raise ValueError(f"{written[where]} {where} is the file {flag} reads: writing the result there "
                                 f"would overwrite it; choose another path")


# flags holding text, not paths: `--prompt x.json --json x.json` is no overwrite of an input
TEXT_FLAGS = ("prompt",)
# flags holding a data spec (snlp.io.data, snlp.io.chat): chat: / mc: prefixes and globs name their files
DATA_SPECS = ("data", "chat_prompts", "task", "mc_shots_from")


def input_paths(part: str, spec: bool = False) -> list:
    """The files a flag's value (one comma-separated part) may name, resolved: the path itself, and in a data `spec`
    the path without its chat: / mc: prefixes and what a glob matches (`--data chat:chats.jsonl --json chats.jsonl`
    and `--data 'c*.txt' --json c.txt` wrote the result over the data the run read)."""
    import glob
    from pathlib import Path

    from snlp.io.source import home_path

    part = part.strip()
    while spec and part.startswith(("chat:", "mc:")):
        part = part.split(":", 1)[1]
    if not part:
        return []
    if spec and glob.has_magic(part):
        return [Path(f).resolve() for f in glob.glob(str(home_path(part)), recursive=True)]
    return [home_path(part).resolve()]


def check_not_a_model_file(path, flag: str, value: str, own=None, preheat_ok: bool = False) -> None:
    """Refuse an output file that is one of the files of the checkpoint, drafter or training run in the folder it sits
    in (its weights, config, tokenizer, optimizer or train state, its preheat calibration, its log.jsonl or
    train_summary.json): the folder would no longer load, its preheat plans would no longer run, or its run's record
    would be lost. `own`: the folder the command itself writes a model or drafter into, whose files are refused before
    it holds them. `preheat_ok`: `snlp calibrate`, whose output is that calibration. The file names are the library's
    (imported only where the folder holds a model, so that argument errors answer without torch)."""
    folder = path.parent
    if folder != own and not ((folder / "model.safetensors").is_file() or (folder / "drafter.json").is_file()):
        return
    from snlp.io.checkpoint import DRAFTER_META, OWN_FILES
    from snlp.io.drafter import WEIGHTS as DRAFTER_WEIGHTS
    from snlp.method.preheat import FILENAME as PREHEAT

    if path.name in (*OWN_FILES, DRAFTER_META, DRAFTER_WEIGHTS, "log.jsonl", "train_summary.json",
                     *(() if preheat_ok else (PREHEAT,))):
        raise ValueError(f"{flag} {value} is a file of the checkpoint, drafter or run in {folder}: writing there would "
                         f"break it; choose another path")


def output_locks(parser: argparse.ArgumentParser, args):
    """For a command whose module sets LOCK_OUTPUTS (the long measurements that rewrite their files as they go: bench,
    eval, tune, selfcheck), a lock on every output path typed (snlp.runtime.outputs.locked_output), held while it
    runs: a second run writing one of them is refused at once, in one line naming the first's pid. Two runs writing
    one --json or --out replaced each other's results (the last to finish won), and, as they rewrite their files
    after every part, took turns in them while both ran. A default folder is locked by the command that writes it,
    through args.hold_output(path, flag), once its input is checked (a forward benchmark writes none). A path whose
    folder does not exist yet is locked too (its lock file lives in that folder, which the first run creates when it
    writes there: a lock skipped until then let a second run take it meanwhile); the folders made for the lock are
    removed at the end where they are still empty, so a run refused for bad input leaves none behind."""
    import os
    from contextlib import ExitStack

    from snlp.runtime.outputs import lock_path, locked_output

    stack = ExitStack()
    args.hold_output = lambda value, flag: None
    if not getattr(args.module, "LOCK_OUTPUTS", False) or os.environ.get("RANK", "0") != "0":
        return stack  # under torchrun every rank parses the same flags: rank 0 holds the locks
    sub = parser.commands[args.command]
    given = getattr(args, "given", frozenset())

    def hold(value: str, flag: str) -> None:
        stack.callback(remove_empty, new_folders(str(lock_path(value).parent)))  # after the lock is released
        stack.enter_context(locked_output(value, flag))

    # the default folder a run writes (a suite's bench-suite, selfcheck's selfcheck, --harness's harness-NAME): two
    # runs in one folder shared it as well. The command holds it once its input is checked (args.hold_output), so a
    # run refused for bad input never stands in another's way
    args.hold_output = hold
    try:
        for dest in output_dests(args):  # typed (a default typed out too: `--out selfcheck`)
            value = getattr(args, dest, None)
            if isinstance(value, str) and value and (dest in given or value != sub.get_default(dest)):
                hold(value, "--" + dest.replace("_", "-"))
    except BaseException:
        stack.close()
        raise
    return stack


def measurement_signals(args):
    """For the commands that keep partial files (LOCK_OUTPUTS: bench, eval, tune, selfcheck) or what they had made
    before the signal (RAISE_STOPS: generate keeps a finished generation cut in its timing), SIGTERM, SIGHUP and
    SIGUSR1/2 (a Slurm time limit or `--signal`, docker stop, a closed terminal) raise Interrupted as Ctrl-C raises
    KeyboardInterrupt, so they end the same way: the output locks released, one line naming the signal and what the
    files kept, exit 128 + signum; where the module's `finished(args)` says every file was written complete before
    the signal came, one line saying so and exit 0 (a requeue script reruns a status above 128). Their default action
    killed the process silently (the files already written stayed, the locks' files too); a repeat of the signal is
    ignored (snlp.train.hooks.raising_stops). The training commands arm their own handlers
    (snlp.train.hooks.InterruptStop)."""
    from contextlib import nullcontext

    if not (getattr(args.module, "LOCK_OUTPUTS", False) or getattr(args.module, "RAISE_STOPS", False)):
        return nullcontext()
    from snlp.train.hooks import raising_stops

    return raising_stops()


def check_device(args) -> None:
    """Raise a ValueError for a --device value given that names no device this machine has (a typo, CUDA on a
    CPU box), before the command loads data or a model (snlp.runtime.device.cli_device; torch loads only when
    --device is given)."""
    value = getattr(args, "device", None)
    if isinstance(value, str) and value:
        from snlp.runtime.device import cli_device

        cli_device(value)


class _Unset(list):
    """The default every flag gets in `given_flags`' second parse: a flag still holding it was not typed. A list,
    so that an append action's copy-and-append works on it (and then is no longer this object)."""


def given_flags(parser: argparse.ArgumentParser, argv: list[str], args) -> frozenset[str]:
    """The dests of the flags (and positionals) the user typed in `argv`, as opposed to those left at their
    defaults: `argv` parsed again by the sub-command's parser into a namespace pre-filled with a marker, which
    argparse leaves in place for every action not given (it fills in a default only where a name is missing).
    Abbreviations and `--flag=value` are argparse's own parsing, so they count as typed. An optional positional
    (nargs ? or *) left out is set to its default all the same, so it gets the marker as its default meanwhile."""
    sub = parser.commands[args.command]
    unset = _Unset()
    ns = argparse.Namespace(**{k: unset for k in vars(args)})
    optional = [a for a in sub._actions if not a.option_strings and a.nargs in ("?", "*")]
    defaults = [a.default for a in optional]
    try:
        for a in optional:
            a.default = unset
        sub.parse_args(argv[argv.index(args.command) + 1:], namespace=ns)
    finally:
        for a, d in zip(optional, defaults):
            a.default = d
    return frozenset(k for k, v in vars(ns).items() if v is not unset)


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    # under torchrun a warning before the ranks' process group starts is every rank's alike: each node's first
    # rank says it (snlp.runtime.ranks.speaks)
    return f"snlp: warning: {message}\n" if speaks() else ""


def new_folders(out) -> list:
    """The folders of an --out path that do not exist yet, deepest first: what this run would make there."""
    if not isinstance(out, str) or not out:
        return []
    from snlp.io.source import home_path
    from snlp.runtime.outputs import missing_folders

    return missing_folders(home_path(out))


def remove_empty(folders) -> None:
    """Remove `folders` (deepest first) while they are empty and this process made them: a run refused for bad input
    after its --out was made (its lock, adapt's and the trainers' checks of the base and data under it) leaves no
    empty folder behind; a folder that existed before the run is never among them, one holding anything is kept, and
    one another process made between this run's start and its refusal (a second run on the same parent, which is
    about to write there) is not this run's to remove: only those snlp.runtime.outputs.make_folders made here
    (CREATED) are."""
    from snlp.runtime.outputs import CREATED

    for f in folders:
        if not f.exists():  # not made (an --out that names a file, calibrate's: the file itself is listed first)
            continue
        if f not in CREATED:
            return  # another's, so are its parents (a folder's parents exist before it)
        try:
            f.rmdir()
        except OSError:
            return
        CREATED.discard(f)


def attach_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with a value that starts like a negative number written into its flag (`--max-dppl -1%` ->
    `--max-dppl=-1%`): argparse takes `-1%`, `-1e-3`, `-inf` or `-2x` for an option and answered "expected one
    argument", where the flag's own check says what the value may be. Only after a flag of the command that takes one
    value, written whole or as the abbreviation argparse reads (`--max-dp`: the one long flag it begins)."""
    import re

    sub = parser.commands.get(command_of(argv)) if hasattr(parser, "commands") else None
    if sub is None:
        return argv
    takes = {o for a in sub._actions if a.option_strings and a.nargs is None and a.const is None
             and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._CountAction))
             for o in a.option_strings}
    flags = {o for a in sub._actions for o in a.option_strings}

    def one_value(word: str) -> bool:
        if word in flags:
            return word in takes
        if not (sub.allow_abbrev and word.startswith("--") and "=" not in word):
            return False
        begun = [o for o in flags if o.startswith(word)]  # argparse's own abbreviation rule: one flag begins so
        return len(begun) == 1 and begun[0] in takes

    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if i + 1 < len(argv) and re.match(r"-(\.?\d|inf|nan)", argv[i + 1], re.IGNORECASE) and one_value(argv[i]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def unrecognized(sub: argparse.ArgumentParser, extra: list[str], argv: list[str]) -> str:
    """The error for words `sub` does not take: the words, and for a misspelt flag (--temprature) the flag of the
    command it is closest to, and for a list written with spaces after its commas (`--plans A, B`) that it is one
    word, so that a typo is answered with the fix rather than the top-level usage line."""
    import difflib

    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.75)
            hints += close
    hint = f" (did you mean {' '.join(hints)}?)" if hints else ""
    if any(a.endswith(",") and b in extra for a, b in zip(argv, argv[1:])):  # --plans A, B
        hint += " (a comma-separated list is one word: no space after its commas)"
    return f"unrecognized arguments: {' '.join(extra)}{hint}; `{sub.prog} --help` lists its options"


def ignore_late_signals() -> None:
    """After a command run as the program (`snlp ...`, `python -m snlp ...`) returned 0, the interpreter's teardown
    (torch's and transformers' finalisers: 1.5-2.5 s after the decode suite) still runs, and a SIGTERM, SIGHUP,
    SIGUSR1/2 or Ctrl-C then took its default action: status 128 + signum for a run whose files were all written
    complete, which a requeue script reruns. A Python handler cannot answer it there (the interpreter restores the
    default action of every signal it handled before its last, native teardown, and runs no Python code after),
    but an ignored signal stays ignored, so the finished run exits 0."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal.signal is the main thread's alone
        return
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (not a library or test call): a signal in its teardown keeps the status
        rc = main(sys.argv[1:])
        if rc == 0:
            ignore_late_signals()
        return rc
    argv = list(argv)
    parser = build_parser(command_of(argv))
    argv = attach_negative_values(parser, argv)
    # under torchrun every rank parses the same flags: argparse's refusal (usage and error) is said by each node's
    # first rank (snlp.runtime.ranks.speaks)
    with contextlib.nullcontext() if speaks() else contextlib.redirect_stderr(io.StringIO()):
        args, extra = parser.parse_known_args(argv)
    if extra:  # one line naming the sub-command (argparse's names the top-level parser after its usage)
        sub = parser.commands[args.command]
        if speaks():
            print(f"{sub.prog}: error: {unrecognized(sub, extra, argv)}", file=sys.stderr)
        return 2
    args.given = given_flags(parser, argv, args)  # what --resume keeps from the saved run: the flags not typed
    formatwarning, warnings.formatwarning = warnings.formatwarning, one_line_warning  # the library's warnings as
    made = []
    try:  # the command's own lines
        from snlp.runtime.checks import check_environment

        check_environment()  # a misspelt SNLP_* variable: one line before any work (the library reads it later)
        expand_paths(parser, args)
        check_numbers(parser, args)
        check_outputs(parser, args)
        check_device(args)
        made = new_folders(getattr(args, "out", None))
        with measurement_signals(args), output_locks(parser, args):
            return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:  # bad input: say what and why, no traceback
        remove_empty(made)
        if speaks():  # under torchrun a refusal before the ranks' process group is every rank's alike: each node's
            # first rank says it (a file missing on one node is that node's ranks' alone)
            print(f"snlp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a command that can pick up where it stopped says how (its module's interrupt_hint)
        signum = getattr(e, "signum", 2)  # snlp.train.hooks.Interrupted: another signal than Ctrl-C's SIGINT (2)
        done = getattr(args.module, "finished", lambda a: None)(args)
        if done:  # every file written complete before the signal: 0, so a requeue script does not rerun it
            from snlp.train.hooks import signal_name

            print(f"snlp {args.command}: {signal_name(signum)} arrived after the run had finished: {done}; nothing "
                  f"to rerun", file=sys.stderr)
            return 0
        hint = getattr(args.module, "interrupt_hint", lambda a: "")(args)
        by = f" by {e}" if signum != 2 else ""
        print(f"snlp {args.command}: interrupted{by}" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 128 + signum  # what a shell reports for a process the signal ended
    finally:
        warnings.formatwarning = formatwarning


if __name__ == "__main__":
    sys.exit(main())
