"""Greedy Jacobi decoding, with the sequential model or an SNLP plan as the Jacobi forward (paper App.
"Coupling SNLP with Jacobi Decoding"): verified (exact) or unverified (the paper's measurement mode)."""

from __future__ import annotations

from typing import Callable

from snlp.decode.batch import check_decode_inputs, is_batch
from snlp.decode.penalty import check_repetition_penalty
from snlp.decode.session import (GREEDY, NONFINITE, DecodeSession, GenerateResult, check_decode_args, check_picked,
                                 decode_plan, pick_tokens, sequential_forward)
from snlp.decode.steps import snlp_step
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import bind
from snlp.model.gpt import GPT, check_gpt
from snlp.runtime.checks import check_bools
from snlp.runtime.timing import now

import torch


def jacobi_generate(model: GPT, prompt_ids, plan: Plan | str | None = None, block: int = 4,
                    max_new_tokens: int = 64, eos_id: int | list[int] | None = None, max_iters: int | None = None,
                    max_len: int | None = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
                    verify: bool = True, warm_start: bool = False, preheat: Preheat | None = None,
                    repetition_penalty: float = 1.0) -> GenerateResult:
    """Greedy Jacobi decoding (Santilli et al. 2023) of blocks of `block` future tokens (the
    lookahead window W). Each iteration feeds [last, g_1..g_B] in one cached forward and replaces
    the guesses by the argmax predictions, until a fixed point or `max_iters` (default B+1, enough
    for an exact forward).

    With `plan` every iteration is an SNLP forward. `verify` (the decoding mode): the final guesses
    are checked by one sequential forward (longest agreeing prefix + 1 token kept), so the output
    equals sequential greedy decoding. `verify=False` (the measurement mode of the paper's
    JD-coupling table, App. "Coupling SNLP with Jacobi Decoding"): the round keeps the longest
    prefix of the guesses that the LAST SNLP iteration reproduces, plus its next prediction, with no
    sequential forward, so the output may differ from sequential greedy decoding (compare with
    `metrics.ar_match`); a plan whose solve turns NaN/inf then raises SNLPDivergenceError (verified, the sequential
    check keeps the output exact and a diverged guess only costs speed). In both modes the prompt is prefilled by
    the model's own forward (its exact K/V), so unverified from plan.exact_iters() on, without `tol` (which may stop
    the solve before), the output is the model's greedy decoding for M = 1 (with `warm_start` from the h0 init's count, plan.with_(init="h0").exact_iters(): C
    in the forward order, since a warm start replaces the fwd init's exact first chunk by stale states), but for
    M > 1 or a causal plan it is neither the model's nor the plan's own decoding (snlp_generate's): the tokens the
    plan generates attend to the model's K/V of the prompt.
    `warm_start` (h0-JD, needs a plan): the first JD iteration of a round
    solves from the plan's init; later ones recompute the prefix state h_S of the new guesses but
    start the suffix chunk states from the previous JD iteration's final states (features of the old
    guesses); without it every iteration is a fresh SNLP solve (naive composition). Without a plan
    the Jacobi forwards are the sequential model itself and the last iteration is the check.
    Counters: jacobi_iters = JD iterations (forwards of the Jacobi model), forwards = jacobi_iters
    plus one sequential check per round when verifying; accepted + rounds = tokens kept before the
    budget/EOS cut. `repetition_penalty` (as in `sequential_generate`): every iteration's position i, and the
    check's, is penalised by the prompt, the tokens kept and the guesses before i, so the verified output is
    `sequential_generate(repetition_penalty=p)`'s."""
    check_gpt(model)
    check_bools(verify=verify, warm_start=warm_start)
    check_decode_args(max_new_tokens, 0.0, block)
    penalty = check_repetition_penalty(repetition_penalty)
    if is_batch(prompt_ids):  # a list of prompts / a (B, T) tensor: refused here, not a TypeError deep inside
        raise ValueError("jacobi_generate decodes one prompt (a list of ids or a (T,) / (1, T) tensor); a list of "
                         "prompts or a (B, T) batch is not supported: decode the prompts one at a time")
    plan = None if plan is None else decode_plan(model, plan)
    check_decode_inputs(model, prompt_ids, max_new_tokens, max_len, eos_id, on_tokens=on_tokens)
    if max_iters is not None and (not isinstance(max_iters, int) or max_iters < 1):
        raise ValueError(f"max_iters must be an integer >= 1 (got {max_iters!r})")
    if warm_start and plan is None:
        raise ValueError("warm_start (h0-JD) warm-starts SNLP chunk states: it needs a plan")
    if preheat is not None and plan is None:  # the sequential model's forwards read no calibration: it went unused
        raise ValueError("preheat= is the calibration of a -preheat- plan; without a plan the Jacobi forwards are the "
                         "sequential model's, which read none: drop preheat= or give a -preheat- plan")
    seq_fwd = sequential_forward(model)
    runner = None if plan is None else bind(model, plan, check_finite=False, preheat=preheat)
    jac_fwd = seq_fwd if plan is None else snlp_step(runner)
    if warm_start:
        def warm_fwd(idx, cache, init):  # -> logits, final chunk states (C, 1, T, D)
            res = runner.solve(idx, cache=cache, keep_states=True, init_states=init)
            return model.head(res.hidden), res.states[-1]
    with torch.inference_mode():
        ses = DecodeSession(model, prompt_ids, max_new_tokens, eos_id, max_len, on_tokens, "jacobi", penalty=penalty)
        res, cache, dev = ses.result, ses.cache, ses.device
        res.plan, res.block = None if plan is None else str(plan), block
        res.extra.update(verify=verify, warm_start=warm_start)
        ses.prefill(seq_fwd)
        pen = ses.penalty  # None at 1

        def judged(logits, ids):  # (1, Bk + 1, V) over ids [last, g_1..g_Bk]: position i penalised by g_1..g_i too
            return logits if pen is None else pen.at_positions(logits, ids[:, 1:])
        carry: list[int] = []  # guesses left over from the previous block
        while not ses.done:
            P, Bk = cache.length, min(block, ses.remaining - 1)
            g = (carry + [ses.last] * Bk)[:Bk]
            t0 = now(dev)
            states = None
            for it in range(max_iters or Bk + 1):
                cache.rollback(P)
                ids = ses.ids([ses.last] + g)  # (1, Bk + 1)
                if warm_start:
                    logits, states = warm_fwd(ids, cache, states)
                else:
                    logits = jac_fwd(ids, cache)
                logits = judged(logits, ids)
                # (Bk+1,); the tokens that are the output (unverified SNLP iterations, or the model's own Jacobi
                # forward) are flagged: NaN/inf logits read as NONFINITE on this host read (no extra sync); verified
                # SNLP iterations only guess (a diverged guess costs speed), the sequential check below is flagged
                flag = plan is None or not verify
                pred = pick_tokens(logits[0], GREEDY, flag=True) if flag else logits[0].argmax(-1).tolist()
                if plan is not None and not verify:
                    check_picked(pred, plan, len(ses.out), model=model,
                                 context=lambda i: ses.prompt + ses.out + g[:i])  # position i's logits: after g[:i]
                res.jacobi_iters += 1
                converged = pred[:Bk] == g
                # a NONFINITE guess is never fed back: the prefix it ends is settled, the check below raises on it
                if converged or it + 1 == (max_iters or Bk + 1) or NONFINITE in pred[:Bk]:
                    break
                g = pred[:Bk]
            t1 = now(dev)
            if plan is not None and verify:  # sequential check of the SNLP-Jacobi fixed point
                g = pred[:Bk]
                cache.rollback(P)
                ids = ses.ids([ses.last] + g)
                pred = pick_tokens(judged(seq_fwd(ids, cache), ids)[0], GREEDY, flag=True)
                res.forwards += 1
            # pred[:n] == g[:n] holds no NONFINITE (g never does): only the model's token pred[n] can be one
            n = next((i for i, (d, t) in enumerate(zip(g, pred)) if d != t), Bk)
            check_picked([pred[n]], None, len(ses.out) + n, model=model, context=lambda i: ses.prompt + ses.out + g[:n])
            cache.rollback(P + n + 1)
            carry = pred[n + 1:]
            carry = carry[: carry.index(NONFINITE)] if NONFINITE in carry else carry
            res.add_round(g, n, ses.stops, steps=it + 1, forwards=it + 1, draft_s=t1 - t0, verify_s=now(dev) - t1)
            if pen is not None:
                pen.add(ses.ids(g[:n] + [pred[n]]))
            ses.emit(g[:n] + [pred[n]])
        return ses.finish()
