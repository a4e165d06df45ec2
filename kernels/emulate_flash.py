"""Element-level emulation of the control flow of flash_attn_fwd.cu and flash_attn_bwd.cu, against
a naive float64 reference: the same tile loops, limits, masks, warp skips, partial-tile guards,
GQA walk, key lengths and bottom-right causal, with small tile constants so small shapes cross
many tiles. It checks index logic on any machine (tests/kernels_emulate.rs runs it); the matrix
fragment layouts and the 16-bit rounding are not emulated (the GPU tests check those). Keep it in
step with the kernels: each block names the kernel variables it mirrors.

    python3 kernels/emulate_flash.py      # prints one line per case, "ALL OK" last
"""
import math
import random

NEG = float("-inf")
INF = float("inf")


def ceil_div(a, b):
    return (a + b - 1) // b


def visible(L, Tq, i, causal):
    if causal:
        return max(0, min(L, i + L - Tq + 1))
    return L


def reference(Q, K, V, dO, B, H, KVH, Tq, Tkv, D, lens, causal, scale):
    G = H // KVH
    O = {}
    LSE = {}
    dQ = {}
    dK = {(b, g, j): [0.0] * D for b in range(B) for g in range(KVH) for j in range(Tkv)}
    dV = {(b, g, j): [0.0] * D for b in range(B) for g in range(KVH) for j in range(Tkv)}
    for b in range(B):
        for h in range(H):
            g = h // G
            for i in range(Tq):
                n = visible(lens[b], Tq, i, causal)
                if n == 0:
                    O[b, h, i] = [0.0] * D
                    LSE[b, h, i] = INF
                    dQ[b, h, i] = [0.0] * D
                    continue
                s = [scale * sum(Q[b, h, i][e] * K[b, g, j][e] for e in range(D)) for j in range(n)]
                m = max(s)
                p = [math.exp(x - m) for x in s]
                l = sum(p)
                p = [x / l for x in p]
                o = [sum(p[j] * V[b, g, j][e] for j in range(n)) for e in range(D)]
                O[b, h, i] = o
                LSE[b, h, i] = m + math.log(l)
                Dd = sum(dO[b, h, i][e] * o[e] for e in range(D))
                dq = [0.0] * D
                for j in range(n):
                    dp = sum(dO[b, h, i][e] * V[b, g, j][e] for e in range(D))
                    ds = p[j] * (dp - Dd)
                    for e in range(D):
                        dq[e] += scale * ds * K[b, g, j][e]
                        dK[b, g, j][e] += scale * ds * Q[b, h, i][e]
                        dV[b, g, j][e] += p[j] * dO[b, h, i][e]
                dQ[b, h, i] = dq
    return O, LSE, dQ, dK, dV


