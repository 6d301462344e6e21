"""Autoregressive KV-cached decoding: sequential (the reference) and SNLP (every forward an SNLP solve).

Modes (all share one static KV cache, snlp.model.cache.KVCache, through snlp.decode.session):
  sequential   the model's own cached decoding, one token per forward.
  snlp         every forward is an SNLP solve with the cache (approximate unless K >= Plan.exact_iters(), the
               chunk count in the forward order, without tol: then it is the fused model of the plan, the original
               model for M = 1).
  speculative  snlp.decode.speculative: the SNLP forward drafts, the sequential model verifies (exact).
  jacobi       snlp.decode.jacobi: Jacobi decoding over a block of future tokens.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from snlp.decode.batch import batch_autoregressive, check_decode_inputs, is_batch
from snlp.decode.penalty import check_repetition_penalty
from snlp.decode.session import (DecodeSession, GenerateResult, check_decode_args, check_picked, check_read_every,
                                 decode_plan, make_generator, read_every, sampling, sequential_forward,
                                 snlp_forward, step_slack)
from snlp.decode.steps import EagerStep, Step
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.model.gpt import GPT, check_gpt
from snlp.runtime.checks import check_bools

MODES = ("sequential", "snlp", "speculative", "jacobi")


def _autoregressive(model, prompt_ids, forward, mode, plan, max_new_tokens, how, eos_id, seed, max_len,
                    on_tokens, every, penalty: float = 1.0) -> GenerateResult:
    # max_new_tokens, the sampling (how), every and the penalty are checked by the callers, before the step is built
    if is_batch(prompt_ids):
        return batch_autoregressive(model, prompt_ids, forward, mode, plan, max_new_tokens, how, eos_id, seed,
                                    max_len, on_tokens, every, penalty)
    with torch.inference_mode():
        ses = DecodeSession(model, prompt_ids, max_new_tokens, eos_id, max_len, on_tokens, mode, forward,
                            step_slack(forward), penalty=penalty)
        every = read_every(ses.device, every)
        ses.result.plan = None if plan is None else str(plan)
        gen = None if how.greedy else [make_generator(seed, ses.device)]
        ses.warm(forward, [1])  # and the prefill's graph in ses.prefill
        ses.prefill(forward)
        res = ses.result
        x = ses.ids([ses.last])  # (1, 1): the loop's only host-to-device copy; later steps feed the picked token
        while not ses.done:
            t0 = time.perf_counter()  # the device is idle here: the prefill's clock, then each read, waited for it
            n = min(every, ses.remaining)
            picked = []
            for _ in range(n):
                logits = forward(x, ses.cache)[:, -1]  # (1, V)
                tok = ses.pick_tensor(logits, how, gen, flag=True)  # (1,), on the device; penalised, marked seen
                picked.append(tok)
                # NONFINITE (-1) is no token id; the steps after it are computed but never emitted (check_picked)
                x = tok.clamp_min(0)[:, None]  # (1, 1)
            # n tokens in one read; NaN/inf logits come back as NONFINITE and raise below, naming the plan or the
            # model's own forward, in order, so an error names the same token as a read per step would
            toks = torch.cat(picked).tolist()
            res.step_s += time.perf_counter() - t0  # the read waited for the device: timed without a sync
            res.steps += n
            res.forwards += n
            for nxt in toks:
                check_picked([nxt], plan, len(ses.out), model=model, context=lambda j: ses.prompt + ses.out)
                ses.emit([nxt])
                if ses.done:
                    break
        return ses.finish()


def sequential_generate(model: GPT, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0,
                        eos_id: int | list[int] | None = None, seed: int | None = None, max_len: int | None = None,
                        on_tokens: Callable[[list[int]], bool | None] | None = None, compile: bool = False,
                        step: Step | EagerStep | None = None, read_every: int | None = None, top_k: int = 0,
                        top_p: float = 1.0, repetition_penalty: float = 1.0) -> GenerateResult | list[GenerateResult]:
    """KV-cached sequential decoding (the reference). Greedy at temperature 0, else a draw from softmax(logits /
    temperature), filtered by `top_k` / `top_p` as transformers filters it (snlp.decode.session.Sampling).
    `compile`: the prefill and the decode step run as compiled static-shape steps (snlp.decode.steps; compiled
    before timing, compile_s); `step` passes a prebuilt one (snlp.decode.steps.sequential_step) so repeated calls
    share its graphs (one built for another model, or an SNLP step, is refused).
    A list of prompts (or a (B, T) tensor, B > 1) is decoded as one ragged batch (snlp.decode.batch) and returns one
    GenerateResult per prompt, each row's tokens those of its own single-prompt run; `on_tokens(i, new)` then streams
    prompt i's tokens. A model whose own forward gives NaN/inf logits raises NonFiniteModelError naming the generated
    token and its position (flagged on the host read of each step's token, no extra sync) instead of emitting
    tokens read off them. `read_every`: decode steps queued between host reads of the tokens (snlp.decode.session.
    read_every; None: 1 on the CPU, 8 on an accelerator), the tokens unchanged (but for near-ties of an eager
    batch in bf16 / fp16, see read_every). `repetition_penalty` p (1: none): transformers' repetition penalty
    (snlp.decode.penalty): the logit of every id already in the row's sequence, its prompt included, divided by p
    where positive and multiplied by p where negative, before the sampling filters, greedy or sampled, so the tokens
    are those of generate(repetition_penalty=p) on the same weights."""
    check_gpt(model)
    check_bools(compile=compile)
    check_decode_args(max_new_tokens, temperature)  # before a step is built
    how = sampling(temperature, top_k, top_p, seed)
    penalty = check_repetition_penalty(repetition_penalty)
    check_read_every(read_every)
    check_decode_inputs(model, prompt_ids, max_new_tokens, max_len, eos_id, on_tokens=on_tokens, seed=seed)
    return _autoregressive(model, prompt_ids, sequential_forward(model, compile, step), "sequential", None,
                           max_new_tokens, how, eos_id, seed, max_len, on_tokens, read_every, penalty)


def snlp_generate(model: GPT, prompt_ids, plan: Plan | str, max_new_tokens: int = 64, temperature: float = 0.0,
                  eos_id: int | list[int] | None = None, seed: int | None = None, max_len: int | None = None,
                  on_tokens: Callable[[list[int]], bool | None] | None = None, compile: bool = False,
                  step: Step | EagerStep | None = None, preheat: Preheat | None = None,
                  read_every: int | None = None, top_k: int = 0, top_p: float = 1.0,
                  repetition_penalty: float = 1.0) -> GenerateResult | list[GenerateResult]:
    """KV-cached decoding with every forward (prefill included) an SNLP solve. Suffix K/V in the
    cache are those of the last iteration's inputs; for K >= plan.exact_iters() (the chunk count in the forward
    order, more in others: 11 for 6xF1-...-order:reversed) without `tol` (which may stop a row's solve before) this
    is exactly the fused model of `plan` decoded sequentially (the original model for M = 1). Where the solve
    evaluates the suffix at most once (K = 1 from an h0 or preheat init, with the idn, none or hcn surrogate; K = 0
    from any init) it gives the tokens of the plan run over
    the whole prefix at every step (the paper's AR loop, snlp.eval.protocol.recomputed_greedy); for
    1 < K < exact_iters(), a fwd init below it (its batched forward is one more evaluation) or the diag / newton
    surrogates at K = 1 (their Jacobian
    estimate evaluates the chunks again, at perturbed or differentiated inputs), it does not: the re-solved prefix
    attends at evaluation k to the earlier positions' evaluation-k K/V, the cache to their last. `compile` / `step`: as in
    `sequential_generate` (snlp.decode.steps.snlp_step of this model and plan). `preheat`: the calibration a -preheat- plan needs. A list of
    prompts: one ragged batch, one result per prompt, as in `sequential_generate` (a `tol` plan freezes each row on
    its own, so a row's tokens do not depend on the batch). A plan whose solve turns NaN/inf raises
    SNLPDivergenceError naming the generated token whose logits held them (flagged on the host read of each step's
    tokens, no extra sync) instead of emitting tokens read off them. `read_every`, `top_k`, `top_p`,
    `repetition_penalty`: as in `sequential_generate` (the penalty acts on the plan's logits)."""
    plan = decode_plan(model, plan)
    check_bools(compile=compile)
    check_decode_args(max_new_tokens, temperature)  # before the plan is bound
    how = sampling(temperature, top_k, top_p, seed)
    penalty = check_repetition_penalty(repetition_penalty)
    check_read_every(read_every)
    check_decode_inputs(model, prompt_ids, max_new_tokens, max_len, eos_id, plan, on_tokens=on_tokens, seed=seed)
    return _autoregressive(model, prompt_ids, snlp_forward(model, plan, compile, step, preheat), "snlp", plan,
                           max_new_tokens, how, eos_id, seed, max_len, on_tokens, read_every, penalty)
