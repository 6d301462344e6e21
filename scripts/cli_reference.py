"""Write docs/cli.md, every command's options as argparse defines them (no torch import).

    python scripts/cli_reference.py > docs/cli.md

tests/test_docs.py checks that each table lists exactly its command's flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snlp.apps.cli import COMMANDS, build_parser, module_help  # noqa: E402


def option_table(name: str, sub: argparse.ArgumentParser) -> list[str]:
    rows = [f"<!-- flags: snlp {name} -->", "| option | default | what it does |", "|---|---|---|"]
    for a in sub._actions:
        longs = [o for o in a.option_strings if o.startswith("--") and o != "--help"]
        if not longs:
            continue
        meta = "" if a.nargs == 0 else " " + (a.metavar if isinstance(a.metavar, str) else
                                              "{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())
        shorts = [f"`{o}`" for o in a.option_strings if not o.startswith("--")]
        opt = ", ".join(shorts + [f"`{o}{meta}`" for o in longs])
        default = "required" if a.required else (
            "" if a.default in (None, False, argparse.SUPPRESS) or a.nargs == 0 else f"`{a.default}`")
        text = (a.help or "").replace("%(default)s", str(a.default)).replace("%%", "%").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {opt} | {default} | {text} |")
    return rows


def main() -> None:
    parser = build_parser()
    out = ["# Every command's options", "",
           "Generated from the parsers by `python scripts/cli_reference.py > docs/cli.md`; `snlp COMMAND --help` prints",
           "the same (fast: it imports no torch). What each command is for and how to read what it prints: the guides",
           "([README](../README.md#guides)) and [usage.md](usage.md).", ""]
    for name, sub in parser.commands.items():
        pos = [a for a in sub._actions if not a.option_strings]
        info = module_help(COMMANDS[name])
        guide = info.get("GUIDE", "")
        link = f" Guide: [{guide.split('#')[0].removeprefix('docs/')}]({guide.removeprefix('docs/')})." if guide else ""
        out += [f"## snlp {name}", "", info.get("SUMMARY", "") + link, ""]
        if pos:
            out += ["Arguments: " + "; ".join(f"`{a.metavar or a.dest.upper()}`" + (f" ({a.help})" if a.help else "")
                                             for a in pos), ""]
        out += option_table(name, sub) + [""]
    sys.stdout.write("\n".join(out))


if __name__ == "__main__":
    main()
