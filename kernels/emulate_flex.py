"""Emulation of flex_attn_fwd.cu (the block-mask kernel and the forward's walk over its tile
lists) with the CUDA C expressions the host generates, translated to Python, against a naive
float64 reference; and a check of those expressions against the Rust float64 reference
(src/attention/flex.rs: FlexMod::visible and FlexMod::modify) on every pair of small shapes.

The input is a JSON file the Rust test writes (tests/kernels_emulate.rs): per modification its
name, mask and score expressions (FlexMod::spec), and per shape the Rust reference's visibility
of every (b, q, kv), its modified score of a grid of scores, and the host block mask
(block_mask_host). Emulated: each thread's element loop of flex_block_mask with the any/all
reductions and the whole-tile test (keys below L, every pair visible), the forward's list walk
(the prefetched next listed tile, zero-filled rows past L), the masking of partial tiles only
(col >= L, row >= Tq, the mask), the score modification on in-bounds pairs, the online softmax
with FlashAttention-2's guard and the store. Not emulated: mma fragments and 16-bit rounding
(the GPU test checks those; flash_fwd's fragments are emulated in emulate_flash.py).

    python3 kernels/emulate_flex.py SPECS.json   # one line per case, "ALL OK" last
"""
import json
import math
import random
import re
import sys

NEG = float("-inf")
INF = float("inf")
# Tile sizes: FLEX_ROWS and FLEX_KEYS, set from the specs file the Rust test writes.
BR = None
BCT = None
NT = None  # threads per CTA, set from the specs file


def cast_float(e):
    """C's `(float)x` and `(float)(...)` as Python's `float(...)`."""
    while "(float)" in e:
        i = e.index("(float)")
        j = i + len("(float)")
        if e[j] == "(":
            depth, k = 0, j
            while True:
                depth += {"(": 1, ")": -1}.get(e[k], 0)
                k += 1
                if depth == 0:
                    break
            e = e[:i] + "float" + e[j:k] + e[k:]
        else:
            m = re.match(r"\w+", e[j:])
            e = e[:i] + "float(" + m.group(0) + ")" + e[j + m.end():]
    return e


def translate(expr):
    """A generated CUDA C expression as Python: &&, ||, !, float literals and casts, exp2f,
    tanhf and kp_tanh (exact here). Anything else the expressions use is Python already (names, [], + - * / < <= ==)."""
    e = expr
    e = re.sub(r"(\d+\.\d*(?:e[-+]?\d+)?)f\b", r"\1", e)
    e = e.replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e)
    e = cast_float(e)
    e = e.replace("exp2f(", "exp2(").replace("tanhf(", "math.tanh(")
    e = e.replace("kp_tanh(", "math.tanh(")
    return e


def compile_mods(spec):
    names = "b, h, q_idx, kv_idx, num_heads, seq_len_q, seq_len_kv, aux"
    env = {"math": math, "exp2": lambda x: 2.0 ** x}
    mask = eval("lambda %s: (%s)" % (names, translate(spec["mask"] or "True")), env)
    score = eval("lambda score, %s: (%s)" % (names, translate(spec["score"] or "score")), env)
    return mask, score


