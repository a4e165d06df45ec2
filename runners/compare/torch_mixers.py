"""PyTorch's sequence mixers, written as a PyTorch user writes them without the fused CUDA
extensions, measured by the kernelpages protocol (`sequence_mixers --compare torch` on the GPU,
`sequence_mixers --device cpu --compare torch` on the CPU; the job's `device` says which).

Implementation `torch_eager`, per mixer (the runner's `files.arguments`: `mixer`, `batch`,
`seq_len`, `dtype`, `pass`, and the mixer's sizes):
- `ssd` (Mamba-2; `heads` H, `head_dim` P, `state` N, `groups` G; inputs x [B, T, H, P],
  dt [B, T, H] fp32 (the step after the softplus), a [H] fp32, b and c [B, T, G, N], d [H] fp32;
  head h reads group h // (H / G)): the chunked "minimal SSD" of the Mamba-2 paper, chunk
  length 64. B and C are expanded from groups to heads; inside each chunk the segment sums of
  the log decays dt * A give the masked decay matrix L = exp(segsum), the diagonal blocks'
  outputs are one einsum of C, B, L and dt * x, each chunk's final state another; the
  recurrence over chunk states is the einsum of their decay matrix (segsum over the chunks'
  total decays) with the states; the off-diagonal outputs read those states through C.
  Then y += D x. A seq_len that is not a multiple of 64 is padded with zeros at the end (dt = 0
  there: decay 1 and no input, so the padding changes nothing) and the output sliced.
- `selective_scan` (Mamba; `channels` D, `state` N; inputs u [B, T, D], delta [B, T, D] fp32,
  a [D, N] fp32, b and c [B, T, N], d [D] fp32): the formulation of Mamba's `selective_scan_ref`
  (what a user gets without the CUDA extension): deltaA = exp(delta A) and
  deltaB_u = delta u B precomputed for every step (each B x T x D x N float32), then a Python
  loop over seq_len updating the state h [B, D, N] and reading y_t = <C_t, h> out; y += D u.
- `gated_delta` (Gated DeltaNet's gated delta rule; `heads` H, `head_dim` K = V; inputs q, k
  and v [B, T, H, K], k L2-normalised per head and q pre-scaled by the runner, alpha [B, T, H]
  fp32 in (0, 1], beta [B, T, H] fp32 in [0, 1]): the naive recurrent form (as
  flash-linear-attention's reference), a Python loop over seq_len with batched (B, H) tensor
  ops on the state S [B, H, V, K]: S = alpha_t S; u = S k_t; S += beta_t (v_t - u) k_t^T;
  o_t = S q_t, i.e. S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T.
- `based` (Based's causal linear attention plus a sliding-window softmax; `heads` H,
  `head_dim` K = V, `window` W >= 1, `scale` c; inputs q, k, v [B, T, H, K], already through
  the (identity) feature map): o_t = c sum_{s <= t} (q_t . k_s) v_s (unnormalised) plus the
  exact softmax over c q_t . k_s of the keys s in [t - W + 1, t], with memory linear in T, by
  chunks of 64 steps (seq_len padded with zeros at the end, outputs sliced): the linear branch
  as the masked intra-chunk q k^T times v plus q times the sum of the earlier chunks' k^T v
  (an exclusive cumsum over the chunk states); the window branch as each chunk of queries
  against the keys of its own chunk and of the ceil((W - 1) / 64) chunks before it (none for
  W = 1, one for W <= 65, more for a longer window, never more than there are: any W is
  computed, the score block growing with it), under a band mask.
All compute in float32 (bf16 inputs are upcast) and return y or o in the case's dtype
([B, T, H, P], [B, T, D] or [B, T, H, V]), from a zero initial state; `pass` is "fwd".

For each job, in a fresh process: the runner's input bits are read (and on the GPU uploaded);
a call whose float32 temporaries cannot fit (the free device memory, or half the host's
physical memory on the CPU) is an `oom` row with the size asked, without a call; else the
first call is timed by wall clock; the output is scanned for non-finite values and the
runner's checked elements compared with the runner's float64 reference; then the shared timing
protocol.
- CPU: peak memory is the resident set's high-water mark over the inputs and the first call
  (`torch_cpu.rss_bytes`); wall time is the sample time.
- GPU: peak memory from the caching allocator (`max_memory_allocated`, reset before the upload,
  read after the first call; cuBLAS workspaces apart, as `torch_sdpa` does); eager calls timed
  between CUDA events, then a CUDA graph of the same calls replayed (`graph_replay`, the
  reported time; the eager median kept as `eager_median_ms`): the loops of the selective scan
  and the gated delta rule launch a few small kernels per step, so their eager time is mostly
  the host's.

    PYTHONPATH=runners python3 -m compare.torch_mixers serve | self-test | job FILE
"""
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, torch_cpu, torch_outputs, torch_sdpa  # noqa: E402
else:
    from . import protocol, torch_cpu, torch_outputs, torch_sdpa

