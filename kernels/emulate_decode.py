"""Element-level emulation of flash_decode.cu (split-KV decoding over a paged KV cache) and of
the host's split plan (src/attention/decode_gpu.rs, DecodePlan::new), against a naive float64
reference. Every thread of a CTA is run phase by phase (the phases the kernel separates with
__syncthreads), with the kernel's own index arithmetic: the paged addresses through the block
table and the layout's strides, the two tile buffers and their zero fill, the (row, key) pairs
of the score phase, the warp-per-row online softmax over lanes lane and lane + 32, the
accumulator j = element tid + 128 j of the [R, D] output, the per-split partials and the
combine. Global arrays are bounds-checked, shared buffers start as NaN (a read of a value never
written shows up in the result), and the output starts as NaN. The 16-bit rounding and the
hardware exp2 are not emulated (the GPU test checks those). Keep it in step with the kernel.

    python3 kernels/emulate_decode.py      # prints one line per case, "ALL OK" last
"""
import math
import random

NEG = float("-inf")
INF = float("inf")
NAN = float("nan")
NT = 128   # threads per CTA
KT = 64    # keys per tile
CTAS_PER_SM = 2


class Checked:
    """A global array that refuses out-of-bounds reads and writes."""

    def __init__(self, data, name):
        self.data = list(data)
        self.name = name

    def __getitem__(self, i):
        if not 0 <= i < len(self.data):
            raise IndexError("%s[%d] out of bounds (%d)" % (self.name, i, len(self.data)))
        return self.data[i]

    def __setitem__(self, i, x):
        if not 0 <= i < len(self.data):
            raise IndexError("%s[%d] written out of bounds (%d)" % (self.name, i, len(self.data)))
        self.data[i] = x


def ceil_div(a, b):
    return (a + b - 1) // b


def exp2(x):
    return 0.0 if x == NEG else 2.0 ** x


def plan(batch, kvh, max_len, sms, forced):
    """DecodePlan::new."""
    tiles = max(ceil_div(max_len, KT), 1)
    wanted = forced if forced is not None else ceil_div(CTAS_PER_SM * sms, max(batch * kvh, 1))
    wanted = min(max(wanted, 1), tiles)
    kps = ceil_div(tiles, wanted) * KT
    return max(ceil_div(max_len, kps), 1), kps


