"""The README's first screen and the exactness statements in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import snlp

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]
ALL_DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second_with_the_slow_tests():
    """A fresh machine needs two commands: one runs the main job, one passes the tests; CI runs the second with the
    tests the default run leaves out (marked slow), so nothing leaves CI."""
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:15])
    assert "bash scripts/speedrun.sh" in head and "bash scripts/test.sh" in head
    for script in ("scripts/speedrun.sh", "scripts/test.sh"):
        assert (ROOT / script).is_file()
    assert "scripts/test.sh --all" in (ROOT / ".ci" / "run").read_text()
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "-m slow" in test_sh
    py = (ROOT / "pyproject.toml").read_text()
    assert "-m 'not slow'" in py and '"slow:' in py


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_doc_link_resolves():
    """Every relative link of the README, CONTRIBUTING.md and docs/ (records included) names a file that exists and,
    for `file.md#anchor`, a heading of that file or an explicit `<a id="anchor">` in it (GitHub renders both)."""
    bad = []
    for f in ALL_DOCS:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)  # links inside code blocks are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                bad.append(f"{f.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                body = re.sub(r"(?ms)^```.*?^```", "", dest.read_text())  # a `# comment` line of a code block
                heads = {_slug(h) for h in re.findall(r"(?m)^#+ (.*)$", body)}  # is no heading: GitHub has no anchor
                heads |= set(re.findall(r'<a (?:id|name)="([^"]+)"', body))
                if anchor not in heads:
                    bad.append(f"{f.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_first_screen_holds_install_quickstart_main_job_and_tests():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert 'pip install -e ".[dev]"' in head
    assert "import torch, snlp" in head and "snlp.parallel_forward" in head
    assert "snlp speedrun" in head
    assert "python -m pytest -q" in head


def test_no_doc_claims_k_ge_c_reproduces_the_sequential_model_for_fused_chunks():
    """'K >= C reproduces the sequential forward' is false for M > 1 (it reproduces the fused model); every
    statement of the law must say fused, or restrict itself to M = 1."""
    bad = []
    for f in DOCS:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"K\s*(≥|>=)\s*(C|chunks|\(number of chunks\))", line) and re.search(r"sequential", line) \
                    and not re.search(r"fused|M\s*=\s*1|F1", line):
                bad.append(f"{f.name}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def _perturbed(depth=4):
    torch.manual_seed(0)
    m = snlp.GPT(snlp.GPTConfig.from_depth(depth)).double().eval()
    with torch.no_grad():  # nanochat's zero-initialised projections make every layer the identity: perturb
        for p in m.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return m


def test_the_stated_law_fused_chunks_reproduce_the_fused_model_not_the_sequential_one():
    m = _perturbed()
    idx = torch.randint(0, m.config.vocab_size, (1, 16))
    with torch.no_grad():
        ref, fused = m(idx), snlp.fused_forward(m, idx, "2xF2-h0-K8")
        par = snlp.parallel_forward(m, idx, "2xF2-h0-K8")
        m1 = snlp.parallel_forward(m, idx, "4xF1-h0-K4")
    assert (par - fused).abs().max() < 1e-9
    assert (par - ref).abs().max() > 1e-2  # the fused model is another model
    assert (m1 - ref).abs().max() < 1e-9  # M = 1: the fused model is the sequential one


def _command_flags() -> dict[str, set[str]]:
    """Each sub-command's long options, from the real parsers (building them imports no torch)."""
    from snlp.apps.cli import build_parser

    return {name: {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
            for name, sub in build_parser().commands.items()}


GUIDES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]  # not records/


def _invocations(text: str, commands) -> list[tuple[int, str, str]]:
    """(line, command, the text of its arguments) for every `snlp CMD ...` of a markdown text: inside inline code up
    to the closing backtick, elsewhere (code blocks) to a comment (` # `), a table cell's end or the line's end."""
    out = []
    names = "|".join(sorted(map(re.escape, commands), key=len, reverse=True))
    for i, line in enumerate(text.splitlines(), 1):
        for m in re.finditer(rf"(`?)(?:python -m |-m )?\bsnlp ({names})(?![\w-])", line):
            rest = line[m.end():]
            end = rest.find("`") if m.group(1) else len(rest)
            rest = rest[:end if end >= 0 else len(rest)].split("|")[0].split(" # ")[0]
            out.append((i, m.group(2), rest))
    return out


