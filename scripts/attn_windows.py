"""Sliding-window attention: which kernel pays for the window only? Times one attention call of the paper's
0.5B shape (5 heads of 128, T = 2048, short window 512, bf16 on CUDA) in each formulation, single layer and a
24-branch fused stack (C*M = 24 layers' heads in one call, 18 short + 6 full as in an SSSL suffix), and checks
each against the masked reference (max abs error).

    PYTHONPATH=$PWD python3 scripts/attn_windows.py [--device cuda] [--tokens 2048] [--window 512] [--json F]

Formulations: sdpa_causal (flash, full causal: the lower bound and the paper's fused path), sdpa_float_mask
(snlp today: an additive mask), sdpa_bool_mask (the paper's sequential), banded (query blocks of w attend their
own and the previous key block: 2w keys, one shared (w, 2w) mask), flex (FlexAttention, block-sparse
sliding-window mask, compiled; snlp's own `flex_window_attention` too: block lists built in the graph, a stack's
branches along the batch dim), and for the stack: grouped (full branches through is_causal, short ones
through the best short formulation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from snlp.model import ops


def window_mask(T, w, device, dtype):
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    vis = (j <= i) & (i - j < w)
    return torch.zeros(T, T, device=device, dtype=dtype).masked_fill(~vis, float("-inf")), vis


def banded(q, k, v, w):
    """q, k, v (B, H, T, hd), T % w == 0: block b of queries attends key blocks b-1 and b (2w keys)."""
    B, H, T, hd = q.shape
    n = T // w
    qb = q.view(B, H, n, w, hd)
    kb = k.view(B, H, n, w, hd)
    vb = v.view(B, H, n, w, hd)
    pad = lambda x: torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], dim=2)  # noqa: E731
    k2 = torch.cat([pad(kb), kb], dim=3)  # (B, H, n, 2w, hd)
    v2 = torch.cat([pad(vb), vb], dim=3)
    i = torch.arange(w, device=q.device)[:, None] + w
    j = torch.arange(2 * w, device=q.device)[None, :]
    vis = (j <= i) & (i - j < w)  # (w, 2w), the same for every block
    first = vis.clone()
    first[:, :w] = False  # block 0 has no previous block
    m = torch.stack([first] + [vis] * (n - 1))  # (n, w, 2w)
    mask = torch.zeros(m.shape, device=q.device, dtype=q.dtype).masked_fill(~m, float("-inf"))
    y = F.scaled_dot_product_attention(qb, k2, v2, attn_mask=mask)
    return y.reshape(B, H, T, hd)


def timeit(fn, device, warmup=10, runs=50):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--branches", type=int, default=24)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    T, w, hd = a.tokens, a.window, a.head_dim
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "T": T, "window": w, "rows": []}
    fm, vis = window_mask(T, w, dev, dt)
    flex = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001
        out["flex_error"] = repr(e)
    snlp_flex = torch.compile(ops.flex_window_attention, dynamic=False) if flex is not None else None
    for label, H in (("layer", a.heads), ("stack", a.heads * a.branches)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, H, T, hd, device=dev, dtype=dt) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=vis)
        fns = {
            "sdpa_causal (full, not windowed)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "sdpa_float_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fm),
            "sdpa_bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=vis),
            "banded (5-D, one cat)": lambda: banded(q, k, v, w),
            # snlp's window w sees w + 1 keys (position - j <= w); this script's masks see w (i - j < w)
            "snlp banded_attention": lambda: ops.banded_attention(q, k, v, w - 1, {}),
        }
        if flex is not None:
            try:
                def sw(b, h, qi, ki):
                    return (ki <= qi) & (qi - ki < w)
                bm = create_block_mask(sw, None, None, T, T, device=str(dev))
                fns["flex (compiled)"] = lambda: flex(q, k, v, block_mask=bm)
            except Exception as e:  # noqa: BLE001
                out.setdefault("errors", []).append(f"{label} flex: {e!r}")
        if label == "layer" and snlp_flex is not None:
            fns["snlp flex_window_attention (compiled)"] = lambda: snlp_flex(q, k, v, w - 1, 1)
        if label == "stack":
            nl = a.branches // 4  # SSSL: one full branch in four
            Hs = a.heads * (a.branches - nl)
            qs, ks, vs = q[:, :Hs], k[:, :Hs], v[:, :Hs]
            ql, kl, vl = q[:, Hs:], k[:, Hs:], v[:, Hs:]
            full_ref = F.scaled_dot_product_attention(q[:, Hs:].float(), k[:, Hs:].float(), v[:, Hs:].float(),
                                                      is_causal=True)
            ref = torch.cat([ref[:, :Hs], full_ref], dim=1)
            fns.pop("sdpa_causal (full, not windowed)")
            m_mixed = torch.cat([fm.expand(Hs, T, T), torch.zeros(T, T, device=dev, dtype=dt).masked_fill(
                ~torch.ones(T, T, dtype=torch.bool, device=dev).tril(), float("-inf")).expand(H - Hs, T, T)])
            fns["sdpa_float_mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m_mixed[None])
            fns.pop("sdpa_bool_mask")
            fns.pop("banded (5-D, one cat)")
            fns.pop("snlp banded_attention")
            # snlp's grouped stack through ops.attend_branches: branches of `heads` heads, the short ones first as
            # in the reference above (the grouping gathers by index either way)
            nb = a.branches
            bw = tuple(w - 1 if i < nb - nl else -1 for i in range(nb))  # snlp's w - 1 = this script's w
            groups = ops.window_groups(bw, dev)
            qg, kg, vg = (t.view(1, nb, a.heads, T, hd).transpose(0, 1) for t in (q, k, v))  # (N, 1, H, T, hd)

            def grouped(kind):
                prev = ops.set_window_kernel(kind)
                try:
                    return ops.attend_branches(qg, kg, vg, bw, groups, {}).transpose(0, 1).reshape(1, H, T, hd)
                finally:
                    ops.set_window_kernel(prev)
            if snlp_flex is not None:  # snlp's own flex path: branches along the batch dim, windows read by the mask
                bwt = torch.tensor(bw, device=dev)
                fns["snlp flex_window_attention (compiled)"] = lambda: snlp_flex(
                    qg[:, 0], kg[:, 0], vg[:, 0], bwt, 1).unsqueeze(0).reshape(1, H, T, hd)
            fns["snlp attend_branches (masked)"] = lambda: grouped("masked")
            fns["snlp attend_branches (banded)"] = lambda: grouped("banded")
            fns["grouped: mask + causal"] = lambda: torch.cat([F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=fm), F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)], dim=1)
            if flex is not None:
                try:
                    wins = torch.tensor([w] * Hs + [T + 1] * (H - Hs), device=dev)

                    def hw(b, h, qi, ki):
                        return (ki <= qi) & (qi - ki < wins[h])
                    bmh = create_block_mask(hw, None, H, T, T, device=str(dev))
                    fns["flex per-head window (compiled)"] = lambda: flex(q, k, v, block_mask=bmh)
                    fns.pop("flex (compiled)", None)
                except Exception as e:  # noqa: BLE001
                    out.setdefault("errors", []).append(f"stack flex: {e!r}")
        for name, fn in fns.items():
            try:
                t0 = time.perf_counter()
                y = fn()
                first_s = time.perf_counter() - t0
                err = (y.float() - ref).abs().max().item()
                ms = timeit(fn, dev, runs=a.runs)
                out["rows"].append(dict(case=label, heads=H, formulation=name, ms=ms, max_abs_err=err,
                                        first_call_s=first_s))
            except Exception as e:  # noqa: BLE001
                out["rows"].append(dict(case=label, heads=H, formulation=name, error=repr(e)[:300]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print("| case | heads | formulation | ms | max abs err vs fp32 masked | first call s |\n|---|---|---|---|---|---|")
    for r in out["rows"]:
        if "error" in r:
            print(f"| {r['case']} | {r['heads']} | {r['formulation']} | ERROR {r['error'][:80]} | | |")
        else:
            print(f"| {r['case']} | {r['heads']} | {r['formulation']} | {r['ms']:.3f} | {r['max_abs_err']:.2e} | "
                  f"{r['first_call_s']:.1f} |")
    for e in out.get("errors", []):
        print("error:", e)


if __name__ == "__main__":
    main()
