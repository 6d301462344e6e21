"""The paired-round statistics of snlp.runtime.stats, under the name the benchmarks and the CLI have imported them
by. They live on the runtime floor so that the floors below bench (the trainer's --time-reg rounds) mark a paired
ratio by the same sign test."""

from snlp.runtime.stats import (  # noqa: F401
    SIGN_LEVEL,
    sign_test_p,
    sign_test_wins,
    fewest_sign_rounds,
    separation_p,
    paired_verdict,
    verdict_text,
    paired_marks,
    paired_fields,
    tie_mark,
    tie_footnote,
    ratio_range,
    p10_p90,
    spread_verdict,
    rank_sum_p,
    unpaired_verdict,
    incomplete_beta,
    t_test_p,
    t_quantile,
)

__all__ = ['SIGN_LEVEL', 'sign_test_p', 'sign_test_wins', 'fewest_sign_rounds', 'separation_p', 'paired_verdict', 'verdict_text', 'paired_marks', 'paired_fields', 'tie_mark', 'tie_footnote', 'ratio_range', 'p10_p90', 'spread_verdict', 'rank_sum_p', 'unpaired_verdict', 'incomplete_beta', 't_test_p', 't_quantile']
