"""Element-level emulation of the control flow of kernel_sums.cu against a naive float64
reference: the same grid (the host's plan in src/kernel_sums/cuda.rs), rows per thread, Y tiles
staged through shared memory between barriers, the register prefetch of the next tile, the
online-max chunks of kernel_lse, the feature chunks of the generic-D kernels, the padding of
partial tiles (weight 0, g = -inf, zero features) and the store guards. Arithmetic is float64
(the float32 rounding and ex2.approx are the GPU tests' business); every global array checks
its indices, shared buffers keep whatever a previous tile left (NaN at first), and outputs start
as NaN, so an out-of-range access, a stale read or an unwritten element fails. The tile
constants are parameters: the kernel's own (128 threads, ...) on a few cases and small ones on
many, so small shapes cross many tiles. Keep it in step with the kernels: each function names
the kernel template it mirrors.

    python3 kernels/kernel_sums/emulate_kernel_sums.py   # one line per case, "ALL OK" last
"""
import math
import random

NEG = float("-inf")
NAN = float("nan")
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


class Global:
    """A device array: reads and writes outside [0, len) raise."""

    def __init__(self, name, values):
        self.name = name
        self.v = list(values)

    def __getitem__(self, i):
        if not 0 <= i < len(self.v):
            raise IndexError(f"{self.name}[{i}] read, length {len(self.v)}")
        return self.v[i]

    def __setitem__(self, i, x):
        if not 0 <= i < len(self.v):
            raise IndexError(f"{self.name}[{i}] written, length {len(self.v)}")
        self.v[i] = x


def ex2(x):
    if x == NEG:
        return 0.0
    return 2.0 ** x


def ex2_f32(x):
    """ex2 with float32's range at the top: 2^x is inf from x = 128 (ex2.approx.ftz.f32
    overflows there), NaN for NaN; kernel_lse's lazy step relies on it."""
    if x != x:
        return NAN
    if x >= 128.0:
        return math.inf
    return ex2(x)


LSE_LAZY_MAX = 2.0 ** 8  # KS_LSE_LAZY_MAX
FLT_MAX = 3.4028234663852886e38


def f32_range(x):
    """x with float32's overflow: inf past FLT_MAX (the sums of kernel_lse's lazy step)."""
    return math.inf if x > FLT_MAX else x

# How often kernel_lse's chunks took the lazy step with a term above the stale maximum and
# how often the exact step (main() checks that the cases exercise both).
lazy_hits, lazy_misses = [0], [0]


class Consts:
    def __init__(self, threads, chunk, dn_tile, dn_kd, split_target):
        assert threads % chunk == 0 and dn_kd % 4 == 0
        self.T = threads  # KS_THREADS == KS_TILE
        self.CHUNK = chunk  # KS_CHUNK
        self.DT = dn_tile  # KS_DN_TILE
        self.KD = dn_kd  # KS_DN_KD
        self.SPLIT_TARGET = split_target  # cuda.rs SPLIT_TARGET_BLOCKS
        self.SPLIT_MIN = 2 * threads  # cuda.rs SPLIT_MIN_POINTS: two tiles


REAL = Consts(128, 16, 32, 16, 1024)
SMALL = Consts(8, 4, 3, 8, 8)


