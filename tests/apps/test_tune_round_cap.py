"""The drafter-choice table's measured tokens per round come from short decodes whose last round the token budget
cuts: the report states that bound (16 tokens at B = 4 average at most 4.0 per round, not B + 1 = 5), taken from
running speculative decoding itself with a drafter that is always accepted."""

import pytest
from conftest import make_model
from test_speedrun import _report_ctx

from snlp.apps.report import render_report
from snlp.decode.speculative import max_tokens_per_round, speculative_generate


@pytest.mark.parametrize("tokens,block", [(16, 4), (64, 4), (15, 4), (7, 2), (1, 8), (9, 8)])
def test_the_bound_is_what_an_always_accepted_drafter_averages(tokens, block):
    """Outside reference: the decode itself. An exact plan (K >= C, M = 1: the model) in float64 drafts what the
    verifier picks, so every draft is accepted and tokens / rounds is the most a decode of this length allows."""
    m = make_model(sequence_len=128).eval()
    res = speculative_generate(m, [3, 1, 4, 1], "6xF1-h0-K6", block=block, max_new_tokens=tokens)
    assert len(res.tokens) == tokens and res.accepted == res.drafted  # (1 token: no draft at all)
    assert res.tokens_per_round == pytest.approx(max_tokens_per_round(tokens, block), rel=1e-12)


def test_the_report_states_the_cap_of_the_measured_tokens_per_round():
    ctx = _report_ctx()
    for k in ("noreg", "idn"):
        ctx["stages"][f"ssd-{k}"]["result"]["tune_tokens"] = 16
    tune = render_report(ctx).split("### Drafter choice")[1].split("\n#")[0]
    rows = [line for line in tune.splitlines() if line.startswith("| ") and "12xF1-h0-K1" in line]
    assert len(rows) == 2 and all("4.40 (≤ 4.00)" in r for r in rows)  # the synthetic 4.40 exceeds the bound: shown as is
    assert "decodes of 16 tokens per prompt" in tune and "not against B + 1" in tune
    old = render_report(_report_ctx()).split("### Drafter choice")[1].split("\n#")[0]  # records made before the bound was stored
    assert "(≤" not in old and "decodes of" not in old