def test_every_flag_a_guide_gives_a_command_exists():
    """`snlp CMD --flag` in the README, CONTRIBUTING.md and the guides (docs/*.md; the dated records keep the
    flags of their day) names a flag CMD's parser has, so a command copied from a guide runs; so does every flag of
    a guide's "## Options" section, for the commands whose cli.md tables it links."""
    flags = _command_flags()
    bad = []
    for f in GUIDES:
        if f.name == "cli.md":  # generated from the parsers; its help texts name other commands in prose
            continue
        for i, cmd, rest in _invocations(f.read_text(), flags):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                if flag not in flags[cmd]:
                    bad.append(f"{f.relative_to(ROOT)}:{i}: snlp {cmd} has no {flag}")
        # an "## Options" section names its commands by linking their tables in cli.md; its flags are theirs
        for sec in re.findall(r"(?ms)^## Options\n(.*?)(?=^## |\Z)", f.read_text()):
            cmds = set(re.findall(r"cli\.md#snlp-([\w-]+)|<!-- flags: snlp ([\w-]+)", sec))
            cmds = {a or b for a, b in cmds}
            sec = re.sub(r"`pip [^`]*`", "", sec)  # another program's flags
            known = set().union(*(flags[c] for c in cmds if c in flags))
            for flag in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", sec)) - known):
                bad.append(f"{f.relative_to(ROOT)}: Options of {sorted(cmds)} name {flag}, which none of them has")
    assert not bad, "\n".join(bad)


def test_every_options_table_lists_exactly_its_commands_flags():
    """An options table marked `<!-- flags: snlp CMD -->` lists CMD's long options, each once, and every one of them
    (`--help` aside): the reference cannot drift from the parser."""
    flags = _command_flags()
    bad, seen = [], 0
    for f in GUIDES:
        text = f.read_text()
        for m in re.finditer(r"<!-- flags: snlp ([\w-]+)(?: except ([^>]*?))? -->\n((?:\|.*\n?)+)", text):
            seen += 1
            cmd, skip = m.group(1), set((m.group(2) or "").split())
            rows = [r.split("|")[1] for r in m.group(3).splitlines()[2:]]
            listed = [fl for cell in rows for fl in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", cell)]
            want = flags[cmd] - {"--help"} - skip
            if set(listed) != want or len(listed) != len(set(listed)):
                dup = sorted({x for x in listed if listed.count(x) > 1})
                bad.append(f"{f.name}: snlp {cmd}: missing {sorted(want - set(listed))}, "
                           f"unknown {sorted(set(listed) - want)}, twice {dup}")
    assert seen, "no options table is marked"
    assert not bad, "\n".join(bad)


def _resolves(name: str) -> bool:
    """`snlp.a.b.c` names something: the longest importable module prefix, then attributes."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return False
        return True
    return False


def test_every_python_name_a_guide_gives_exists():
    """Every dotted `snlp.x.y` name and every `from snlp.x import a, b` of the README, CONTRIBUTING.md and the guides
    names something importable, so a call copied from a guide does not end in an AttributeError or ImportError (a
    guide once sent readers to `snlp.early_exit`, `snlp.fit`, `snlp.TrainConfig` and `snlp.distload`)."""
    bad = []
    for f in DOCS:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            names = re.findall(r"(?<![\w./-])snlp(?:\.[A-Za-z_]\w*)+", line)
            for mod, items in re.findall(r"from (snlp[\w.]*) import ([\w, ]+)", line):
                names += [f"{mod}.{n.strip()}" for n in items.split(",") if n.strip()]
            bad += [f"{f.relative_to(ROOT)}:{i}: {n}" for n in names if not _resolves(n)]
    assert not bad, "\n".join(bad)


def test_a_guides_train_command_regularises_fewer_layers_than_its_model_has():
    """`snlp train --reg-n N` on a model of depth L <= N regularises a suffix of L - 1 layers, not N (the trainer clips
    it with a warning): a guide's command that does so says one model and trains another. The depth is the line's
    `--depth` or the parser's default; a line with `--init-from` takes its depth from the checkpoint and is skipped."""
    from snlp.apps.cli import build_parser

    default = build_parser().commands["train"].get_default("depth")
    bad = []
    for f in GUIDES:
        for i, cmd, rest in _invocations(f.read_text(), ["train"]):
            reg = re.search(r"--reg-n[ =]([\d,]+)", rest)
            if not reg or "--init-from" in rest:
                continue
            depth = re.search(r"--depth[ =](\d+)", rest)
            depth = int(depth.group(1)) if depth else default
            if max(int(n) for n in reg.group(1).split(",") if n) >= depth:
                bad.append(f"{f.relative_to(ROOT)}:{i}: --reg-n {reg.group(1)} on depth {depth}")
    assert not bad, "\n".join(bad)


def test_a_plan_strings_first_number_is_named_the_chunk_count():
    """In `12xF2-h0-K1` the 12 is the number of chunks C (the suffix is N = C·M = 24 layers): the docs write the pattern
    `CxFM`, never `NxFM` (a guide once said the first number was the suffix length), and the parser agrees."""
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in DOCS
           for i, line in enumerate(f.read_text().splitlines(), 1) if re.search(r"\bNxF", line)]
    plan = snlp.Plan.parse("12xF2-h0-K1")
    assert (plan.chunks, plan.fuse, plan.n_suffix) == (12, 2, 24)
    assert not bad, "\n".join(bad)


