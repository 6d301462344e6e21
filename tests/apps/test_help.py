"""`snlp --help` and `snlp CMD --help` read like the help of the tools our users know (git, torchrun, lm_eval): one
complete sentence per command in the listing; for a command, a short description whose example lines keep their
line breaks, then the options, each default said once. The module docstrings keep the design notes."""

import argparse
import re
import textwrap
from pathlib import Path

import pytest

from snlp.apps.cli import COMMANDS, HelpFormatter, build_parser, module_help

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 100  # the terminal width the help is checked at
SUMMARY_CHARS = 80  # a summary fits the listing on one line at WIDTH (the names take 15 columns)
PARAGRAPH_LINES = 6  # no prose paragraph of a description is longer, at WIDTH
DESCRIPTION_LINES = 24  # nor the whole description (summary, paragraphs, examples, the guide's line)
OPTION_LINES = 4  # nor any option's help, at the narrowest help column


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # argparse's formatter reads the width from the terminal


def command_help(name: str) -> tuple[argparse.ArgumentParser, str]:
    sub = build_parser(name).commands[name]
    return sub, sub.format_help()


def description_of(text: str) -> str:
    """The description of a `snlp CMD --help`: after the usage block, before the first section."""
    body = text.split("\n\n", 1)[1]
    return re.split(r"\n\n(?:positional arguments|options):\n", body, maxsplit=1)[0]


def blocks(text: str) -> list[list[str]]:
    return [b.splitlines() for b in re.split(r"\n\s*\n", text.strip("\n"))]


def unbalanced(text: str) -> list[str]:
    stack, bad = [], []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if not stack or "([{"[")]}".index(ch)] != stack.pop():
                bad.append(ch)
    bad += stack
    bad += [q for q in ('"', "`") if text.count(q) % 2]
    return bad


@pytest.mark.parametrize("name", COMMANDS)
def test_every_summary_is_one_complete_sentence_that_fits_the_listing(name):
    """The listing used to show each docstring's first line, cut mid-sentence for several commands ('... (Llama,
    Qwen2, Mistral, Qwen3: a local directory, a .gguf file or a hub')."""
    summary = module_help(COMMANDS[name]).get("SUMMARY", "")
    assert summary and summary[0].isupper() and summary.endswith("."), repr(summary)
    assert "\n" not in summary and len(summary) <= SUMMARY_CHARS, repr(summary)
    assert not re.search(r"[.;]\s", summary), f"one sentence: {summary!r}"
    assert not unbalanced(summary), f"{summary!r}: unbalanced {unbalanced(summary)}"


def test_the_listing_shows_every_summary_on_its_own_line():
    text = build_parser("").format_help()
    for name, modname in COMMANDS.items():
        assert re.search(rf"(?m)^    {re.escape(name)} +{re.escape(module_help(modname)['SUMMARY'])}$", text), name


@pytest.mark.parametrize("name", COMMANDS)
def test_description_is_short_and_its_example_lines_survive_verbatim(name):
    """`snlp speedrun --help` printed 65 lines of the module docstring re-flowed into one paragraph, its example
    commands and its stage list merged into the prose."""
    mod = build_parser(name).commands[name].get_default("module")
    _, text = command_help(name)
    desc = description_of(text)
    assert desc.splitlines()[0] == mod.SUMMARY
    assert len(desc.splitlines()) <= DESCRIPTION_LINES, desc
    for block in blocks(desc):
        if not block[0][:1].isspace():
            assert len(block) <= PARAGRAPH_LINES, "\n".join(block)
    examples = [line.rstrip() for line in mod.DESCRIPTION.splitlines() if line[:1].isspace()]
    assert examples, f"snlp {name} --help shows no example command"
    lines = text.splitlines()
    for line in examples:
        assert line in lines, line
        assert len(line) < WIDTH, f"wider than the terminal: {line}"
    assert f"Guide: {mod.GUIDE}." in desc


def test_formatter_reflows_prose_and_keeps_indented_blocks_as_typed():
    """The formatter itself, on a description with a paragraph wider than the terminal and an example block whose
    lines are wider still: the paragraph is wrapped to the width, the examples keep every character and break."""
    prose = " ".join(["word"] * 60)
    example = "  snlp speedrun --out runs/speedrun" + " " * 40 + "# a comment that runs past the terminal's width"
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter,
                                description=f"{prose}\n\n{example}\n    second line, indented deeper\n\nLast words.")
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--m", type=int, default=None, help="something (default: the n-th)")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--k", type=int, default=7, help="k things")
    p.add_argument("--empty", nargs="*", default=[], help="a list")
    p.add_argument("--text", default="", help="a text")
    text = p.format_help()
    lines = text.splitlines()
    assert example in lines and "    second line, indented deeper" in lines
    para = [line for line in lines if line.startswith("word")]
    assert len(para) > 1 and all(len(line) <= WIDTH for line in para) and " ".join(para) == prose
    assert "Last words." in lines
    # each default said once, and only where it says something
    assert re.search(r"--n N +\(default: 3\)$", text, re.M)
    assert "k things (default: 7)" in text
    for said in ("a flag", "something (default: the n-th)", "a list", "a text"):
        line = next(line for line in lines if said in line)
        assert line.count("default") == said.count("default"), line


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_help_is_short_and_says_its_default_once(name):
    """An option's help is a few lines, not an essay, and its default is said once: argparse used to add
    "(default: None)" after "(default 200 without --minutes)"."""
    sub, text = command_help(name)
    for nothing in ("None", "False", "True", "[]", ""):
        assert f"(default: {nothing})" not in text
    fmt = sub._get_formatter()
    for action in sub._actions:
        shown = fmt._expand_help(action) if action.help else ""
        assert not unbalanced(shown), f"{action.option_strings}: unbalanced {unbalanced(shown)}: {shown}"
        assert len(re.findall(r"\bdefault\b", shown, re.I)) <= 1 or "default" in (action.help or "").lower(), shown
        assert len(re.findall(r"\(default: ", shown)) <= 1, f"{action.option_strings}: {shown}"
        # argparse's help column starts at 24 at the most
        assert len(textwrap.wrap(shown, WIDTH - 24)) <= OPTION_LINES, f"{action.option_strings}: {shown}"


@pytest.mark.parametrize("name", COMMANDS)
def test_guide_exists_and_the_examples_use_flags_the_command_has(name):
    """A --help points to its guide (docs/*.md, a heading anchor where given) and its example lines run: every
    `snlp CMD --flag` in a description names a flag CMD's parser has."""
    info = module_help(COMMANDS[name])
    path, _, anchor = info["GUIDE"].partition("#")
    doc = ROOT / path
    assert doc.is_file(), info["GUIDE"]
    if anchor:
        slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                 for h in re.findall(r"(?m)^#+ (.*)$", doc.read_text())}
        assert anchor in slugs, info["GUIDE"]
    parser = build_parser()
    for line in info["DESCRIPTION"].splitlines():
        for m in re.finditer(r"\bsnlp ([a-z-]+)((?: [^#`]*)?)", line):
            cmd, rest = m.group(1), m.group(2)
            if cmd not in COMMANDS:
                continue
            flags = {o for a in parser.commands[cmd]._actions for o in a.option_strings}
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                assert flag in flags, f"{name}: snlp {cmd} has no {flag}: {line}"