def load_tile(ks, vs, base, K, V, Kb, Vb, table, k0, end, page_size, page_stride, row_stride,
              D):
    """decode_load_tile: `base` is the buffer's offset in the shared tile arrays."""
    STR = D + 8
    for tid in range(NT):
        for c in range(tid, KT * (D // 8), NT):
            kr = c // (D // 8)
            col = (c % (D // 8)) * 8
            key = k0 + kr
            ok = key < end
            off = 0
            if ok:
                off = table[key // page_size] * page_stride + (key % page_size) * row_stride + col
            for e in range(8):
                ks[base + kr * STR + col + e] = K[Kb + off + e] if ok else 0.0
                vs[base + kr * STR + col + e] = V[Vb + off + e] if ok else 0.0


def split_cta(s, y, b, S, RB, Q, K, V, block_table, seq_lens, Opart, Lpart, Tq, H, KVH, page_size,
              max_pages, page_stride, row_stride, head_stride, kps, scale_log2, causal, D, R_MAX):
    STR = D + 8
    ACC = R_MAX * D // NT
    G = H // KVH
    kvh, r0 = y // RB, (y % RB) * R_MAX
    R = min(R_MAX, G * Tq - r0)
    L = seq_lens[b]
    start = s * kps
    end = L if s == S - 1 else min(L, start + kps)
    n_tiles = ceil_div(end - start, KT) if end > start else 0
    ks = [NAN] * (2 * KT * STR)
    vs = [NAN] * (2 * KT * STR)
    qs = [NAN] * (R * D)
    ss = [NAN] * (R * KT)
    m_s = [NAN] * R
    l_s = [NAN] * R
    a_s = [NAN] * R
    vis_s = [None] * R
    Kb = kvh * head_stride
    Vb = kvh * head_stride
    table = [block_table[b * max_pages + j] for j in range(max_pages)]
    if n_tiles > 0:
        load_tile(ks, vs, 0, K, V, Kb, Vb, table, start, end, page_size, page_stride, row_stride, D)
    for tid in range(NT):
        for idx in range(tid, R * D, NT):
            r, d = idx // D, idx % D
            h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
            qs[idx] = Q[((b * H + h) * Tq + i) * D + d] * scale_log2
        for r in range(tid, R, NT):
            m_s[r] = NEG
            l_s[r] = 0.0
            vis_s[r] = (r0 + r) % Tq + L - Tq + 1 if causal else L
    acc = [[0.0] * ACC for _ in range(NT)]
    for t in range(n_tiles):
        buf = t & 1
        if t + 1 < n_tiles:
            nb = (buf ^ 1) * KT * STR
            load_tile(ks, vs, nb, K, V, Kb, Vb, table, start + (t + 1) * KT, end, page_size,
                      page_stride, row_stride, D)
        k0 = start + t * KT
        for tid in range(NT):
            for p in range(tid, R * KT, NT):
                r, kk = p // KT, p % KT
                key = k0 + kk
                sc = NEG
                if key < end and key < vis_s[r]:
                    kr = (buf * KT + kk) * STR
                    sc = sum(qs[r * D + d] * ks[kr + d] for d in range(D))
                ss[r * KT + kk] = sc
        for warp in range(NT // 32):
            for r in range(warp, R, NT // 32):
                x = [(ss[r * KT + lane], ss[r * KT + lane + 32]) for lane in range(32)]
                mx = max(max(a, c) for a, c in x)
                m_old = m_s[r]
                m_new = max(m_old, mx)
                base = 0.0 if m_new == NEG else m_new
                total = 0.0
                for lane in range(32):
                    p0, p1 = exp2(x[lane][0] - base), exp2(x[lane][1] - base)
                    total += p0 + p1
                    ss[r * KT + lane] = p0
                    ss[r * KT + lane + 32] = p1
                alpha = exp2(m_old - base)
                a_s[r] = alpha
                l_s[r] = l_s[r] * alpha + total
                m_s[r] = m_new
        vt = buf * KT * STR
        for tid in range(NT):
            for j in range(ACC):
                idx = tid + NT * j
                if idx < R * D:
                    r, d = idx // D, idx % D
                    a = acc[tid][j] * a_s[r]
                    for kk in range(KT):
                        a += ss[r * KT + kk] * vs[vt + kk * STR + d]
                    acc[tid][j] = a
    for tid in range(NT):
        for j in range(ACC):
            idx = tid + NT * j
            if idx < R * D:
                r, d = idx // D, idx % D
                h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
                row = (b * H + h) * Tq + i
                l = l_s[r]
                Opart[(row * S + s) * D + d] = acc[tid][j] / l if l > 0 else 0.0
        for r in range(tid, R, NT):
            h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
            row = (b * H + h) * Tq + i
            l = l_s[r]
            Lpart[row * S + s] = m_s[r] + math.log2(l) if l > 0 else NEG


def combine(Opart, Lpart, O, LSE, rows, S, D):
    for row in range(rows):
        lp = [Lpart[row * S + s] for s in range(S)]
        m = max(lp)
        total = sum(exp2(x - m) for x in lp) if m != NEG else 0.0
        for d in range(D):
            o = 0.0
            if m != NEG:
                for s in range(S):
                    w = exp2(lp[s] - m)
                    if w > 0:
                        o += w * Opart[(row * S + s) * D + d]
                o /= total
            O[row * D + d] = o
        LSE[row] = INF if m == NEG else (m + math.log2(total)) * math.log(2)


def reference(q, k_at, v_at, B, H, KVH, Tq, D, lens, causal, scale):
    G = H // KVH
    out, lse = {}, {}
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                vis = max(0, min(lens[b], i + lens[b] - Tq + 1)) if causal else lens[b]
                qr = q(b, h, i)
                sc = [scale * sum(x * y for x, y in zip(qr, k_at(b, h // G, t))) for t in range(vis)]
                if not sc:
                    out[b, h, i], lse[b, h, i] = [0.0] * D, INF
                    continue
                m = max(sc)
                w = [math.exp(x - m) for x in sc]
                tot = sum(w)
                vv = [v_at(b, h // G, t) for t in range(vis)]
                out[b, h, i] = [sum(w[t] * vv[t][d] for t in range(vis)) / tot for d in range(D)]
                lse[b, h, i] = m + math.log(tot)
    return out, lse


def case(B, H, KVH, Tq, D, R_MAX, lens, page, causal, forced, sms, seed):
    rnd = random.Random(seed)
    max_len = max(max(lens), 1)
    scale = D ** -0.5
    Qv = [rnd.uniform(-2, 2) for _ in range(B * H * Tq * D)]
    Kc = [[[[rnd.uniform(-2, 2) for _ in range(D)] for _ in range(max_len)] for _ in range(KVH)]
          for _ in range(B)]
    Vc = [[[[rnd.uniform(-2, 2) for _ in range(D)] for _ in range(max_len)] for _ in range(KVH)]
          for _ in range(B)]
    if page is None:  # contiguous [B, KVH, T, D]: CacheLayout::contiguous
        page_size, page_stride, row_stride, head_stride = max_len, KVH * max_len * D, D, max_len * D
        max_pages = 1
        table = list(range(B))
        # Keys past a sequence's length are NaN: a read of one shows in the result.
        Kf = [x if t < lens[bb] else NAN for bb in range(B) for hh in range(KVH)
              for t in range(max_len) for x in Kc[bb][hh][t]]
        Vf = [x if t < lens[bb] else NAN for bb in range(B) for hh in range(KVH)
              for t in range(max_len) for x in Vc[bb][hh][t]]
    else:  # vLLM pages [pages, page, KVH, D], pages handed out in reverse: CacheLayout::paged
        page_size, page_stride, row_stride, head_stride = page, page * KVH * D, KVH * D, D
        max_pages = max(ceil_div(max_len, page), 1)
        n_pages = sum(ceil_div(l, page) for l in lens)
        order = list(range(n_pages))[::-1]
        Kf = [NAN] * (max(n_pages, 1) * page_stride)
        Vf = [NAN] * (max(n_pages, 1) * page_stride)
        table = [0] * (B * max_pages)
        nxt = 0
        for b, l in enumerate(lens):
            for p in range(ceil_div(l, page)):
                pg = order[nxt]
                nxt += 1
                table[b * max_pages + p] = pg
                for r in range(page):
                    t = p * page + r
                    if t >= l:
                        continue
                    for g in range(KVH):
                        for d in range(D):
                            at = pg * page_stride + r * row_stride + g * head_stride + d
                            Kf[at] = Kc[b][g][t][d]
                            Vf[at] = Vc[b][g][t][d]
    if forced == "short":  # plan for fewer keys than the sequence holds
        S, kps = plan(B, KVH, max_len // 2, sms, 2)
    else:
        S, kps = plan(B, KVH, max_len, sms, forced)
    rows = B * H * Tq
    Q = Checked(Qv, "Q")
    K, V = Checked(Kf, "K"), Checked(Vf, "V")
    BT, SL = Checked(table, "block_table"), Checked(lens, "seq_lens")
    Opart = Checked([NAN] * (rows * S * D), "Opart")
    Lpart = Checked([NAN] * (rows * S), "Lpart")
    G = H // KVH
    RB = ceil_div(G * Tq, R_MAX)  # row_blocks
    for b in range(B):
        for y in range(KVH * RB):
            for s in range(S):
                split_cta(s, y, b, S, RB, Q, K, V, BT, SL, Opart, Lpart, Tq, H, KVH, page_size,
                          max_pages, page_stride, row_stride, head_stride, kps,
                          scale * math.log2(math.e), causal, D, R_MAX)
    O = Checked([NAN] * (rows * D), "O")
    LSE = Checked([NAN] * rows, "LSE")
    combine(Opart, Lpart, O, LSE, rows, S, D)
    ref, rlse = reference(lambda b, h, i: Qv[((b * H + h) * Tq + i) * D:][:D],
                          lambda b, g, t: Kc[b][g][t], lambda b, g, t: Vc[b][g][t],
                          B, H, KVH, Tq, D, lens, causal, scale)
    worst = 0.0
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                row = (b * H + h) * Tq + i
                got = O.data[row * D:(row + 1) * D]
                want = ref[b, h, i]
                for x, y in zip(got, want):
                    worst = max(worst, abs(x - y) if x == x else INF)
                rl, gl = rlse[b, h, i], LSE.data[row]
                if rl == INF:
                    worst = max(worst, 0.0 if gl == INF else INF)
                else:
                    worst = max(worst, abs(gl - rl) if gl == gl else INF)
    return worst, S, kps


def main():
    cases = [
        # B, H, KVH, Tq, D, R_MAX, lens, page, causal, forced splits, SMs
        (4, 8, 2, 1, 16, 8, [150, 1, 70, 0], 16, False, None, 4),
        (4, 8, 2, 2, 16, 8, [150, 1, 70, 0], 16, True, None, 4),
        (2, 8, 1, 1, 16, 8, [200, 37], 32, True, 3, 4),
        (2, 4, 2, 3, 16, 8, [130, 5], 7, True, None, 8),
        (1, 2, 1, 1, 16, 8, [300], 256, False, 7, 4),
        (2, 4, 4, 1, 16, 8, [20, 20], None, False, None, 4),
        (3, 8, 2, 2, 16, 8, [65, 64, 128], None, True, 2, 4),
        # Real accumulator counts (idx = tid + 128 j for j >= 1) and several load chunks per
        # thread: head_dim 64 and 128.
        (2, 8, 2, 4, 64, 16, [200, 70], 16, True, None, 4),
        (1, 4, 1, 2, 128, 8, [150], None, False, 1, 4),
        # More rows than a CTA holds (G * Tq = 24 rows at R_MAX 8: three row blocks).
        (2, 8, 1, 3, 16, 8, [90, 33], 16, True, None, 4),
        # A sequence longer than the plan's cover: the last split takes the rest.
        (1, 2, 1, 1, 16, 8, [300], 64, False, "short", 4),
    ]
    ok = True
    for n, c in enumerate(cases):
        worst, S, kps = case(*c, seed=n)
        good = worst <= 1e-9
        ok &= good
        print("case %d B%d H%d/%d Tq%d D%d lens %s page %s causal %s: %d splits of %d keys, "
              "max error %.1e %s" % (n, c[0], c[1], c[2], c[3], c[4], c[6], c[7], c[8], S, kps,
                                     worst, "ok" if good else "FAILED"))
    print("ALL OK" if ok else "SOME FAILED")


if __name__ == "__main__":
    main()