def _linked_text(src: Path, target: str) -> str:
    """The text a link lands on: the whole file, or with `#anchor` its section (to the next heading of its level
    or above)."""
    path, _, anchor = target.partition("#")
    text = (src.parent / path).read_text()
    if not anchor:
        return text
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if (m := re.match(r"(#+) (.*)$", x)) and _slug(m.group(2)) == anchor)
    level = len(re.match(r"#+", lines[start]).group(0))
    end = next((i for i in range(start + 1, len(lines))
                if (m := re.match(r"(#+) ", lines[i])) and len(m.group(1)) <= level), len(lines))
    return "\n".join(lines[start:end])


def test_each_readme_guide_row_links_a_page_that_covers_the_commands_it_names():
    """A row of the README's guide table that names `snlp CMD` links a page (or section) where CMD appears: the
    row for self-speculative decoding named `snlp tune` and linked only usage.md's Train, generate section, which
    never mentions it (its section is Tune: choose the plan by measurement)."""
    readme = ROOT / "README.md"
    rows = [x for x in readme.read_text().split("## Guides", 1)[1].split("\n## ", 1)[0].splitlines()
            if x.startswith("| [")]
    bad = []
    for row in rows:
        pages = "\n".join(_linked_text(readme, t) for t in re.findall(r"\]\(([^)\s]+)\)", row))
        for cmd in re.findall(r"`snlp (\w[\w-]*)", row):
            if f"snlp {cmd}" not in pages:
                bad.append(f"README guide row {row.split('|')[1].strip()}: names `snlp {cmd}`, its links do not")
    assert rows and not bad, "\n".join(bad)


