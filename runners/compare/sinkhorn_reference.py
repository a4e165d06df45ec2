"""The runner's Sinkhorn definitions in float64 NumPy, for the Sinkhorn modules' self-tests
(`ott_sinkhorn`, `geomloss_sinkhorn`): what `kernel_sums::sinkhorn::first_step_reference`
computes in Rust, on small clouds."""

import numpy as np


def reference_f1(x, y, eps):
    """f after one iteration from f0, uniform weights, dense: f0 = softmin_y(0),
    g1 = softmin_x(f0), f1 = softmin_y(g1), with
    softmin(h)_i = -eps log sum_j w_j exp((h_j - |x_i - y_j|^2 / 2) / eps).
    x `[n, dim]`, y `[m, dim]`; returns f1 `[n]` (float64)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    c = 0.5 * np.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=2)

    def softmin(h, cost, w):
        z = (h[None, :] - cost) / eps + np.log(w)[None, :]
        mx = z.max(axis=1, keepdims=True)
        return -eps * (mx[:, 0] + np.log(np.exp(z - mx).sum(axis=1)))

    a, b = np.full(x.shape[0], 1.0 / x.shape[0]), np.full(y.shape[0], 1.0 / y.shape[0])
    f0 = softmin(np.zeros(y.shape[0]), c, b)
    g1 = softmin(f0, c.T, a)
    return softmin(g1, c, b)