def fwd_kernel(Q, K, V, B, H, KVH, Tq, Tkv, D, lens, causal, scale, NW, MT, BCT):
    BR = 16 * MT * NW
    G = H // KVH
    slog2 = scale * 1.4426950408889634
    n_qt = ceil_div(Tq, BR)
    O, LSE = {}, {}
    for b in range(B):
        for h in range(H):
            g = h // G
            for blk in range(n_qt):
                qt = n_qt - 1 - blk if causal else blk
                L = lens[b]
                off = L - Tq
                q0 = qt * BR
                rows = min(BR, Tq - q0)
                n_keys = max(0, min(L, q0 + rows + off)) if causal else L
                n_kt = ceil_div(n_keys, BCT)
                qtile = [Q[b, h, q0 + r] if r < rows else [0.0] * D for r in range(BR)]
                state = [[NEG, 0.0, [0.0] * D] for _ in range(BR)]
                for kt in range(n_kt):
                    k0 = kt * BCT
                    ktile = [K[b, g, k0 + c] if c < n_keys - k0 else [0.0] * D for c in range(BCT)]
                    vtile = [V[b, g, k0 + c] if c < n_keys - k0 else [0.0] * D for c in range(BCT)]
                    rem = n_keys - k0
                    assert rem >= 1
                    for w in range(NW):
                        wr0 = w * 16 * MT
                        wrows = min(16 * MT, rows - wr0)
                        lim_first = max(0, min(L, q0 + wr0 + off + 1)) if causal else L
                        lim_last = max(0, min(L, q0 + wr0 + wrows + off)) if causal else L
                        if wrows <= 0 or k0 >= lim_last:
                            continue
                        mask = k0 + BCT > lim_first
                        for r in range(wr0, wr0 + 16 * MT):
                            row = q0 + r
                            xs = []
                            for c in range(BCT):
                                if (c // 8) * 8 < rem:  # the kernel's `nt * 8 < rem`
                                    sv = sum(qtile[r][e] * ktile[c][e] for e in range(D))
                                else:
                                    sv = 0.0
                                x = sv * slog2
                                if mask:
                                    lim = min(L, row + off + 1) if causal else L
                                    if k0 + c >= lim:
                                        x = NEG
                                xs.append(x)
                            m_old, l_old, acc = state[r]
                            m_new = max(m_old, max(xs))
                            m_use = 0.0 if m_new == NEG else m_new
                            alpha = 2 ** (m_old - m_use) if m_old != NEG else 0.0
                            ps = [2 ** (x - m_use) if x != NEG else 0.0 for x in xs]
                            l_new = l_old * alpha + sum(ps)
                            acc = [a * alpha for a in acc]
                            for c in range(BCT):
                                if (c // 16) * 16 < rem:  # the kernel's `kc * 16 < rem`
                                    for e in range(D):
                                        acc[e] += ps[c] * vtile[c][e]
                                else:
                                    assert ps[c] == 0.0, "a skipped P V block had weight"
                            state[r] = [m_new, l_new, acc]
                for r in range(rows):
                    m, l, acc = state[r]
                    inv = 1.0 / l if l > 0 else 0.0
                    O[b, h, q0 + r] = [a * inv for a in acc]
                    LSE[b, h, q0 + r] = (m + math.log2(l)) * math.log(2) if l > 0 else INF
    return O, LSE


def bwd_kernel(Q, K, V, dO, O, LSE, B, H, KVH, Tq, Tkv, D, lens, causal, scale, NW, BR):
    BC = 16 * NW
    G = H // KVH
    slog2 = scale * 1.4426950408889634
    Dsum = {k: sum(dO[k][e] * O[k][e] for e in range(D)) for k in O}
    dQacc = {k: [0.0] * D for k in O}
    dK, dV = {}, {}
    for b in range(B):
        for kvh in range(KVH):
            for kt in range(ceil_div(Tkv, BC)):
                L = lens[b]
                off = L - Tq
                k0 = kt * BC
                i_min = max(0, k0 - off) if causal else 0
                qt_first = i_min // BR
                n_qt = ceil_div(Tq, BR)
                per_head = n_qt - qt_first if (L > k0 and qt_first < n_qt) else 0
                n_it = per_head * G
                valid = min(BC, L - k0)
                ktile = [K[b, kvh, k0 + c] if c < valid else [0.0] * D for c in range(BC)]
                vtile = [V[b, kvh, k0 + c] if c < valid else [0.0] * D for c in range(BC)]
                dk = [[0.0] * D for _ in range(BC)]
                dv = [[0.0] * D for _ in range(BC)]
                for it in range(n_it):
                    h = kvh * G + it // per_head
                    q0 = (qt_first + it % per_head) * BR
                    qtile = [Q[b, h, q0 + r] if q0 + r < Tq else [0.0] * D for r in range(BR)]
                    dotile = [dO[b, h, q0 + r] if q0 + r < Tq else [0.0] * D for r in range(BR)]
                    ltile = [LSE[b, h, q0 + r] * 1.4426950408889634 if q0 + r < Tq else INF
                             for r in range(BR)]
                    dtile = [Dsum[b, h, q0 + r] if q0 + r < Tq else 0.0 for r in range(BR)]
                    lim_last = max(0, min(L, min(q0 + BR, Tq) + off)) if causal else L
                    lim_first = max(0, min(L, q0 + off + 1)) if causal else L
                    sds = [[0.0] * BR for _ in range(BC)]
                    for w in range(NW):
                        kw0 = k0 + 16 * w
                        if kw0 >= lim_last:
                            continue  # zeros in sds
                        mask = kw0 + 16 > lim_first
                        for kk in range(16):
                            c = 16 * w + kk
                            key = kw0 + kk
                            for ql in range(BR):
                                s = sum(ktile[c][e] * qtile[ql][e] for e in range(D))
                                ex = s * slog2 - ltile[ql]
                                p = 2 ** ex if ex != NEG else 0.0
                                if mask:
                                    lim = min(L, q0 + ql + off + 1) if causal else L
                                    if key >= lim:
                                        p = 0.0
                                dp = sum(vtile[c][e] * dotile[ql][e] for e in range(D))
                                ds = p * (dp - dtile[ql])
                                for e in range(D):
                                    dv[c][e] += p * dotile[ql][e]
                                    dk[c][e] += ds * qtile[ql][e]
                                sds[c][ql] = ds
                    for row in range(BR):
                        if q0 + row < Tq:
                            for e in range(D):
                                dQacc[b, h, q0 + row][e] += sum(sds[c][row] * ktile[c][e]
                                                                for c in range(BC))
                for c in range(BC):
                    key = k0 + c
                    if key < Tkv:
                        dK[b, kvh, key] = [x * scale for x in dk[c]]
                        dV[b, kvh, key] = dv[c]
    dQ = {k: [x * scale for x in v] for k, v in dQacc.items()}
    return dQ, dK, dV


def err(a, b):
    num = den = 0.0
    for k in b:
        for x, y in zip(a[k], b[k]):
            if x != x:
                return float("nan")
            num += (x - y) ** 2
            den += y * y
    return math.sqrt(num / den) if den else (0.0 if num == 0 else INF)


def case(B, H, KVH, Tq, Tkv, D, lens, causal, scale, fcfg, bcfg, seed):
    rnd = random.Random(seed)
    G = H // KVH
    Q = {(b, h, i): [rnd.gauss(0, 1) for _ in range(D)] for b in range(B) for h in range(H) for i in range(Tq)}
    dO = {(b, h, i): [rnd.gauss(0, 1) for _ in range(D)] for b in range(B) for h in range(H) for i in range(Tq)}
    K = {(b, g, j): [rnd.gauss(0, 1) for _ in range(D)] for b in range(B) for g in range(KVH) for j in range(Tkv)}
    V = {(b, g, j): [rnd.gauss(0, 1) for _ in range(D)] for b in range(B) for g in range(KVH) for j in range(Tkv)}
    rO, rL, rdQ, rdK, rdV = reference(Q, K, V, dO, B, H, KVH, Tq, Tkv, D, lens, causal, scale)
    O, LSE = fwd_kernel(Q, K, V, B, H, KVH, Tq, Tkv, D, lens, causal, scale, *fcfg)
    assert set(O) == set(rO), "rows written"
    lse_ok = all((LSE[k] == rL[k]) if rL[k] == INF else abs(LSE[k] - rL[k]) < 1e-9 for k in rL)
    dQ, dK, dV = bwd_kernel(Q, K, V, dO, O, LSE, B, H, KVH, Tq, Tkv, D, lens, causal, scale, *bcfg)
    assert set(dK) == set(rdK) and set(dQ) == set(rdQ)
    es = (err(O, rO), err(dQ, rdQ), err(dK, rdK), err(dV, rdV))
    ok = lse_ok and all(e < 1e-9 for e in es)
    print("%s B%d H%d/%d Tq%d Tkv%d lens%s causal=%s fwd%s bwd%s: %s lse %s" % (
        "ok  " if ok else "FAIL", B, H, KVH, Tq, Tkv, lens, causal, fcfg, bcfg,
        " ".join("%.1e" % e for e in es), lse_ok))
    return ok


def main():
    all_ok = True
    D = 3
    configs = [((2, 1, 32), (2, 16)), ((1, 2, 16), (2, 32)), ((2, 1, 8), (1, 16))]
    shapes = [
        (1, 1, 1, 1, 1, None), (1, 2, 1, 7, 7, None), (1, 1, 1, 33, 33, None), (1, 1, 1, 65, 65, None),
        (2, 2, 1, 20, 50, None), (2, 2, 1, 50, 20, None), (1, 4, 2, 1, 20, None),
        (3, 2, 2, 20, 40, [40, 0, 17]), (2, 1, 1, 45, 45, [1, 45]),
    ]
    seed = 0
    for (B, H, KVH, Tq, Tkv, lens) in shapes:
        for causal in (False, True):
            for fc, bc in configs:
                seed += 1
                L = lens or [Tkv] * B
                all_ok &= case(B, H, KVH, Tq, Tkv, D, L, causal, 0.7, fc, bc, seed)
    print("ALL OK" if all_ok else "SOME FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
