"""Emulation of flash_decode.cu (split-KV decoding over a paged KV cache) and of the host's
split plan (src/attention/decode_gpu.rs, DecodePlan::new), against a naive float64 reference.
The kernel's own index arithmetic is run for every thread: the paged addresses through the
block table and the layout's strides, the ring of NS tile stages and its zero fill, the
ldmatrix addresses (ldmatrix and mma.m16n8k16 are emulated fragment by fragment from their PTX
definitions), the per-warp key ranges, masks and online softmax over the quad, the warps' merge
in shared memory, the per-split partials and the combine by the CTA that counts itself last
(CTAs run in a shuffled order; the counters must end at zero). Global arrays are bounds-checked,
shared buffers start as NaN (a read of a value never written shows up in the result), and the
output starts as NaN. The 16-bit rounding and the hardware exp2 are not emulated (the GPU test
checks those), nor is the TMA build (its tensor copies, swizzled panels and the zeroing of V
rows past a range's end): the GPU test compares it with the cp.async loader bit for bit. Keep it
in step with the kernel.

    python3 kernels/emulate_decode.py      # prints one line per case, "ALL OK" last
"""
import math
import random

NEG = float("-inf")
INF = float("inf")
NAN = float("nan")
NT = 128   # threads per CTA
KT = 64    # keys per tile
ROW_TILE = 16    # query rows per mma row tile
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