LIBRARY = "PyTorch"
IMPLEMENTATIONS = ("torch_eager",)
MIXERS = ("ssd", "selective_scan", "gated_delta", "based")
DTYPES = ("fp32", "bf16")
PASSES = ("fwd", "fwd+bwd")
# The mixers whose fwd+bwd this module measures (autograd through the formulation): SSD's and
# Based's chunked forms, and the gated delta rule's loop (autograd keeps every step's state,
# B*H*V*K floats a step: 2 MB at B4 H8 K=V=128, and the runner times the loop up to 4,096
# steps); the selective scan's loop would keep a [B, D, N] state a step.
BACKWARD_MIXERS = ("ssd", "gated_delta", "based")
BACKWARD_NOTE = ("fwd+bwd: the forward with autograd recording, then torch.autograd.grad of "
                 "sum(dy * y) with respect to every input (dy the runner's)")
# The inputs each mixer takes, in argument order (files.inputs).
INPUTS = {"ssd": ("x", "dt", "a", "b", "c", "d"),
          "selective_scan": ("u", "delta", "a", "b", "c", "d"),
          "gated_delta": ("q", "k", "v", "alpha", "beta"),
          "based": ("q", "k", "v")}
CHUNK = 64
UPCAST_NOTE = "float32 compute (bf16 inputs upcast)"
MIXER_NOTES = {
    "ssd": "chunked (chunk %d), Mamba-2's minimal formulation" % CHUNK,
    "selective_scan": "sequential loop over seq_len in Python (selective_scan_ref formulation)",
    "gated_delta": "sequential loop over seq_len in Python (naive recurrent gated delta rule)",
    "based": "linear branch chunked (chunk %d) + sliding-window softmax by chunks" % CHUNK,
}
# Share of the host's physical memory a CPU call's float32 temporaries may take.
CPU_MEMORY_FRACTION = 0.5

torch = torch_cpu.torch
IMPORT_ERROR = torch_cpu.IMPORT_ERROR