# ---- the host's plan (cuda.rs: entry_point, y_splits) ----
def splits(K, row_blocks, m):
    want = -(-K.SPLIT_TARGET // max(row_blocks, 1))
    most = max(m // K.SPLIT_MIN, 1)
    parts = min(want, most)
    if parts <= 1:
        return 1, m
    length = -(-(-(-m // parts)) // K.T) * K.T
    return -(-m // length), length


def plan(op, n, dim, cols, K, grad=False, m=0):
    """(small, column tile, rows per thread, grid, (splits, split_len))."""
    small = dim in (1, 2, 3)
    ct = 1
    if op == "rbf_mv":
        ct = next((t for t in (1, 4, 16, 64) if t >= cols), 64)
    rows_per_thread = 2 if small and ct < 64 else 1
    rows_per_block = K.T * rows_per_thread
    blocks = -(-n // rows_per_block)
    splittable = {"kernel_lse": not grad, "kde": True, "rbf_mv": cols == 1}[op]
    split = splits(K, blocks, m) if small and splittable else (1, m)
    return small, ct, rows_per_thread, (blocks, max(-(-cols // ct), split[0])), split


# ---- small D: rbf_small<D, CT, R, KDE> ----
def ks_point(Y, D, j, s, w):
    return (
        Y[j * D] * s,
        Y[j * D + 1] * s if D > 1 else 0.0,
        Y[j * D + 2] * s if D > 2 else 0.0,
        w,
    )


def ks_neg_sq(D, x, p, start):
    q = start - (x[0] - p[0]) ** 2
    if D > 1:
        q -= (x[1] - p[1]) ** 2
    if D > 2:
        q -= (x[2] - p[2]) ** 2
    return q


def rbf_small(K, D, CT, R, KDE, X, Y, B, out, N, M, C, k, out_scale, grid, part=None,
              split_len=0):
    """rbf_small<D, CT, R, KDE, SPLIT>; SPLIT when `part` is given (CT == 1): block (bx, by)
    sums points [by * split_len, min(M, ...)) into part[by * N + i], unscaled."""
    T = K.T
    s = math.sqrt(k)
    split = part is not None
    assert not split or CT == 1
    for by in range(grid[1]):
        for bx in range(grid[0]):
            c0 = 0 if split else by * CT
            yb = by * split_len if split else 0
            ye = min(yb + split_len, M) if split else M
            ys = [(NAN,) * 4] * T  # __shared__ float4 ys[KS_TILE]
            bs = [NAN] * (T * CT)
            x, acc, nxt = {}, {}, {}
            for t in range(T):
                row0 = bx * (T * R) + t
                for r in range(R):
                    i = row0 + r * T
                    x[t, r] = [X[i * D + a] * s if i < N else 0.0 for a in range(D)]
                    acc[t, r] = [0.0] * CT

                def fetch(j):
                    if j >= ye:
                        return (0.0, 0.0, 0.0, 0.0)
                    w = 1.0 if KDE else (B[j * C + c0] if CT == 1 else 0.0)
                    return ks_point(Y, D, j, s, w)

                nxt[t] = fetch(yb + t)
            j0 = yb
            while j0 < ye:
                # __syncthreads(); stores; __syncthreads()
                for t in range(T):
                    ys[t] = nxt[t]
                    if CT > 1:
                        for q in range(t, T * CT, T):
                            jj, c = q // CT, q % CT
                            jb = j0 + jj
                            bs[q] = B[jb * C + c0 + c] if (jb < M and c0 + c < C) else 0.0
                for t in range(T):
                    nxt[t] = fetch(j0 + T + t)
                    for jj in range(T):
                        p = ys[jj]
                        kv = [ex2(ks_neg_sq(D, x[t, r], p, 0.0)) for r in range(R)]
                        for r in range(R):
                            if CT == 1:
                                acc[t, r][0] += kv[r] * p[3]
                            else:
                                for c in range(CT):
                                    acc[t, r][c] += kv[r] * bs[jj * CT + c]
                j0 += T
            for t in range(T):
                for r in range(R):
                    i = bx * (T * R) + t + r * T
                    if split:
                        if i < N:
                            part[by * N + i] = acc[t, r][0]
                    elif i < N:
                        for c in range(CT):
                            if c0 + c < C:
                                out[i * C + c0 + c] = acc[t, r][c] * out_scale


def sum_combine(K, part, out, N, splits, scale):
    """kernel_sum_combine: one thread per row, grid ceil(N / T)."""
    for bx in range(-(-N // K.T)):
        for t in range(K.T):
            i = bx * K.T + t
            if i >= N:
                continue
            out[i] = sum(part[q * N + i] for q in range(splits)) * scale


# ---- small D: lse_small<D, R, GRAD> ----
def lse_small(K, D, R, GRAD, X, Y, G, out, N, M, k, two_over_eps, grid, part=None,
              split_len=0):
    """lse_small<D, R, GRAD, SPLIT>; SPLIT when `part` (the float2 partials as pairs) is
    given: block (bx, by) reduces points [by * split_len, min(M, ...)) into part[by * N + i]."""
    T, CH = K.T, K.CHUNK
    s = math.sqrt(k)
    for bx, by in [(bx, by) for bx in range(grid[0]) for by in range(grid[1])]:
        jb = by * split_len if part is not None else 0
        je = min(jb + split_len, M) if part is not None else M
        if part is None and by > 0:
            continue
        ys = [(NAN,) * 4] * T
        x, mx, sm, acc, nxt = {}, {}, {}, {}, {}

        def fetch(j):
            if j >= je:
                return (0.0, 0.0, 0.0, NEG)
            return ks_point(Y, D, j, s, G[j] * LOG2E)

        for t in range(T):
            for r in range(R):
                i = bx * (T * R) + t + r * T
                x[t, r] = [X[i * D + a] * s if i < N else 0.0 for a in range(D)]
                acc[t, r] = [0.0] * D
                mx[t, r] = NEG
                sm[t, r] = 0.0
            nxt[t] = fetch(jb + t)
        j0 = jb
        while j0 < je:
            for t in range(T):
                ys[t] = nxt[t]
            for t in range(T):
                nxt[t] = fetch(j0 + T + t)
                for jc in range(0, T, CH):
                    e = {(r, c): ks_neg_sq(D, x[t, r], ys[jc + c], ys[jc + c][3])
                         for r in range(R) for c in range(CH)}
                    for r in range(R):
                        # The lazy step against the maximum as it stood before the chunk.
                        cs, ca, above = 0.0, [0.0] * D, False
                        for c in range(CH):
                            p = ex2_f32(e[r, c] - mx[t, r])
                            cs = f32_range(cs + p)
                            above = above or p > 1.0
                            for a in range(D if GRAD else 0):
                                ca[a] += p * (ys[jc + c][a] - x[t, r][a])
                        # With the gradient every chunk takes the exact step.
                        if GRAD or not cs <= LSE_LAZY_MAX:
                            lazy_misses[0] += 1
                            cm = max(e[r, c] for c in range(CH))
                            if cm > mx[t, r]:
                                f = ex2(mx[t, r] - cm)
                                sm[t, r] *= f
                                acc[t, r] = [a * f for a in acc[t, r]]
                                mx[t, r] = cm
                            ref = 0.0 if mx[t, r] == NEG else mx[t, r]
                            cs, ca = 0.0, [0.0] * D
                            for c in range(CH):
                                p = ex2(e[r, c] - ref)
                                cs += p
                                for a in range(D if GRAD else 0):
                                    ca[a] += p * (ys[jc + c][a] - x[t, r][a])
                        elif above:
                            lazy_hits[0] += 1  # a lazy chunk with terms past the maximum
                        sm[t, r] = f32_range(sm[t, r] + cs)
                        acc[t, r] = [a + b for a, b in zip(acc[t, r], ca)]
            j0 += T
        for t in range(T):
            for r in range(R):
                i = bx * (T * R) + t + r * T
                if part is not None:
                    if i < N:
                        part[by * N + i] = (mx[t, r], sm[t, r])
                elif i < N:
                    lg = math.log2(sm[t, r]) if sm[t, r] > 0 else NEG
                    out[i] = (mx[t, r] + lg) * LN2
                    if GRAD:
                        inv = 1.0 / (sm[t, r] * s)
                        for a in range(D):
                            out[N + i * D + a] = two_over_eps * (acc[t, r][a] * inv)


def lse_combine(K, part, out, N, splits):
    """kernel_lse_combine: one thread per row, grid ceil(N / T)."""
    for b in range(-(-N // K.T)):
        for t in range(K.T):
            i = b * K.T + t
            if i >= N:
                continue
            m = max(part[q * N + i][0] for q in range(splits))
            ref = 0.0 if m == NEG else m
            tot = sum(part[q * N + i][1] * ex2(part[q * N + i][0] - ref) for q in range(splits))
            out[i] = (m + (math.log2(tot) if tot > 0 else NEG)) * LN2


# ---- any D: ks_stage, ks_tile_sq, rbf_dn<CT, KDE>, lse_dn<GRAD> ----
def ks_stage(K, xs, ys, X, Y, rb, N, j0, M, D, d0, with_x):
    T, KD, DT = K.T, K.KD, K.DT
    for t in range(T):
        if with_x:
            for q in range(t, T * KD, T):
                rr, a = q // KD, q % KD
                i = rb + rr
                xs[rr][a] = X[i * D + d0 + a] if (i < N and d0 + a < D) else 0.0
        for q in range(t, DT * KD, T):
            jj, a = q // KD, q % KD
            jy = j0 + jj
            ys[jj][a] = Y[jy * D + d0 + a] if (jy < M and d0 + a < D) else 0.0


def ks_tile_sq(K, xs, ys, X, Y, rb, N, j0, M, D):
    """Returns sq[t][jj] for every thread t (the barriers split the stages from the sums)."""
    T, KD, DT = K.T, K.KD, K.DT
    sq = [[0.0] * DT for _ in range(T)]
    for d0 in range(0, D, KD):
        ks_stage(K, xs, ys, X, Y, rb, N, j0, M, D, d0, True)
        for t in range(T):
            for a in range(KD):
                for jj in range(DT):
                    d = xs[t][a] - ys[jj][a]
                    sq[t][jj] += d * d
    return sq


def rbf_dn(K, CT, KDE, X, Y, B, out, N, M, D, C, k, out_scale, grid):
    T, KD, DT = K.T, K.KD, K.DT
    for by in range(grid[1]):
        for bx in range(grid[0]):
            xs = [[NAN] * KD for _ in range(T)]
            ys = [[NAN] * KD for _ in range(DT)]
            bs = [[NAN] * CT for _ in range(DT)]
            rb = bx * T
            c0 = by * CT
            acc = [[0.0] * CT for _ in range(T)]
            for j0 in range(0, M, DT):
                for t in range(T):
                    for q in range(t, DT * CT, T):
                        jj, c = q // CT, q % CT
                        jb = j0 + jj
                        w = 0.0
                        if jb < M and c0 + c < C:
                            w = 1.0 if KDE else B[jb * C + c0 + c]
                        bs[jj][c] = w
                sq = ks_tile_sq(K, xs, ys, X, Y, rb, N, j0, M, D)
                for t in range(T):
                    for jj in range(DT):
                        kv = ex2(-k * sq[t][jj])
                        for c in range(CT):
                            acc[t][c] += kv * bs[jj][c]
            for t in range(T):
                i = rb + t
                if i < N:
                    for c in range(CT):
                        if c0 + c < C:
                            out[i * C + c0 + c] = acc[t][c] * out_scale


def lse_dn(K, GRAD, X, Y, G, out, N, M, D, k, two_over_eps, grid):
    T, KD, DT = K.T, K.KD, K.DT
    for bx in range(grid[0]):
        xs = [[NAN] * KD for _ in range(T)]
        ys = [[NAN] * KD for _ in range(DT)]
        gs = [NAN] * DT
        rb = bx * T
        mx = [NEG] * T
        sm = [0.0] * T
        for t in range(T):
            i = rb + t
            if GRAD and i < N:
                for a in range(D):
                    out[N + i * D + a] = 0.0
        for j0 in range(0, M, DT):
            for t in range(T):
                if t < DT:
                    gs[t] = G[j0 + t] * LOG2E if j0 + t < M else NEG
            e = ks_tile_sq(K, xs, ys, X, Y, rb, N, j0, M, D)
            for t in range(T):
                i = rb + t
                cm = NEG
                for jj in range(DT):
                    e[t][jj] = gs[jj] - k * e[t][jj]
                    cm = max(cm, e[t][jj])
                if cm > mx[t]:
                    f = ex2(mx[t] - cm)
                    sm[t] *= f
                    if GRAD and i < N:
                        for a in range(D):
                            out[N + i * D + a] *= f
                    mx[t] = cm
                ref = 0.0 if mx[t] == NEG else mx[t]
                for jj in range(DT):
                    e[t][jj] = ex2(e[t][jj] - ref)
                    sm[t] += e[t][jj]
            if GRAD:
                for d0 in range(0, D, KD):
                    ks_stage(K, xs, ys, X, Y, rb, N, j0, M, D, d0, False)
                    for t in range(T):
                        i = rb + t
                        for a4 in range(KD // 4):
                            py = [sum(e[t][jj] * ys[jj][4 * a4 + q] for jj in range(DT))
                                  for q in range(4)]
                            a = d0 + 4 * a4
                            if i < N:
                                for q in range(4):
                                    if a + q < D:
                                        out[N + i * D + a + q] += py[q]
        for t in range(T):
            i = rb + t
            if i < N:
                out[i] = (mx[t] + (math.log2(sm[t]) if sm[t] > 0 else NEG)) * LN2
                if GRAD:
                    for a in range(D):
                        g = out[N + i * D + a]
                        out[N + i * D + a] = -two_over_eps * (X[i * D + a] - g / sm[t])


# ---- one case, as cuda.rs launches it ----
def run(K, op, grad, X, Y, W, n, m, dim, cols, sigma, eps):
    small, ct, R, grid, (nsplit, split_len) = plan(op, n, dim, cols, K, grad, m)
    out_len = n * cols if op == "rbf_mv" else n + (n * dim if grad else 0)
    out = Global("out", [NAN] * out_len)
    Xg, Yg = Global("X", X), Global("Y", Y)
    Wg = Global("W", W) if W is not None else None
    if op in ("rbf_mv", "kde"):
        k = LOG2E / (2 * sigma * sigma)
        norm = (2 * math.pi * sigma * sigma) ** (-dim / 2) / m if op == "kde" else 1.0
        kde = op == "kde"
        C = cols if op == "rbf_mv" else 1
        if small and nsplit > 1:
            part = Global("part", [NAN] * (nsplit * n))
            rbf_small(K, dim, ct, R, kde, Xg, Yg, Wg, None, n, m, C, k, 1.0, grid, part,
                      split_len)
            sum_combine(K, part, out, n, nsplit, norm)
        elif small:
            rbf_small(K, dim, ct, R, kde, Xg, Yg, Wg, out, n, m, C, k, norm, grid)
        else:
            rbf_dn(K, ct, kde, Xg, Yg, Wg, out, n, m, dim, C, k, norm, grid)
    else:
        k = LOG2E / eps
        if small and nsplit > 1:
            part = Global("part", [(NAN, NAN)] * (nsplit * n))
            lse_small(K, dim, R, grad, Xg, Yg, Wg, None, n, m, k, 2 / eps, grid, part,
                      split_len)
            lse_combine(K, part, out, n, nsplit)
        elif small:
            lse_small(K, dim, R, grad, Xg, Yg, Wg, out, n, m, k, 2 / eps, grid)
        else:
            lse_dn(K, grad, Xg, Yg, Wg, out, n, m, dim, k, 2 / eps, grid)
    return out.v


def reference(op, grad, X, Y, W, n, m, dim, cols, sigma, eps):
    def sq(i, j):
        return sum((X[i * dim + a] - Y[j * dim + a]) ** 2 for a in range(dim))

    vals, grads = [], []
    for i in range(n):
        if op in ("rbf_mv", "kde"):
            ks = [math.exp(-sq(i, j) / (2 * sigma * sigma)) for j in range(m)]
            if op == "kde":
                norm = (2 * math.pi * sigma * sigma) ** (-dim / 2) / m
                vals.append(norm * sum(ks))
            else:
                vals.extend(sum(ks[j] * W[j * cols + c] for j in range(m)) for c in range(cols))
        else:
            e = [-sq(i, j) / eps + W[j] for j in range(m)]
            mxv = max(e)
            if mxv == NEG:
                vals.append(NEG)
                continue
            p = [math.exp(v - mxv) for v in e]
            tot = sum(p)
            vals.append(mxv + math.log(tot))
            if grad:
                for a in range(dim):
                    py = sum(p[j] * Y[j * dim + a] for j in range(m)) / tot
                    grads.append(-2 / eps * (X[i * dim + a] - py))
    return vals + grads


def rel_err(got, want):
    if len(got) != len(want):
        return float("inf")
    num = den = 0.0
    for g, w in zip(got, want):
        if w == NEG and g == NEG:
            continue
        if not (math.isfinite(g) and math.isfinite(w)):
            return float("inf")
        num += (g - w) ** 2
        den += w * w
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def case(K, op, n, m, dim, cols=1, grad=False, seed=0, g_fill=None):
    rnd = random.Random(seed)
    X = [rnd.random() for _ in range(n * dim)]
    Y = [rnd.random() for _ in range(m * dim)]
    if op == "rbf_mv":
        W = [rnd.gauss(0, 1) for _ in range(m * cols)]
    elif op == "kde":
        W = None
    else:
        W = [2 * rnd.random() - 1 for _ in range(m)]
        if g_fill:
            g_fill(W)
    sigma = 0.25 * math.sqrt(dim)
    eps = 2 * sigma * sigma
    name = f"{op}{'+grad' if grad else ''} N{n} M{m} D{dim} C{cols} T{K.T}"
    try:
        got = run(K, op, grad, X, Y, W, n, m, dim, cols, sigma, eps)
    except (IndexError, ArithmeticError) as e:
        print(f"FAIL {name}: {e}")
        return False
    want = reference(op, grad, X, Y, W, n, m, dim, cols, sigma, eps)
    err = rel_err(got, want)
    ok = err <= 1e-12 and all(not math.isnan(v) for v in got)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.1e}")
    return ok


def main():
    oks = []
    # Small tiles: many tiles, chunks and partial blocks on small shapes.
    for n, m in [(1, 1), (7, 3), (17, 9), (9, 26), (33, 8)]:
        for dim in (1, 2, 3, 5, 12):
            for cols in (1, 3, 5, 17, 70):
                oks.append(case(SMALL, "rbf_mv", n, m, dim, cols, seed=n + m + dim + cols))
            oks.append(case(SMALL, "kde", n, m, dim, seed=n * m + dim))
            for grad in (False, True):
                oks.append(case(SMALL, "kernel_lse", n, m, dim, grad=grad, seed=n + 3 * m + dim))

    # -inf weights: the first points excluded (chunks and tiles with no finite term first).
    def first_excluded(W):
        for j in range(min(len(W), 11)):
            W[j] = NEG

    for dim in (3, 12):
        for grad in (False, True):
            oks.append(case(SMALL, "kernel_lse", 19, 23, dim, grad=grad, seed=7, g_fill=first_excluded))

    # A ±1e4 spread of g (the running maximum moves by thousands).
    def spread(W):
        for j in range(len(W)):
            W[j] = (1e4 if j % 2 == 0 else -1e4) * j / len(W)

    for dim in (3, 12):
        oks.append(case(SMALL, "kernel_lse", 13, 29, dim, grad=True, seed=8, g_fill=spread))

    # A rising g (0.1 nats a point, 0.58 octaves a chunk of 4): each chunk's terms pass the
    # stale maximum, by less than the lazy step's 8 octaves for a few chunks, then by more, when
    # the exact step catches up.
    def ramp(W):
        for j in range(len(W)):
            W[j] = 0.1 * j

    for grad in (False, True):
        oks.append(case(SMALL, "kernel_lse", 11, 37, 3, grad=grad, seed=9, g_fill=ramp))

    # Split over Y (few row blocks, many points): the last split short, a whole split of
    # -inf weights, and a spread that moves each split's maximum differently.
    for n, m in [(9, 70), (33, 50), (3, 161)]:
        assert plan("kernel_lse", n, 3, 1, SMALL, False, m)[4][0] > 1, (n, m)
        for dim in (1, 2, 3):
            oks.append(case(SMALL, "kernel_lse", n, m, dim, seed=n + m + dim))

    def first_half_excluded(W):
        for j in range(len(W) // 2):
            W[j] = NEG

    oks.append(case(SMALL, "kernel_lse", 9, 70, 3, seed=21, g_fill=first_half_excluded))
    oks.append(case(SMALL, "kernel_lse", 9, 70, 3, seed=22, g_fill=spread))
    oks.append(case(SMALL, "kernel_lse", 9, 70, 3, seed=23, g_fill=lambda W: W.__setitem__(
        slice(None), [NEG] * len(W))))

    # The matvec (one column) and the KDE split the same way; several columns never do.
    for n, m in [(9, 70), (33, 50), (3, 161)]:
        assert plan("kde", n, 3, 1, SMALL, False, m)[4][0] > 1, (n, m)
        assert plan("rbf_mv", n, 3, 3, SMALL, False, m)[4][0] == 1, (n, m)
        for dim in (1, 2, 3):
            oks.append(case(SMALL, "rbf_mv", n, m, dim, 1, seed=2 * n + m + dim))
            oks.append(case(SMALL, "kde", n, m, dim, seed=3 * n + m + dim))

    # The kernel's own constants, one case per template, sizes off every block.
    oks.append(case(REAL, "rbf_mv", 300, 130, 3, 1, seed=11))
    oks.append(case(REAL, "rbf_mv", 130, 129, 2, 3, seed=12))
    oks.append(case(REAL, "rbf_mv", 129, 40, 1, 64, seed=13))
    oks.append(case(REAL, "kde", 257, 131, 3, seed=14))
    oks.append(case(REAL, "kernel_lse", 257, 150, 3, grad=True, seed=15))
    # The split path with the kernel's constants: 2 row blocks, 1000 points in 3 splits.
    assert plan("kernel_lse", 257, 3, 1, REAL, False, 1000)[4] == (3, 384)
    oks.append(case(REAL, "kernel_lse", 257, 1000, 3, seed=19))
    assert plan("rbf_mv", 257, 3, 1, REAL, False, 1000)[4] == (3, 384)
    oks.append(case(REAL, "rbf_mv", 257, 1000, 3, 1, seed=24))
    oks.append(case(REAL, "kde", 257, 1000, 2, seed=25))
    oks.append(case(REAL, "kernel_lse", 140, 70, 17, grad=True, seed=16))
    oks.append(case(REAL, "rbf_mv", 129, 33, 17, 5, seed=17))
    oks.append(case(REAL, "kde", 130, 40, 16, seed=18))

    print(f"kernel_lse chunks: {lazy_hits[0]} lazy with a term past the running maximum, "
          f"{lazy_misses[0]} exact")
    if not (lazy_hits[0] > 0 and lazy_misses[0] > 0):
        print("FAIL: the cases do not exercise both of kernel_lse's steps")
        oks.append(False)
    print("ALL OK" if all(oks) else f"{oks.count(False)} FAILED")
    return all(oks)


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