def test_distributed_cost_model_summary_is_what_the_model_predicts():
    """docs/distributed.md keeps one row per shape and link of the cost model's tables (the full tables moved to a
    dated record): each row's figures are snlp.dist.costmodel.predict's at the page's inputs (8 devices, bf16, the
    3350 GB/s roofline at 0.7, a 20 us op floor; NVLink-class 3600 Gbit/s 2 us, PCIe-class 256 Gbit/s 10 us), SNLP
    on 1 device its prediction at P = 1; and the row's plan is the fastest of the plans its command models."""
    import dataclasses

    from snlp.dist.costmodel import SHAPES, Link, predict, roofline_layer_ms
    from snlp.method.plan import Plan

    text = (ROOT / "docs" / "distributed.md").read_text()
    table = text.split("The fastest SNLP plan modelled per shape and link", 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in table.splitlines()[2:]]
    links = {"NVLink": Link(3600, 2), "PCIe": Link(256, 10)}
    modelled = {"0.5B": "8xF1-h0-K1,12xF1-h0-K2,24xF1-h0-K2", "3B": "8xF1-h0-K1,12xF1-h0-K2,24xF1-h0-K2",
                "70B": "8xF4-h0-K1,16xF4-h0-K2,40xF2-h0-K2"}
    assert len(rows) == 6
    for shape_name, link_name, plan, seq, tp, snlp_ms, one, vs_seq, vs_tp in rows:
        shape = dataclasses.replace(SHAPES[shape_name], dtype_bytes=2)
        link = links[link_name.split("-")[0]]
        layer, head = roofline_layer_ms(shape, 3350, 0.7)

        def at(p, devices):
            return predict(shape, Plan.parse(p, shape.n_layer), devices, link, layer, head, floor_ms=0.02)

        got = at(plan, 8)
        want = [f"{got.sequential_ms:.3f}", f"{got.tensor_parallel_ms:.3f}", f"{got.snlp_ms:.3f}",
                f"{at(plan, 1).snlp_ms:.3f}", f"{got.sequential_ms / got.snlp_ms:.2f}x",
                f"{got.tensor_parallel_ms / got.snlp_ms:.2f}x"]
        assert [seq, tp, snlp_ms, one, vs_seq, vs_tp] == want, (shape_name, link_name)
        fastest = min(modelled[shape_name].split(","), key=lambda p: at(p, 8).snlp_ms)
        assert plan == fastest, (shape_name, link_name)


def test_a_guides_command_on_a_checkpoint_it_trains_fits_that_model():
    """A guide's command on a checkpoint that guide trains (`snlp train --out DIR`, at its `--depth` or the parser's
    default) names only layers and plans that model has: `--layers` below its depth, every plan's suffix C·M at most
    its depth. usage.md ran `snlp analyze runs/y --layers 12,13,14,15` on its depth-8 runs/y, which answers
    "--layers must lie in 0..7". A directory a guide trains at two depths, or with `--init-from`, is left out (each
    guide is read on its own: training.md's runs/y has depth 12)."""
    from snlp.apps.cli import build_parser

    commands = build_parser().commands
    default = commands["train"].get_default("depth")
    bad, checked = [], 0
    for f in GUIDES:
        if f.name == "cli.md":
            continue
        text, depths = f.read_text(), {}
        for _, _, rest in _invocations(text, ["train"]):
            out = re.search(r"--out[ =](\S+)", rest)
            if out and "--init-from" not in rest:
                depth = re.search(r"--depth[ =](\d+)", rest)
                depths.setdefault(out.group(1).rstrip("/"), set()).add(int(depth.group(1)) if depth else default)
        known = {d: next(iter(s)) for d, s in depths.items() if len(s) == 1}
        for i, cmd, rest in _invocations(text, [c for c in commands if c != "train"]):
            words = rest.split()
            ckpt = re.search(r"--ckpt[ =](\S+)", rest)
            ckpt = ckpt.group(1) if ckpt else (words[0] if words and not words[0].startswith("-") else "")
            depth = known.get(ckpt.rstrip("/"))
            if depth is None:
                continue
            checked += 1
            layers = re.search(r"--layers[ =]([\d,]+)", rest)
            if layers and max(int(x) for x in layers.group(1).split(",") if x) >= depth:
                bad.append(f"{f.relative_to(ROOT)}:{i}: snlp {cmd} {ckpt} --layers {layers.group(1)} (depth {depth})")
            for spec in re.findall(r"--plans?[ =](\S+)", rest):
                for p in spec.split(","):
                    if re.fullmatch(r"\d+xF\d+-\S+", p) and snlp.Plan.parse(p).n_suffix > depth:
                        bad.append(f"{f.relative_to(ROOT)}:{i}: snlp {cmd} {ckpt} plan {p} (depth {depth})")
    assert checked, "no guide command on a checkpoint a guide trains was found"
    assert not bad, "\n".join(bad)