def unsupported_reason(case, implementation):
    """Why `implementation` cannot compute `case` (its parameters, or the call's arguments:
    `mixer`, `dtype`, `pass`), or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    mixer = case.get("mixer")
    if mixer not in MIXERS:
        return "mixer %r is not measured (%s)" % (mixer, ", ".join(MIXERS))
    if case.get("pass") not in PASSES:
        return "pass %r: fwd or fwd+bwd" % (case.get("pass"),)
    if case.get("pass") == "fwd+bwd" and mixer not in BACKWARD_MIXERS:
        return ("fwd+bwd of %s: the backward is measured for %s only (autograd through a "
                "sequential loop over seq_len keeps every step)"
                % (mixer, ", ".join(BACKWARD_MIXERS)))
    if case.get("dtype") not in DTYPES:
        return "dtype %r is not measured (%s)" % (case.get("dtype"), ", ".join(DTYPES))
    if mixer == "ssd" and "heads" in case and "groups" in case:
        heads, groups = int(case["heads"]), int(case["groups"])
        if groups <= 0 or heads % groups != 0:
            return "heads (%d) is not a multiple of groups (%d)" % (heads, groups)
    if mixer == "based" and "window" in case and int(case["window"]) < 1:
        return "window %d: the sliding window holds at least the query's own key" % int(
            case["window"])
    return None


def padded_len(seq_len, chunk=CHUNK):
    """seq_len rounded up to a whole number of chunks."""
    return -(-int(seq_len) // chunk) * chunk


def window_chunks(window, n_chunks, chunk=CHUNK):
    """How many chunks before its own a chunk of queries reads in Based's window branch:
    enough to reach W - 1 steps back, never more than there are."""
    return max(0, min(-(-(int(window) - 1) // chunk), n_chunks - 1))


def temporaries_bytes(args):
    """Bytes of float32 temporaries one call holds at once at least: the selective scan's
    deltaA and deltaB_u (2 x B T D N); SSD's intra-chunk decay matrix L and the C B^T scores
    (2 x B H T' 64, T' the padded length), or its decay matrix over chunks
    (B H (T' / 64 + 1)^2), whichever is larger; the gated delta rule's float32 output
    (B T H V), three states (B H V K: the state, its decayed copy, the rank-one update) and,
    for bf16, the upcast q, k, v (3 B T H K); Based's float32 chunked q, k, v (3 B H T' K), its
    linear branch's output (B H T' V), and the larger of two chunk states per chunk (the k^T v
    and their exclusive cumsum, 2 B H (T' / 64) K V) and the window branch's scores and
    probabilities (2 B H T' 64 (1 + the chunks read before))."""
    b, t = int(args["batch"]), int(args["seq_len"])
    mixer = args["mixer"]
    if mixer == "selective_scan":
        return 2 * 4 * b * t * int(args["channels"]) * int(args["state"])
    heads, t_pad = int(args["heads"]), padded_len(t)
    if mixer == "gated_delta":
        dim = int(args["head_dim"])
        upcast = 3 * t * dim if args.get("dtype") == "bf16" else 0
        return 4 * b * heads * (t * dim + 3 * dim * dim + upcast)
    if mixer == "based":
        dim, n_chunks = int(args["head_dim"]), t_pad // CHUNK
        back = window_chunks(args["window"], n_chunks)
        return 4 * b * heads * (4 * t_pad * dim + max(2 * n_chunks * dim * dim,
                                                      2 * t_pad * CHUNK * (1 + back)))
    return 4 * b * heads * max(2 * t_pad * CHUNK, (t_pad // CHUNK + 1) ** 2)


def temporaries_text(args):
    """What `temporaries_bytes` counts, in words, with its size."""
    gb = temporaries_bytes(args) / 1e9
    if args["mixer"] == "selective_scan":
        return "deltaA and deltaB_u (2 x B*T*D*N float32) alone are %.2f GB" % gb
    if args["mixer"] == "gated_delta":
        return ("the float32 output (B*T*H*V), three B*H*V*K states and, for bf16, the upcast "
                "q, k, v alone are %.2f GB" % gb)
    if args["mixer"] == "based":
        return ("the float32 chunked q, k, v and linear-branch output (4 x B*H*T*K), and two "
                "k^T v states per chunk (2 x B*H*(T/%d)*K*V) or the window's scores and "
                "probabilities if larger, alone are %.2f GB" % (CHUNK, gb))
    return ("the intra-chunk decay matrix L and the C B^T scores (2 x B*H*T*%d float32), or "
            "the decay matrix over chunks if larger, alone are %.2f GB" % (CHUNK, gb))


class DoesNotFit(Exception):
    """The call's float32 temporaries exceed the memory there is: an `oom` row, no call."""


def fits(args, available, where):
    """Raises DoesNotFit when `temporaries_bytes(args)` exceed `available` bytes (`where`
    describes them)."""
    need = temporaries_bytes(args)
    if available is not None and need > available:
        raise DoesNotFit("%s; %s is %.2f GB" % (temporaries_text(args), where, available / 1e9))


def host_memory_bytes():
    """The host's physical memory, bytes, or None."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def arguments(job):
    """The call's arguments (files.arguments, authoritative) over the case's parameters."""
    return dict(job["case"], **(job["files"].get("arguments") or {}))


def on_gpu(job):
    """True when the job comes from a GPU run (the job's `device`, `gpu` when absent)."""
    return job.get("device", "gpu") == "gpu"


def segsum(x):
    """Segment sums along the last axis: out[..., i, j] = x[..., j+1] + ... + x[..., i] for
    j <= i (0 on the diagonal), -inf above it; exp() of it is the causal decay matrix."""
    n = x.size(-1)
    below = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    rows = x.unsqueeze(-1).expand(*x.shape, n).masked_fill(~below, 0.0)
    sums = rows.cumsum(dim=-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(0)
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunked(x, dt, a, b, c, d, out_dtype, chunk=CHUNK):
    """Mamba-2's minimal chunked SSD in float32: x [B, T, H, P], dt [B, T, H], a [H],
    b and c [B, T, G, N], d [H]; returns y [B, T, H, P] in `out_dtype`."""
    batch, t_len, heads, _ = x.shape
    per_group = heads // b.shape[2]
    x, dt, b, c = x.float(), dt.float(), b.float(), c.float()
    pad = padded_len(t_len, chunk) - t_len
    if pad:
        # dt = 0 in the padding: decay exp(0) = 1 and no input; the outputs there are dropped.
        fpad = torch.nn.functional.pad
        xs, dts = fpad(x, (0, 0, 0, 0, 0, pad)), fpad(dt, (0, 0, 0, pad))
        b, c = fpad(b, (0, 0, 0, 0, 0, pad)), fpad(c, (0, 0, 0, 0, 0, pad))
    else:
        xs, dts = x, dt
    n_chunks = (t_len + pad) // chunk
    groups, n_dim = b.shape[2], b.shape[3]

    def per_head(v):  # [B, T', G, N] -> [B, T', H, N]: head h reads group h // per_group
        return v.unsqueeze(3).expand(batch, t_len + pad, groups, per_group, n_dim).reshape(
            batch, t_len + pad, heads, n_dim)

    bh, ch = per_head(b), per_head(c)
    xdt = xs * dts.unsqueeze(-1)

    def chunks(v):  # [B, T', ...] -> [B, chunks, chunk, ...]
        return v.reshape(batch, n_chunks, chunk, *v.shape[2:])

    xdt, bh, ch = chunks(xdt), chunks(bh), chunks(ch)
    log_a = chunks(dts * a.float()).permute(0, 3, 1, 2)  # [B, H, chunks, chunk]
    cum = log_a.cumsum(dim=-1)

    # 1. Diagonal blocks: the outputs from inputs of the same chunk.
    decay = torch.exp(segsum(log_a))  # [B, H, chunks, chunk, chunk]
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", ch, bh, decay, xdt)
    # 2. Each chunk's final state from its own inputs.
    to_end = torch.exp(cum[..., -1:] - cum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", bh, to_end, xdt)
    # 3. The recurrence over chunks: the state entering each chunk (zero initial state).
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(segsum(torch.nn.functional.pad(cum[..., -1], (1, 0))))
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
    # 4. Off-diagonal blocks: each entering state read out through C, decayed to the step.
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", ch, entering, torch.exp(cum))

    y = (y_diag + y_off).reshape(batch, n_chunks * chunk, heads, -1)[:, :t_len]
    y = y + x * d.float().reshape(heads, 1)
    return y.to(out_dtype)


def selective_scan_ref(u, delta, a, b, c, d, out_dtype):
    """Mamba's selective scan as `selective_scan_ref` computes it, in float32: u and
    delta [B, T, D], a [D, N], b and c [B, T, N], d [D]; returns y [B, T, D] in `out_dtype`."""
    batch, t_len, channels = u.shape
    u, delta, b, c = u.float(), delta.float(), b.float(), c.float()
    delta_a = torch.exp(torch.einsum("btd,dn->btdn", delta, a.float()))
    delta_b_u = torch.einsum("btd,btn,btd->btdn", delta, b, u)
    h = u.new_zeros(batch, channels, a.shape[1])
    ys = []
    for i in range(t_len):
        h = delta_a[:, i] * h + delta_b_u[:, i]
        ys.append(torch.einsum("bdn,bn->bd", h, c[:, i]))
    y = torch.stack(ys, dim=1) if ys else u.new_zeros(batch, 0, channels)
    y = y + u * d.float()
    return y.to(out_dtype)


def gated_delta_recurrent(q, k, v, alpha, beta, out_dtype):
    """The gated delta rule step by step in float32 (the naive recurrent form): q, k, v
    [B, T, H, K or V], alpha and beta [B, T, H]; returns o [B, T, H, V] in `out_dtype`."""
    batch, t_len, heads, k_dim = k.shape
    q, k, v, alpha, beta = (x.float() for x in (q, k, v, alpha, beta))
    s = v.new_zeros(batch, heads, v.shape[-1], k_dim)  # the state S [B, H, V, K]
    o = v.new_empty(batch, t_len, heads, v.shape[-1])
    for t in range(t_len):
        k_t = k[:, t]
        s = s * alpha[:, t, :, None, None]
        u = (s @ k_t.unsqueeze(-1)).squeeze(-1)  # alpha_t S_{t-1} k_t
        delta = beta[:, t, :, None] * (v[:, t] - u)
        s = s + delta.unsqueeze(-1) * k_t.unsqueeze(-2)
        o[:, t] = (s @ q[:, t].unsqueeze(-1)).squeeze(-1)
    return o.to(out_dtype)


def _to_chunks(x, t_pad, chunk):
    """[B, T, H, D] -> float32 [B, H, chunks, chunk, D], zero-padded to t_pad steps."""
    batch, t_len, heads, dim = x.shape
    x = x.float()
    if t_pad > t_len:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, t_pad - t_len))
    return x.transpose(1, 2).reshape(batch, heads, t_pad // chunk, chunk, dim)


def _based_linear(q, k, v, scale):
    """The linear branch c sum_{s <= t} (q_t . k_s) v_s on chunked [B, H, N, C, D] inputs:
    the masked intra-chunk scores times v plus q times the earlier chunks' summed k^T v."""
    chunk = q.shape[-2]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    out = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0) @ v
    kv = k.transpose(-1, -2) @ v  # each chunk's k^T v [B, H, N, K, V]
    earlier = torch.nn.functional.pad(kv[:, :, :-1], (0, 0, 0, 0, 1, 0))
    del kv
    earlier = earlier.cumsum(dim=2)  # the sum over the chunks before each one
    out = out + q @ earlier
    return out * scale


def _based_window(q, k, v, scale, window):
    """The sliding-window branch on chunked [B, H, N, C, D] inputs: each chunk of queries
    against the keys of its own chunk and of the chunks before it that the window reaches,
    the exact softmax of c q . k over the keys s with t - W < s <= t (a band mask)."""
    n_chunks, chunk = q.shape[2], q.shape[3]
    back = window_chunks(window, n_chunks, chunk)
    fpad = torch.nn.functional.pad
    # `back` zero chunks in front: chunk j of kp and vp is chunk j - back of k and v, so query
    # chunk n reads chunks n + p of them (p = 0 ... back), column (p, i) is step (n - back) C
    # + p C + i; the steps before 0 are masked.
    kp, vp = fpad(k, (0, 0, 0, 0, back, 0)), fpad(v, (0, 0, 0, 0, back, 0))
    scores = torch.cat([q @ kp[:, :, p:p + n_chunks].transpose(-1, -2)
                        for p in range(back + 1)], dim=-1)  # [B, H, N, C, (back + 1) C]
    dev = q.device
    steps = torch.arange(n_chunks * chunk, device=dev).view(n_chunks, chunk, 1)
    keys = ((torch.arange(n_chunks, device=dev) - back) * chunk).view(n_chunks, 1, 1) \
        + torch.arange((back + 1) * chunk, device=dev)
    lag = steps - keys  # t - s [N, C, (back + 1) C]
    valid = (lag >= 0) & (lag < int(window)) & (keys >= 0)
    probs = torch.softmax(scores.mul_(scale).masked_fill_(~valid, float("-inf")), dim=-1)
    del scores
    out = probs[..., :chunk] @ vp[:, :, :n_chunks]
    for p in range(1, back + 1):
        out = out + probs[..., p * chunk:(p + 1) * chunk] @ vp[:, :, p:p + n_chunks]
    return out


def based_chunked(q, k, v, scale, window, out_dtype, chunk=CHUNK):
    """Based in float32, chunks of `chunk` steps: q, k, v [B, T, H, K or V]; o [B, T, H, V]
    in `out_dtype`, the linear branch plus the sliding-window softmax branch."""
    batch, t_len, heads, _ = q.shape
    if t_len == 0:
        return v.new_zeros(v.shape, dtype=out_dtype)
    t_pad = padded_len(t_len, chunk)
    # Zero padding at the end: its keys lie after every real query (masked out of the window,
    # and k = v = 0 adds nothing to the linear branch); its outputs are dropped.
    q, k, v = (_to_chunks(x, t_pad, chunk) for x in (q, k, v))
    o = _based_linear(q, k, v, float(scale))
    o = o + _based_window(q, k, v, float(scale), window)
    o = o.permute(0, 2, 3, 1, 4).reshape(batch, t_pad, heads, -1)[:, :t_len]
    return o.to(out_dtype).contiguous()


def caller(args):
    """The call on the mixer's inputs (files.inputs, in order) returning a tuple (y,)."""
    out_dtype = torch.bfloat16 if args["dtype"] == "bf16" else torch.float32
    mixer = args["mixer"]
    if mixer == "ssd":
        return lambda x, dt, a, b, c, d: (ssd_chunked(x, dt, a, b, c, d, out_dtype),)
    if mixer == "gated_delta":
        return lambda q, k, v, alpha, beta: (
            gated_delta_recurrent(q, k, v, alpha, beta, out_dtype),)
    if mixer == "based":
        scale, window = float(args["scale"]), int(args["window"])
        return lambda q, k, v: (based_chunked(q, k, v, scale, window, out_dtype),)
    return lambda u, delta, a, b, c, d: (selective_scan_ref(u, delta, a, b, c, d, out_dtype),)


def with_backward(forward):
    """A fwd+bwd call from `forward` (the mixer's inputs -> (y,)): takes the inputs and then dy,
    runs the forward with autograd recording on leaves that alias the inputs, then
    torch.autograd.grad of sum(dy * y) with respect to every input; returns y and the gradients
    in input order (the protocol's outputs: O, then files.gradients)."""
    def call(*args):
        *inputs, dy = args
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in inputs]
            (y,) = forward(*leaves)
            grads = torch.autograd.grad(y, leaves, dy)
        return (y.detach(),) + tuple(grads)
    return call


def check_inputs(args, inputs):
    """Raises ValueError unless the job's inputs are the mixer's, by name and in order (then
    dy for a fwd+bwd call)."""
    names = tuple(t["name"] for t in inputs)
    want = INPUTS[args["mixer"]] + (("dy",) if args.get("pass") == "fwd+bwd" else ())
    if names != want:
        raise ValueError("inputs %s, expected %s for %s" % (", ".join(names), ", ".join(want),
                                                             args["mixer"]))


def classify(exc):
    if isinstance(exc, DoesNotFit):
        return "oom", str(exc)
    status, msg = torch_cpu.classify(exc)
    if isinstance(exc, RuntimeError) and "not enough memory" in str(exc).lower():
        status = "oom"
    return status, msg


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        # After the measurement: the version queries must not load anything before the first
        # call is timed.
        reply["libraries"] = (torch_sdpa.libraries() if on_gpu(job)
                              else torch_cpu.libraries())
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    args = arguments(job)
    why = IMPORT_ERROR or unsupported_reason(args, implementation)
    if why is None and on_gpu(job) and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    try:
        fields, window = (_measure_gpu if on_gpu(job) else _measure_cpu)(job)
    except Exception as e:
        status, msg = classify(e)
        if status == "oom" and not isinstance(e, DoesNotFit):
            msg = "%s: %s" % (temporaries_text(args), msg)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)


def _formulation_notes(args):
    notes = [MIXER_NOTES[args["mixer"]]]
    if args["mixer"] == "based":
        back = window_chunks(args["window"], padded_len(args["seq_len"]) // CHUNK)
        if back > 1:
            notes.append("window %d: each chunk of queries reads the keys of %d chunks before "
                         "its own" % (int(args["window"]), back))
    if args["dtype"] == "bf16":
        notes.append(UPCAST_NOTE)
    return notes


def _measure_cpu(job):
    files = job["files"]
    args = arguments(job)
    check_inputs(args, files["inputs"])
    physical = host_memory_bytes()
    fits(args, None if physical is None else CPU_MEMORY_FRACTION * physical,
         "half the host's physical memory")
    return torch_outputs.measure_on_cpu(job, caller(args), _formulation_notes(args))


def _measure_gpu(job):
    args = arguments(job)
    notes = _formulation_notes(args)
    notes.append("fp32: TF32 %s (torch.backends.cuda.matmul.allow_tf32 = %s)" % (
        "allowed" if torch.backends.cuda.matmul.allow_tf32 else "not allowed",
        torch.backends.cuda.matmul.allow_tf32))
    check_inputs(args, job["files"]["inputs"])
    call = caller(args)
    if args.get("pass") == "fwd+bwd":
        call = with_backward(call)
        notes.append(BACKWARD_NOTE)
    return torch_outputs.measure_on_gpu(
        job, call, notes, fit=lambda free: fits(args, free, "the free device memory"))


def _sequential_ssd(x, dt, a, b, c, d):
    """SSD one step after another in float64 (the self-test's reference)."""
    x, dt, a, b, c, d = (v.double() for v in (x, dt, a, b, c, d))
    batch, t_len, heads, p_dim = x.shape
    per_group = heads // b.shape[2]
    y = torch.zeros_like(x)
    for h in range(heads):
        g = h // per_group
        s = x.new_zeros(batch, p_dim, b.shape[3])
        for t in range(t_len):
            step = dt[:, t, h].reshape(batch, 1, 1)
            s = torch.exp(step * a[h]) * s + step * x[:, t, h, :, None] * b[:, t, g, None, :]
            y[:, t, h] = (s * c[:, t, g, None, :]).sum(-1) + d[h] * x[:, t, h]
    return y


def _sequential_scan(u, delta, a, b, c, d):
    """The selective scan one step after another in float64 (the self-test's reference)."""
    u, delta, a, b, c, d = (v.double() for v in (u, delta, a, b, c, d))
    batch, t_len, channels = u.shape
    h = u.new_zeros(batch, channels, a.shape[1])
    y = torch.zeros_like(u)
    for t in range(t_len):
        dt = delta[:, t, :, None]
        h = torch.exp(dt * a) * h + dt * u[:, t, :, None] * b[:, t, None, :]
        y[:, t] = (h * c[:, t, None, :]).sum(-1) + d * u[:, t]
    return y


def _sequential_gated_delta(q, k, v, alpha, beta):
    """The gated delta rule in float64 as its definition reads, one step after another:
    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t (the
    self-test's reference)."""
    q, k, v, alpha, beta = (x.double() for x in (q, k, v, alpha, beta))
    batch, t_len, heads, k_dim = k.shape
    eye = torch.eye(k_dim, dtype=torch.float64)
    s = q.new_zeros(batch, heads, v.shape[-1], k_dim)
    o = q.new_zeros(batch, t_len, heads, v.shape[-1])
    for t in range(t_len):
        kk = k[:, t, :, :, None] * k[:, t, :, None, :]  # k k^T [B, H, K, K]
        b_t, a_t = beta[:, t, :, None, None], alpha[:, t, :, None, None]
        s = a_t * s @ (eye - b_t * kk) + b_t * v[:, t, :, :, None] * k[:, t, :, None, :]
        o[:, t] = (s * q[:, t, :, None, :]).sum(-1)
    return o


def _sequential_based(q, k, v, scale, window):
    """Based in float64 one query after another: the linear branch from the running sum of
    k_s v_s^T, the window branch as the softmax over the window's keys (the self-test's
    reference)."""
    q, k, v = (x.double() for x in (q, k, v))
    batch, t_len, heads, k_dim = k.shape
    kv = q.new_zeros(batch, heads, k_dim, v.shape[-1])
    o = q.new_zeros(batch, t_len, heads, v.shape[-1])
    for t in range(t_len):
        kv = kv + k[:, t, :, :, None] * v[:, t, :, None, :]
        linear = scale * (q[:, t, :, :, None] * kv).sum(-2)
        lo = max(0, t - window + 1)
        scores = scale * torch.einsum("bhk,bshk->bhs", q[:, t], k[:, lo:t + 1])
        window_out = torch.einsum("bhs,bshv->bhv", scores.softmax(-1), v[:, lo:t + 1])
        o[:, t] = linear + window_out
    return o


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


def self_test():
    """Pure checks of this module (no torch needed), then torch_cpu's and the shared ones;
    with torch, both formulations against a float64 step-by-step recurrence."""
    failures = torch_cpu.self_test()

    def check(cond, what):
        if not cond:
            failures.append("torch_mixers: " + what)

    ssd = {"mixer": "ssd", "pass": "fwd", "dtype": "bf16", "heads": 8, "groups": 2}
    check(unsupported_reason(ssd, "torch_eager") is None, "ssd bf16 is measured")
    check(unsupported_reason(dict(ssd, mixer="selective_scan", dtype="fp32"), "torch_eager")
          is None, "the scan in fp32 is measured")
    check("hyena" in unsupported_reason(dict(ssd, mixer="hyena"), "torch_eager"),
          "other mixers are refused")
    gd = {"mixer": "gated_delta", "pass": "fwd", "dtype": "bf16", "heads": 8, "head_dim": 64}
    based = dict(gd, mixer="based", dtype="fp32", window=64, scale=0.125)
    check(unsupported_reason(gd, "torch_eager") is None, "gated delta bf16 is measured")
    check(unsupported_reason(based, "torch_eager") is None, "based fp32 is measured")
    check(unsupported_reason(dict(based, window=1000), "torch_eager") is None,
          "a long window is measured")
    check("window" in (unsupported_reason(dict(based, window=0), "torch_eager") or ""),
          "window 0 is refused")
    check(unsupported_reason(dict(gd, **{"pass": "fwd+bwd"}), "torch_eager") is None,
          "gated_delta's backward is measured")
    check("fwd" in unsupported_reason(dict(ssd, mixer="selective_scan", dtype="fp32",
                                           **{"pass": "fwd+bwd"}), "torch_eager"),
          "selective_scan: the backward is refused")
    check(unsupported_reason(dict(based, **{"pass": "fwd+bwd"}), "torch_eager") is None,
          "based's backward is measured")
    for m in (gd, based):
        check("fp16" in unsupported_reason(dict(m, dtype="fp16"), "torch_eager"),
              "%s: fp16 is refused" % m["mixer"])
    check([window_chunks(w, 10) for w in (1, 2, 64, 65, 66, 129, 10 ** 6)]
          == [0, 1, 1, 1, 2, 2, 9] and window_chunks(100, 1) == 0 and window_chunks(5, 0) == 0,
          "the chunks the window reads")
    gd_args = dict(gd, batch=4, seq_len=1000)
    check(temporaries_bytes(gd_args) == 4 * 4 * 8 * (1000 * 64 * 4 + 3 * 64 * 64),
          "gated delta temporaries (bf16)")
    check(temporaries_bytes(dict(gd_args, dtype="fp32")) == 4 * 4 * 8 * (
        1000 * 64 + 3 * 64 * 64), "gated delta temporaries (fp32)")
    based_args = dict(based, batch=4, seq_len=65536, head_dim=128)
    check(temporaries_bytes(based_args) == 4 * 4 * 8 * (4 * 65536 * 128 + 2 * 1024 * 128 * 128),
          "based temporaries, the chunk states larger")
    check(temporaries_bytes(dict(based_args, seq_len=70, head_dim=8)) == 4 * 4 * 8 * (
        4 * 128 * 8 + 2 * 128 * 64 * 2), "based temporaries, the window's scores larger")
    try:
        fits(based_args, 1e9, "test memory")
        check(False, "based at T = 65536 fits in 1 GB")
    except DoesNotFit as e:
        check("k^T v" in str(e), "based oom row: %s" % e)
    check(any("3 chunks" in n for n in _formulation_notes(dict(based, window=150, seq_len=1000)))
          and len(_formulation_notes(dict(based, seq_len=1000))) == 1, "a long window is noted")
    check(unsupported_reason(dict(ssd, **{"pass": "fwd+bwd"}), "torch_eager") is None,
          "ssd's backward is measured")
    check("fwd+bwd" in (unsupported_reason(dict(ssd, mixer="selective_scan",
                                                **{"pass": "fwd+bwd"}), "torch_eager") or ""),
          "the scan's backward (a loop over seq_len) is refused")
    check("fp16" in unsupported_reason(dict(ssd, dtype="fp16"), "torch_eager"),
          "fp16 is refused")
    check("groups" in unsupported_reason(dict(ssd, groups=3), "torch_eager"),
          "heads not a multiple of groups")
    check("unknown" in unsupported_reason(ssd, "torch_dense"), "other names are unknown")
    check(padded_len(70) == 128 and padded_len(64) == 64 and padded_len(0) == 0, "padding")
    scan_args = {"mixer": "selective_scan", "batch": 2, "seq_len": 1000, "channels": 100,
                 "state": 16}
    check(temporaries_bytes(scan_args) == 2 * 4 * 2 * 1000 * 100 * 16, "scan temporaries")
    check(temporaries_bytes({"mixer": "ssd", "batch": 1, "seq_len": 70, "heads": 2})
          == 2 * 4 * 2 * 128 * CHUNK, "ssd temporaries over the padded length")
    try:
        fits(scan_args, 1e6, "test memory")
        check(False, "a scan of 25.6 MB fits in 1 MB")
    except DoesNotFit as e:
        check(classify(e)[0] == "oom" and "deltaA" in str(e), "oom row: %s" % e)
    fits(scan_args, 1e9, "test memory")
    fits(scan_args, None, "unknown memory")
    check(on_gpu({"device": "gpu"}) and not on_gpu({"device": "cpu"}) and on_gpu({}),
          "the job's device picks the path; no device is the GPU")
    try:
        check_inputs({"mixer": "ssd"}, [{"name": n} for n in INPUTS["selective_scan"]])
        check(False, "the scan's inputs pass for ssd")
    except ValueError:
        pass
    if torch is not None:
        gen = torch.Generator().manual_seed(7)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen)

        def pos(*shape):  # a step after the softplus
            return torch.nn.functional.softplus(rnd(*shape) - 1.0)

        bsz, t_len, heads, groups, p_dim, n_dim = 2, 70, 4, 2, 3, 5
        x, dt, a = rnd(bsz, t_len, heads, p_dim), pos(bsz, t_len, heads), -torch.rand(
            heads, generator=gen) - 0.1
        b, c, d = rnd(bsz, t_len, groups, n_dim), rnd(bsz, t_len, groups, n_dim), rnd(heads)
        with torch.no_grad():
            want = _sequential_ssd(x, dt, a, b, c, d)
            (got,) = caller({"mixer": "ssd", "dtype": "fp32"})(x, dt, a, b, c, d)
            err = _rel(got, want)
            check(got.dtype == torch.float32 and err < 1e-5, "ssd rel_l2 %g (T = 70)" % err)
            x16, b16, c16 = x.bfloat16(), b.bfloat16(), c.bfloat16()
            want = _sequential_ssd(x16, dt, a, b16, c16, d)
            (got,) = caller({"mixer": "ssd", "dtype": "bf16"})(x16, dt, a, b16, c16, d)
            err = _rel(got, want)
            check(got.dtype == torch.bfloat16 and err < 1e-2, "ssd bf16 rel_l2 %g" % err)

            # fwd+bwd: the chunked form's gradients (with_backward) against autograd through
            # the float64 step-by-step recurrence, the same dy.
            dy = rnd(bsz, t_len, heads, p_dim)
            got = with_backward(caller({"mixer": "ssd", "dtype": "fp32"}))(x, dt, a, b, c, d, dy)
            with torch.enable_grad():
                leaves = [v.double().requires_grad_() for v in (x, dt, a, b, c, d)]
                want = torch.autograd.grad(_sequential_ssd(*leaves), leaves, dy.double())
            check(len(got) == 7 and got[0].shape == x.shape, "fwd+bwd returns y and 6 gradients")
            for name, g, w in zip(("dx", "ddt", "da", "db", "dc", "dd"), got[1:], want):
                err = _rel(g, w)
                check(g.shape == w.shape and err < 1e-4, "ssd %s rel_l2 %g" % (name, err))

            channels = 6
            u, delta = rnd(bsz, t_len, channels), pos(bsz, t_len, channels)
            a = -torch.rand(channels, n_dim, generator=gen) - 0.1
            b, c, d = rnd(bsz, t_len, n_dim), rnd(bsz, t_len, n_dim), rnd(channels)
            want = _sequential_scan(u, delta, a, b, c, d)
            (got,) = caller({"mixer": "selective_scan", "dtype": "fp32"})(u, delta, a, b, c, d)
            err = _rel(got, want)
            check(got.shape == u.shape and err < 1e-5, "scan rel_l2 %g" % err)

            # Based's fwd+bwd: the chunked form's gradients against autograd through the
            # float64 query-by-query form, windows shorter and longer than a chunk.
            q, k, v = (rnd(bsz, t_len, heads, p_dim + 5) for _ in range(3))
            dy = rnd(bsz, t_len, heads, p_dim + 5)
            for window in (5, 65):
                args = {"mixer": "based", "dtype": "fp32", "scale": 0.3, "window": window}
                got = with_backward(caller(args))(q, k, v, dy)
                with torch.enable_grad():
                    leaves = [t.double().requires_grad_() for t in (q, k, v)]
                    want = torch.autograd.grad(_sequential_based(*leaves, 0.3, window), leaves,
                                               dy.double())
                check(len(got) == 4, "based fwd+bwd returns O and 3 gradients")
                for name, g, w in zip(("dq", "dk", "dv"), got[1:], want):
                    err = _rel(g, w)
                    check(g.shape == w.shape and err < 1e-4,
                          "based W=%d %s rel_l2 %g" % (window, name, err))

            for name, err, bound in _new_mixer_errors(gen):
                check(err < bound, "%s rel_l2 %g (bound %g)" % (name, err, bound))
    return failures


def _new_mixer_errors(gen, bsz=2, t_len=70, heads=3, dim=8):
    """[(what, rel_l2 against float64, bound)] of the gated delta rule and Based in fp32 and
    bf16 (the inputs rounded to bf16, the reference on the rounded values), on random inputs
    of [bsz, t_len, heads, dim]; Based for several windows."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(bsz, t_len, heads, dim), rnd(bsz, t_len, heads, dim), rnd(bsz, t_len, heads,
                                                                            dim)
    k_unit = k / k.norm(dim=-1, keepdim=True)
    alpha = 0.5 + 0.5 * torch.rand(bsz, t_len, heads, generator=gen)
    beta = torch.rand(bsz, t_len, heads, generator=gen)
    scale = dim ** -0.5
    out = []
    for dtype, name, bound in ((torch.float32, "fp32", 1e-5), (torch.bfloat16, "bf16", 1e-2)):
        qd, kd, vd, ud = (x.to(dtype) for x in (q * scale, k, v, k_unit))
        want = _sequential_gated_delta(qd, ud, vd, alpha, beta)
        (got,) = caller({"mixer": "gated_delta", "dtype": name})(qd, ud, vd, alpha, beta)
        ok = got.dtype == dtype and got.shape == want.shape
        out.append(("gated_delta %s" % name, _rel(got, want) if ok else float("inf"), bound))
        for window in (1, 5, 64, 65, 100, 1000):
            want = _sequential_based(qd, kd, vd, scale, window)
            args = {"mixer": "based", "dtype": name, "scale": scale, "window": window}
            (got,) = caller(args)(qd, kd, vd)
            ok = got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
            out.append(("based %s W=%d" % (name, window),
                        _rel(got, want) if ok else float("inf"), bound))
    return out


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