def block_mask(mask, B, H, Tq, Tkv, lens, aux):
    """flex_block_mask: per (qt, h, b) CTA, thread tid takes elements e = tid + NT i."""
    nq, nk = -(-Tq // BR), -(-Tkv // BCT)
    count, index, full = {}, {}, {}
    for b in range(B):
        for h in range(H):
            for qt in range(nq):
                L = min(lens[b], Tkv)
                q0 = qt * BR
                rows = min(BR, Tq - q0)
                lst, fl = [], []
                for kt in range(nk):
                    k0 = kt * BCT
                    avail = L - k0
                    whole_keys = avail >= BCT
                    keys = BCT if whole_keys else max(avail, 0)
                    any_t, all_t = [0] * NT, [1] * NT
                    for tid in range(NT):
                        for e in range(tid, BR * BCT, NT):
                            r, c = e // BCT, e % BCT
                            if r < rows and c < keys:
                                v = bool(mask(b, h, q0 + r, k0 + c, H, Tq, Tkv, aux))
                                any_t[tid] |= v
                                all_t[tid] &= v
                    if any(any_t):  # __syncthreads_or
                        lst.append(kt)
                        fl.append(1 if (all(all_t) and whole_keys) else 0)
                count[b, h, qt] = len(lst)
                index[b, h, qt] = lst
                full[b, h, qt] = fl
    return count, index, full


def forward(mask, score_mod, Q, K, V, B, H, KVH, Tq, Tkv, D, lens, aux, scale, bm):
    """flex_fwd over the block mask's lists (tile values by index; loads zero-filled past L)."""
    count, index, full = bm
    G = H // KVH
    LOG2E = 1.4426950408889634
    O, LSE = {}, {}
    for b in range(B):
        for h in range(H):
            g = h // G
            L = min(lens[b], Tkv)
            for qt in range(-(-Tq // BR)):
                q0 = qt * BR
                rows = min(BR, Tq - q0)
                qtile = [Q[b][h][q0 + r] if r < rows else [0.0] * D for r in range(BR)]
                state = [[NEG, 0.0, [0.0] * D] for _ in range(BR)]
                for it in range(count[b, h, qt]):
                    k0 = index[b, h, qt][it] * BCT
                    ktile = [K[b][g][k0 + c] if c < L - k0 else [0.0] * D for c in range(BCT)]
                    vtile = [V[b][g][k0 + c] if c < L - k0 else [0.0] * D for c in range(BCT)]
                    partial = not full[b, h, qt][it]
                    for r in range(BR):
                        row = q0 + r
                        xs = []
                        for c in range(BCT):
                            col = k0 + c
                            x = sum(qtile[r][e] * ktile[c][e] for e in range(D)) * scale
                            if row < Tq and col < L:
                                x = score_mod(x, b, h, row, col, H, Tq, Tkv, aux)
                            x *= LOG2E
                            if partial and (col >= L or row >= Tq or
                                            not mask(b, h, row, col, H, Tq, Tkv, aux)):
                                x = NEG
                            xs.append(x)
                        m_old, l_old, acc = state[r]
                        m_new = max(m_old, max(xs))
                        m_use = 0.0 if m_new == NEG else m_new
                        alpha = 2 ** (m_old - m_use) if m_old != NEG else 0.0
                        ps = [2 ** (x - m_use) if x != NEG else 0.0 for x in xs]
                        acc = [a * alpha for a in acc]
                        for c in range(BCT):
                            for e in range(D):
                                acc[e] += ps[c] * vtile[c][e]
                        state[r] = [m_new, l_old * alpha + sum(ps), acc]
                for r in range(rows):
                    m, l, acc = state[r]
                    O[b, h, q0 + r] = [a / l if l > 0 else 0.0 for a in acc]
                    LSE[b, h, q0 + r] = (m + math.log2(l)) * math.log(2) if l > 0 else INF
    return O, LSE


def reference(visible, modified, Q, K, V, B, H, KVH, Tq, Tkv, D, lens, scale):
    """Dense softmax with the Rust reference's visibility and modification."""
    G = H // KVH
    O, LSE = {}, {}
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                sc = {}
                for j in range(min(lens[b], Tkv)):
                    if visible(b, i, j):
                        dot = sum(x * y for x, y in zip(Q[b][h][i], K[b][h // G][j]))
                        sc[j] = modified(dot * scale, h, i, j)
                if not sc:
                    O[b, h, i], LSE[b, h, i] = [0.0] * D, INF
                    continue
                m = max(sc.values())
                w = {j: math.exp(s - m) for j, s in sc.items()}
                tot = sum(w.values())
                O[b, h, i] = [sum(w[j] * V[b][h // G][j][e] for j in w) / tot for e in range(D)]
                LSE[b, h, i] = m + math.log(tot)
    return O, LSE


def main():
    global BR, BCT, NT
    data = json.load(open(sys.argv[1]))
    BR, BCT, NT = int(data["rows"]), int(data["keys"]), int(data["threads"])
    ok = True
    n = 0
    for spec in data["mods"]:
        mask, score_mod = compile_mods(spec)
        for sh in spec["shapes"]:
            B, H, KVH, Tq, Tkv, D = sh["batch"], sh["heads"], sh["kv_heads"], sh["seq_len_q"], \
                sh["seq_len_kv"], sh["head_dim"]
            lens, aux, scale = sh["kv_lens"], sh["aux"], sh["scale"]
            # 1. The CUDA C expressions against the Rust reference, every pair.
            vis = sh["visible"]  # [b][q][kv]
            bad_mask = sum(
                1 for b in range(B) for q in range(Tq) for kv in range(Tkv)
                if bool(mask(b, 0, q, kv, H, Tq, Tkv, aux)) != bool(vis[b][q][kv]))
            bad_score = 0
            for (s, h, q, kv, want) in sh["modified"]:
                got = score_mod(s, 0, h, q, kv, H, Tq, Tkv, aux)
                if abs(got - want) > 1e-9 * max(1.0, abs(want)):
                    bad_score += 1
            # 2. The block mask: emulated kernel against the Rust host version.
            bm = block_mask(mask, B, H, Tq, Tkv, lens, aux)
            host = sh["block_mask"]
            nq, nk = -(-Tq // BR), -(-Tkv // BCT)
            bad_bm = 0
            for b in range(B):
                for h in range(H):
                    for qt in range(nq):
                        i = (b * H + h) * nq + qt
                        c = host["count"][i]
                        if (bm[0][b, h, qt] != c
                                or bm[1][b, h, qt] != host["index"][i * nk:i * nk + c]
                                or bm[2][b, h, qt] != host["full"][i * nk:i * nk + c]):
                            bad_bm += 1
            # 3. The forward against the dense reference.
            rnd = random.Random(n)
            Q = [[[[rnd.uniform(-1, 1) for _ in range(D)] for _ in range(Tq)] for _ in range(H)]
                 for _ in range(B)]
            K = [[[[rnd.uniform(-1, 1) for _ in range(D)] for _ in range(Tkv)] for _ in range(KVH)]
                 for _ in range(B)]
            V = [[[[rnd.uniform(-1, 1) for _ in range(D)] for _ in range(Tkv)] for _ in range(KVH)]
                 for _ in range(B)]
            O, LSE = forward(mask, score_mod, Q, K, V, B, H, KVH, Tq, Tkv, D, lens, aux, scale,
                             bm)
            RO, RL = reference(lambda b, q, kv: vis[b][q][kv],
                               lambda s, h, q, kv: score_mod(s, 0, h, q, kv, H, Tq, Tkv, aux),
                               Q, K, V, B, H, KVH, Tq, Tkv, D, lens, scale)
            worst = 0.0
            for key in RO:
                for x, y in zip(O[key], RO[key]):
                    worst = max(worst, abs(x - y))
                if RL[key] == INF:
                    worst = max(worst, 0.0 if LSE[key] == INF else INF)
                else:
                    worst = max(worst, abs(LSE[key] - RL[key]))
            good = bad_mask == 0 and bad_score == 0 and bad_bm == 0 and worst <= 1e-9
            ok &= good
            whole = sum(sum(f) for f in bm[2].values())
            listed = sum(bm[0].values())
            print("%s %dx%d lens %s: mask %d wrong, score %d wrong, block mask %d lists differ "
                  "(%d listed, %d whole), max error %.1e %s" %
                  (spec["name"], Tq, Tkv, lens, bad_mask, bad_score, bad_bm, listed, whole, worst,
                   "ok" if good else "FAILED"))
            n += 1
    print("ALL OK" if ok and n > 0 else "SOME FAILED")


if __name__ == "__main__":
    main()