def test_the_quick_speedruns_wall_time_is_stated_once_as_measured():
    """--quick's wall time was stated four ways: the help "under a minute on 2 idle cores", the description "about a
    minute", speedrun.md and quickstart.md "a minute or two", the module docstring "under a minute"; the record
    measured 0:35 idle and 1:40 at load 4-6. Every place that times it now gives the measured figures."""
    import snlp.apps.speedrun as speedrun
    from snlp.apps.speedrun.flags import QUICK_RECORD, QUICK_WALL

    record = (ROOT / QUICK_RECORD).read_text()
    assert "| 0:35 |" in record and "`snlp speedrun --quick` 1:40" in record and "load 4-6" in record
    help_text = next(a.help for a in _speedrun_parser()._actions if "--quick" in a.option_strings)
    places = {"--help": help_text, "module docstring": speedrun.__doc__, "DESCRIPTION": speedrun.DESCRIPTION,
              **{p.name: p.read_text() for p in (ROOT / "docs/speedrun.md", ROOT / "docs/quickstart.md")}}
    for name, text in places.items():
        lines = [ln for ln in text.splitlines() if "--quick" in ln and re.search(r"minute|\d+ s\b|\d:\d\d", ln)]
        lines = lines or [text]  # the help: one paragraph
        for ln in lines:
            assert QUICK_WALL in re.sub(r"\s+", " ", ln), (name, ln)


def _speedrun_parser():
    import argparse

    from snlp.apps.speedrun.flags import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_speedrun_md_excerpt_rows_are_the_reports_cells_with_their_marks():
    """docs/speedrun.md's excerpt of the --steps 444 report dropped the `*` (Pareto front) and `†` (drafter) marks of
    the main-table rows it keeps and the bold of the SSD rows resolved from sequential. Every excerpt row is now the
    report's row, cell for cell in the columns kept (the model column carried down as the report prints it)."""
    doc = (ROOT / "docs/speedrun.md").read_text()
    report = (ROOT / "docs/records/speedrun-2026-11-27-steps444/report.txt").read_text()

    def tables(text):
        out, cur = [], []
        for ln in text.splitlines() + [""]:
            if ln.startswith("|"):
                cur.append([c.strip() for c in ln.strip().strip("|").split("|")])
            elif cur:
                out.append((cur[0], cur[2:]))
                cur = []
        return out

    def rows(head, body):
        model, out = "", []
        for r in body:
            model = r[0] if "Model" in head[0] and r[0] else model
            d = dict(zip(head, r))
            d["_model"] = model.split(" [")[0]
            out.append(d)
        return out

    full = [(h, rows(h, b)) for h, b in tables(report)]
    main = next(rs for h, rs in full if h[:3] == ["Model", "Config", "K"])
    ssd = next(rs for h, rs in full if h[:3] == ["Model", "Drafter", "s"])
    excerpts = [(h, rows(h, b)) for h, b in tables(doc.split("An excerpt of a real")[1].split("The stages run")[0])]
    assert len(excerpts) == 2
    plain = lambda c: c.replace("*", "").replace("†", "")  # noqa: E731
    for d in excerpts[0][1]:
        src = next(r for r in main if r["_model"] == d["_model"] and plain(r["Config"]) == plain(d["Config"])
                   and r["K"] == d["K"])
        for col in excerpts[0][0][1:]:
            assert d[col] == src[col], (d["_model"], d["Config"], d["K"], col, d[col], src[col])
    for d in excerpts[1][1]:
        src = next(r for r in ssd if r["B"] == d["B"] and r["_model"] == "IDN Reg.")
        for col in excerpts[1][0]:
            assert d[col] == src[col], (d["B"], col, d[col], src[col])