def ctas_per_sm(D, MT):
    """ctas_per_sm: CTAs whose shared memory (split_smem_bytes + 1 KiB) fits 228 KiB, at most
    CTAS_PER_SM."""
    ns = 3 if D <= 128 else 2
    smem = (ns * 2 * KT + ROW_TILE * MT) * (D + 8) * 2 + 16
    return max(1, min(CTAS_PER_SM, (228 * 1024) // (smem + 1024)))


def plan(ctas, max_len, sms, forced, D, MT):
    """DecodePlan::for_shape: as many ranges as fill one wave of ctas_per_sm CTAs per SM."""
    tiles = max(ceil_div(max_len, KT), 1)
    wanted = forced if forced is not None else (ctas_per_sm(D, MT) * sms) // max(ctas, 1)
    wanted = min(max(wanted, 1), tiles)
    kps = ceil_div(tiles, wanted) * KT
    return max(ceil_div(max_len, kps), 1), kps


def decode_seek(table, key, page, within, col, end, page_stride, row_stride):
    """decode_seek: the chunk's element offset from the kv head's base (the CUDA keeps the K
    and V addresses), 0 past the range."""
    return table[page] * page_stride + within * row_stride + col if key < end else 0


def cursors(table, k0, end, page_size, page_stride, row_stride, D):
    """decode_cursor for every thread: [key, page, within, off] at the range's first key."""
    CPR = D // 8
    out = []
    for tid in range(NT):
        key = k0 + tid // CPR
        page = key // page_size
        within = key - page * page_size
        out.append([key, page, within, decode_seek(table, key, page, within, (tid % CPR) * 8,
                                                     end, page_stride, row_stride)])
    return out


def load_tile(ks, vs, base, K, V, Kb, Vb, table, cur, end, page_size, page_stride, row_stride,
              D):
    """decode_load_tile: `base` is the stage's offset in the shared ring (K tile at base, V
    tile at base + TILE, both in `ks`/`vs`, the same list); chunk c = tid + NT * i; every
    thread's cursor `cur[tid]` carried from tile to tile, its offset advanced by KSTEP rows
    within a page and looked up where a chunk enters a page."""
    STR = D + 8
    CPR = D // 8
    KSTEP = NT // CPR
    for tid in range(NT):
        kr0, col = tid // CPR, (tid % CPR) * 8
        c = cur[tid]
        for i in range(KT // KSTEP):
            kr = kr0 + KSTEP * i
            ok = c[0] < end
            for e in range(8):
                ks[base + kr * STR + col + e] = K[Kb + c[3] + e] if ok else 0.0
                vs[base + KT * STR + kr * STR + col + e] = V[Vb + c[3] + e] if ok else 0.0
            c[0] += KSTEP
            c[2] += KSTEP
            c[3] += KSTEP * row_stride
            if c[2] >= page_size:
                while c[2] >= page_size:
                    c[2] -= page_size
                    c[1] += 1
                c[3] = decode_seek(table, c[0], c[1], c[2], col, end, page_stride, row_stride)


def ldmatrix_x4(mem, addr, trans=False):
    """ldmatrix.m8n8.x4(.trans): lane l gives the address of row l % 8 of matrix l // 8;
    register j of lane l is (row l // 4, columns 2 (l % 4), +1) of matrix j, or with .trans
    (rows 2 (l % 4), +1, column l // 4)."""
    rows = [[mem[addr(l) + c] for c in range(8)] for l in range(32)]
    out = []
    for l in range(32):
        regs = []
        for j in range(4):
            m = rows[8 * j:8 * j + 8]
            if trans:
                regs.append((m[2 * (l % 4)][l // 4], m[2 * (l % 4) + 1][l // 4]))
            else:
                regs.append((m[l // 4][2 * (l % 4)], m[l // 4][2 * (l % 4) + 1]))
        out.append(regs)
    return out


def mma16816(c, a, b0, b1):
    """mma.sync.m16n8k16.row.col: A 16x16 from a[l] = (row g, k 2t..2t+1), (g+8, 2t..),
    (g, 8+2t..), (g+8, 8+2t..); B 16x8 from b0[l] = (k 2t..2t+1, n g), b1[l] = (k 8+2t.., n g);
    C c[l] = (g, n 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); g = l // 4, t = l % 4."""
    A = [[None] * 16 for _ in range(16)]
    B = [[None] * 8 for _ in range(16)]
    for l in range(32):
        g, t = l // 4, l % 4
        for j, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 8 + 2 * t), (g + 8, 8 + 2 * t)]):
            A[r][k], A[r][k + 1] = a[l][j]
        B[2 * t][g], B[2 * t + 1][g] = b0[l]
        B[8 + 2 * t][g], B[8 + 2 * t + 1][g] = b1[l]
    for l in range(32):
        g, t = l // 4, l % 4
        for e, (r, n) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            c[l][e] += sum(A[r][k] * B[k][n] for k in range(16))


def row_tiles(rows, D):
    """row_tiles: two 16-row tiles per CTA when more than 16 rows and head_dim <= 128."""
    return 2 if rows > ROW_TILE and D <= 128 else 1


def split_cta(s, y, b, S, RB, Q, K, V, block_table, seq_lens, Opart, Lpart, counters, O, LSE, Tq,
              H, KVH, page_size, max_pages, page_stride, row_stride, head_stride, kps,
              scale_log2, causal, D):
    STR = D + 8
    NS = 3 if D <= 128 else 2
    TILE = KT * STR
    DT = D // 8
    NW = NT // 32
    G = H // KVH
    MT = row_tiles(G * Tq, D)
    RM = ROW_TILE * MT
    kvh, r0 = y // RB, (y % RB) * RM
    R = min(RM, G * Tq - r0)
    L = seq_lens[b]
    start = s * kps
    end = L if s == S - 1 else min(L, start + kps)
    n_tiles = ceil_div(end - start, KT) if end > start else 0
    ring = [NAN] * (NS * 2 * TILE)
    qs = [NAN] * (RM * STR)
    Kb = kvh * head_stride
    Vb = kvh * head_stride
    table = [block_table[b * max_pages + j] for j in range(max_pages)]
    for tid in range(NT):
        for c in range(tid, RM * DT, NT):
            r, col = c // DT, (c % DT) * 8
            ok = r < R
            off = 0
            if ok:
                h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
                off = ((b * H + h) * Tq + i) * D + col
            for e in range(8):
                qs[r * STR + col + e] = Q[off + e] if ok else 0.0
    cur = cursors(table, start, end, page_size, page_stride, row_stride, D)
    for st in range(NS - 1):
        if st < n_tiles:
            load_tile(ring, ring, st * 2 * TILE, K, V, Kb, Vb, table, cur, end, page_size,
                      page_stride, row_stride, D)
    # Per lane and row tile mt: rows 16 mt + g and 16 mt + g + 8, their key limits, running max
    # and sum, accumulators.
    lim = [[[None, None] for _ in range(MT)] for _ in range(NT)]
    for tid in range(NT):
        g = (tid % 32) // 4
        for mt in range(MT):
            for r in range(2):
                q = r0 + 16 * mt + g + 8 * r
                lim[tid][mt][r] = min(end, q % Tq + L - Tq + 1) if causal else end
    o = [[[[0.0] * 4 for _ in range(DT)] for _ in range(MT)] for _ in range(NT)]
    m_run = [[[NEG, NEG] for _ in range(MT)] for _ in range(NT)]
    l_run = [[[0.0, 0.0] for _ in range(MT)] for _ in range(NT)]
    for t in range(n_tiles):
        nxt = t + NS - 1
        if nxt < n_tiles:
            load_tile(ring, ring, (nxt % NS) * 2 * TILE, K, V, Kb, Vb, table, cur, end,
                      page_size, page_stride, row_stride, D)
        ksb = (t % NS) * 2 * TILE
        vsb = ksb + TILE
        for warp in range(NW):
            kw = start + t * KT + warp * 16
            if kw >= end:
                continue
            sc = [[[[0.0] * 4 for _ in range(2)] for _ in range(MT)] for _ in range(32)]
            for kc in range(0, D // 16, 2):
                qa = [ldmatrix_x4(qs, lambda l, mt=mt: (16 * mt + l % 16) * STR + kc * 16
                                  + (l // 16) * 8) for mt in range(MT)]
                qb = [ldmatrix_x4(qs, lambda l, mt=mt: (16 * mt + l % 16) * STR + kc * 16
                                  + (l // 16) * 8 + 16) for mt in range(MT)]
                for nt in range(2):
                    kb = ldmatrix_x4(ring, lambda l: ksb + (warp * 16 + nt * 8 + (l % 8)) * STR
                                     + kc * 16 + (l // 8) * 8)
                    for mt in range(MT):
                        acc = [sc[l][mt][nt] for l in range(32)]
                        mma16816(acc, qa[mt], [kb[l][0] for l in range(32)],
                                 [kb[l][1] for l in range(32)])
                        mma16816(acc, qb[mt], [kb[l][2] for l in range(32)],
                                 [kb[l][3] for l in range(32)])
            alpha = [[[1.0, 1.0] for _ in range(MT)] for _ in range(32)]
            for mt in range(MT):
                for r in range(2):
                    mx = [NEG] * 32
                    for l in range(32):
                        t4 = l % 4
                        for nt in range(2):
                            for e in range(2):
                                key = kw + nt * 8 + 2 * t4 + e
                                x = sc[l][mt][nt][2 * r + e] * scale_log2
                                if key >= lim[warp * 32 + l][mt][r]:
                                    x = NEG
                                sc[l][mt][nt][2 * r + e] = x
                                mx[l] = max(mx[l], x)
                    for l in range(32):  # the quad's butterfly: lanes l ^ 1, l ^ 2
                        q0 = l & ~3
                        m_q = max(mx[q0:q0 + 4])
                        tid = warp * 32 + l
                        m_new = max(m_run[tid][mt][r], m_q)
                        base = 0.0 if m_new == NEG else m_new
                        alpha[l][mt][r] = exp2(m_run[tid][mt][r] - base)
                        m_run[tid][mt][r] = m_new
                        total = 0.0
                        for nt in range(2):
                            for e in range(2):
                                pv = exp2(sc[l][mt][nt][2 * r + e] - base)
                                sc[l][mt][nt][2 * r + e] = pv
                                total += pv
                        l_run[tid][mt][r] = l_run[tid][mt][r] * alpha[l][mt][r] + total
            # The rescale, skipped by the warp when every lane's alphas are exactly 1.
            if any(a != 1.0 for l in range(32) for mt in range(MT) for a in alpha[l][mt]):
                for l in range(32):
                    for mt in range(MT):
                        for dt in range(DT):
                            for e in range(4):
                                o[warp * 32 + l][mt][dt][e] *= alpha[l][mt][e // 2]
            pa = [[[(sc[l][mt][0][0], sc[l][mt][0][1]), (sc[l][mt][0][2], sc[l][mt][0][3]),
                    (sc[l][mt][1][0], sc[l][mt][1][1]), (sc[l][mt][1][2], sc[l][mt][1][3])]
                   for l in range(32)] for mt in range(MT)]
            for dt in range(0, DT, 2):
                vb = ldmatrix_x4(ring, lambda l: vsb + (warp * 16 + (l % 16)) * STR + dt * 8
                                 + (l // 16) * 8, trans=True)
                for mt in range(MT):
                    for half in range(2):
                        acc = [o[warp * 32 + l][mt][dt + half] for l in range(32)]
                        mma16816(acc, pa[mt], [vb[l][2 * half] for l in range(32)],
                                 [vb[l][2 * half + 1] for l in range(32)])
    # The warps' partials in the ring, then the merge.
    ob = [NAN] * (NW * RM * D)
    mw = [NAN] * (NW * RM)
    lw = [NAN] * (NW * RM)
    for tid in range(NT):
        warp, l = tid // 32, tid % 32
        g, t4 = l // 4, l % 4
        q0 = warp * 32 + (l & ~3)
        for mt in range(MT):
            for r in range(2):
                lsum = sum(l_run[q0 + k][mt][r] for k in range(4))
                row = 16 * mt + g + 8 * r
                if t4 == 0:
                    mw[warp * RM + row] = m_run[tid][mt][r]
                    lw[warp * RM + row] = lsum
                for dt in range(DT):
                    ob[(warp * RM + row) * D + dt * 8 + 2 * t4] = o[tid][mt][dt][2 * r]
                    ob[(warp * RM + row) * D + dt * 8 + 2 * t4 + 1] = o[tid][mt][dt][2 * r + 1]
    for tid in range(NT):
        for idx in range(tid, R * D, NT):
            r, d = idx // D, idx % D
            m = max(mw[w * RM + r] for w in range(NW))
            lsum, acc = 0.0, 0.0
            if m != NEG:
                for w in range(NW):
                    f = exp2(mw[w * RM + r] - m)
                    lsum += f * lw[w * RM + r]
                    acc += f * ob[(w * RM + r) * D + d]
            h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
            row = (b * H + h) * Tq + i
            out = acc / lsum if lsum > 0 else 0.0
            if S == 1:
                O[row * D + d] = out
                if d == 0:
                    LSE[row] = (m + math.log2(lsum)) * math.log(2) if lsum > 0 else INF
            else:
                Opart[(row * S + s) * D + d] = out
                if d == 0:
                    Lpart[row * S + s] = m + math.log2(lsum) if lsum > 0 else NEG
    if S == 1:
        return
    at = b * (KVH * RB) + y
    before = counters[at]
    counters[at] = before + 1
    if before != S - 1:
        return
    counters[at] = 0
    assert RM * S <= NS * 2 * TILE // 2, "the combine's weights fit the ring"
    combine_rows(Opart, Lpart, O, LSE, [NAN] * (RM * S), R, b, kvh, r0, G, Tq, H, S, D)


def combine_rows(Opart, Lpart, O, LSE, ws, R, b, kvh, r0, G, Tq, H, S, D):
    """decode_combine_rows: warp w takes rows w, w + 4, ...; its lanes stride over the splits;
    then each thread sums four adjacent columns of one row over the splits."""
    NW = NT // 32
    for warp in range(NW):
        for r in range(warp, R, NW):
            h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
            row = (b * H + h) * Tq + i
            m = max([NEG] + [Lpart[row * S + s] for s in range(S)])
            total = 0.0
            for s in range(S):
                w = 0.0 if m == NEG else exp2(Lpart[row * S + s] - m)
                ws[r * S + s] = w
                total += w
            inv = 1.0 / total if total > 0 else 0.0
            for s in range(S):
                ws[r * S + s] *= inv
            LSE[row] = INF if m == NEG else (m + math.log2(total)) * math.log(2)
    for tid in range(NT):
        for idx in range(tid, R * (D // 4), NT):
            r, c = idx // (D // 4), (idx % (D // 4)) * 4
            h, i = kvh * G + (r0 + r) // Tq, (r0 + r) % Tq
            row = (b * H + h) * Tq + i
            for e in range(4):
                O[row * D + c + e] = sum(ws[r * S + s] * Opart[(row * S + s) * D + c + e]
                                         for s in range(S))


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


def case(B, H, KVH, Tq, D, lens, page, causal, forced, sms, seed):
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
    G = H // KVH
    MT = row_tiles(G * Tq, D)
    RB = ceil_div(G * Tq, ROW_TILE * MT)  # row_blocks
    if forced == "short":  # plan for fewer keys than the sequence holds
        S, kps = plan(B * KVH * RB, max_len // 2, sms, 2, D, MT)
    else:
        S, kps = plan(B * KVH * RB, max_len, sms, forced, D, MT)
    rows = B * H * Tq
    Q = Checked(Qv, "Q")
    K, V = Checked(Kf, "K"), Checked(Vf, "V")
    BT, SL = Checked(table, "block_table"), Checked(lens, "seq_lens")
    # With one split the partials are a one-element placeholder (Decoder::new).
    Opart = Checked([NAN] * (rows * S * D if S > 1 else 1), "Opart")
    Lpart = Checked([NAN] * (rows * S if S > 1 else 1), "Lpart")
    counters = Checked([0] * (B * KVH * RB), "counters")
    O = Checked([NAN] * (rows * D), "O")
    LSE = Checked([NAN] * rows, "LSE")
    ctas = [(s, y, b) for b in range(B) for y in range(KVH * RB) for s in range(S)]
    random.Random(seed + 1).shuffle(ctas)  # any split may finish last
    for s, y, b in ctas:
        split_cta(s, y, b, S, RB, Q, K, V, BT, SL, Opart, Lpart, counters, O, LSE, Tq, H, KVH,
                  page_size, max_pages, page_stride, row_stride, head_stride, kps,
                  scale * math.log2(math.e), causal, D)
    if any(counters.data):
        return INF, S, kps  # a counter left non-zero breaks the next call
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
        # B, H, KVH, Tq, D, lens, page, causal, forced splits, SMs
        (4, 8, 2, 1, 32, [150, 1, 70, 0], 16, False, None, 4),
        (4, 8, 2, 2, 32, [150, 1, 70, 0], 16, True, None, 4),
        (2, 8, 1, 1, 32, [200, 37], 32, True, 3, 4),
        (2, 4, 2, 3, 32, [130, 5], 7, True, None, 8),
        # One split of five tiles: the three-stage ring wraps.
        (1, 2, 1, 1, 32, [300], 256, False, 1, 4),
        (2, 4, 4, 1, 32, [20, 20], None, False, None, 4),
        (3, 8, 2, 2, 32, [65, 64, 128], None, True, 2, 4),
        # Several column tiles of the output and several load chunks per thread: head_dim 64
        # and 128; head_dim 256 has a two-stage ring (three tiles: it wraps).
        (2, 8, 2, 4, 64, [200, 70], 16, True, None, 4),
        (1, 4, 1, 2, 128, [150], None, False, 1, 4),
        (1, 2, 1, 1, 256, [150], 16, True, 1, 4),
        # More rows than one tile: 24 rows are one CTA of two row tiles (the second half
        # empty); 40 rows two CTAs of two tiles; at head_dim 256, 18 rows two CTAs of one tile.
        (2, 8, 1, 3, 32, [90, 33], 16, True, None, 4),
        (1, 8, 1, 5, 32, [150], 16, True, None, 4),
        (1, 2, 1, 9, 256, [70], None, True, None, 4),
        # A sequence longer than the plan's cover: the last split takes the rest.
        (1, 2, 1, 1, 32, [300], 64, False, "short", 4),
    ]
    ok = True
    for n, c in enumerate(cases):
        worst, S, kps = case(*c, seed=n)
        good = worst <= 1e-9
        ok &= good
        print("case %d B%d H%d/%d Tq%d D%d lens %s page %s causal %s: %d splits of %d keys, "
              "max error %.1e %s" % (n, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], S, kps,
                                     worst, "ok" if good else "FAILED"))
    # The wave: two CTAs per SM at head_dim 64 and 128, one at 256 (as decode_gpu.rs asserts).
    waves = [ctas_per_sm(d, m) for d, m in ((64, 1), (64, 2), (128, 1), (128, 2), (256, 1))]
    if waves != [2, 2, 2, 2, 1]:
        ok = False
        print("ctas_per_sm = %s, expected [2, 2, 2, 2, 1]: FAILED" % (waves,))
    print("ALL OK" if ok else "SOME FAILED")


if __name__ == "__main__":
    main()
