//! The public entry points (`sequence_mixers::api`) on the GPU: each mixer's float32 output and
//! final state, from an initial state, against the float64 recurrence; SSD and the selective
//! scan also against the same call on the CPU.

use kernelpages::gpu::Device;
use kernelpages::sequence_mixers::api::{self, DeltaArgs};
use kernelpages::sequence_mixers::cpu::{ScanArgs, SsdArgs};
use kernelpages::sequence_mixers::reference::{
    self, BasedInputs, BasedShape, BasedState, DeltaShape, ScanShape, SsdShape,
};
use rand::{Rng, SeedableRng};

use super::{gpu, rel_l2};

fn draw(rng: &mut rand::rngs::StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn public_functions_match_float64_from_an_initial_state() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let dev = Device::Cuda(gpu());
    let mut failures = Vec::new();
    let mut check = |what: &str, e: f64| {
        eprintln!("{what}: {e:.2e}");
        if e.is_nan() || e >= 1e-4 {
            failures.push(format!("{what}: {e:.2e}"));
        }
    };
    // SSD: 130 steps (two chunks of 64 and a short one), 2 groups.
    let sh = SsdShape {
        batch: 2,
        seq_len: 130,
        heads: 4,
        head_dim: 64,
        state: 64,
        groups: 2,
    };
    let bt = sh.batch * sh.seq_len;
    let (x, dt, a) = (
        draw(&mut rng, bt * 4 * 64, -1.0, 1.0),
        draw(&mut rng, bt * 4, 0.01, 0.2),
        draw(&mut rng, 4, -2.0, -0.5),
    );
    let (b, c, d) = (
        draw(&mut rng, bt * 2 * 64, -1.0, 1.0),
        draw(&mut rng, bt * 2 * 64, -1.0, 1.0),
        draw(&mut rng, 4, -1.0, 1.0),
    );
    let s0 = draw(&mut rng, 2 * 4 * 64 * 64, -1.0, 1.0);
    let args = SsdArgs {
        x: &x,
        dt: &dt,
        a: &a,
        b: &b,
        c: &c,
        d: Some(&d),
        initial_state: Some(&s0),
    };
    let got = api::ssd(dev, sh, args).unwrap();
    let cpu = api::ssd(Device::Cpu, sh, args).unwrap();
    let (y, s) = api::ssd_reference(sh, args).unwrap();
    check("ssd y", rel_l2(&wide(&got.y), &y));
    check("ssd final state", rel_l2(&wide(&got.final_state), &s));
    check(
        "ssd y against the CPU",
        rel_l2(&wide(&got.y), &wide(&cpu.y)),
    );
    // The selective scan: 100 steps, 96 channels, state 16.
    let sh = ScanShape {
        batch: 2,
        seq_len: 100,
        channels: 96,
        state: 16,
    };
    let bt = sh.batch * sh.seq_len;
    let (u, delta, a) = (
        draw(&mut rng, bt * 96, -1.0, 1.0),
        draw(&mut rng, bt * 96, 0.01, 0.2),
        draw(&mut rng, 96 * 16, -2.0, -0.5),
    );
    let (b, c, d) = (
        draw(&mut rng, bt * 16, -1.0, 1.0),
        draw(&mut rng, bt * 16, -1.0, 1.0),
        draw(&mut rng, 96, -1.0, 1.0),
    );
    let s0 = draw(&mut rng, 2 * 96 * 16, -1.0, 1.0);
    let args = ScanArgs {
        u: &u,
        delta: &delta,
        a: &a,
        b: &b,
        c: &c,
        d: Some(&d),
        initial_state: Some(&s0),
    };
    let got = api::selective_scan(dev, sh, args).unwrap();
    let cpu = api::selective_scan(Device::Cpu, sh, args).unwrap();
    let (y, s) = api::selective_scan_reference(sh, args).unwrap();
    check("scan y", rel_l2(&wide(&got.y), &y));
    check("scan final state", rel_l2(&wide(&got.final_state), &s));
    check(
        "scan y against the CPU",
        rel_l2(&wide(&got.y), &wide(&cpu.y)),
    );
    // The gated delta rule: keys L2-normalised, α in (0.9, 1), β in (0, 1).
    let sh = DeltaShape {
        batch: 1,
        seq_len: 130,
        heads: 2,
        key_dim: 64,
        value_dim: 64,
    };
    let n = sh.batch * sh.seq_len * sh.heads;
    let q = draw(&mut rng, n * 64, -1.0, 1.0);
    let mut k = draw(&mut rng, n * 64, -1.0, 1.0);
    for row in k.chunks_mut(64) {
        let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        row.iter_mut().for_each(|v| *v /= norm);
    }
    let v = draw(&mut rng, n * 64, -1.0, 1.0);
    let (alpha, beta) = (draw(&mut rng, n, 0.9, 1.0), draw(&mut rng, n, 0.0, 1.0));
    let s0 = draw(&mut rng, 2 * 64 * 64, -0.1, 0.1);
    let args = DeltaArgs {
        q: &q,
        k: &k,
        v: &v,
        alpha: &alpha,
        beta: &beta,
        initial_state: Some(&s0),
    };
    let got = api::gated_delta_rule(dev, sh, args).unwrap();
    let (o, s) = api::gated_delta_rule_reference(sh, args).unwrap();
    check("gated delta o", rel_l2(&wide(&got.y), &o));
    check(
        "gated delta final state",
        rel_l2(&wide(&got.final_state), &s),
    );
    // Based: window 64, an initial linear state and an empty window cache.
    let sh = BasedShape {
        batch: 1,
        seq_len: 130,
        heads: 2,
        key_dim: 64,
        value_dim: 64,
        window: 64,
    };
    let n = sh.batch * sh.seq_len * sh.heads;
    let (q, k, v) = (
        draw(&mut rng, n * 64, 0.0, 0.5),
        draw(&mut rng, n * 64, 0.0, 0.5),
        draw(&mut rng, n * 64, -1.0, 1.0),
    );
    let s0 = draw(&mut rng, 2 * 64 * 64, -0.1, 0.1);
    let got = api::based(dev, sh, &q, &k, &v, 0.125, Some(&s0)).unwrap();
    let initial = BasedState {
        s: wide(&s0),
        ..BasedState::zeros(sh)
    };
    let (qw, kw, vw) = (wide(&q), wide(&k), wide(&v));
    let (o, state) = reference::based(
        sh,
        BasedInputs {
            q: &qw,
            k: &kw,
            v: &vw,
            scale: 0.125,
            initial_state: Some(&initial),
        },
    )
    .unwrap();
    check("based o", rel_l2(&wide(&got.y), &o));
    check(
        "based final linear state",
        rel_l2(&wide(&got.final_state), &state.s),
    );
    // The same sequence in two pieces (50 + 80 steps) through based_with_state, the window's
    // cache carried: the pieces' outputs are the one run's, and the state its state.
    let piece = |from: usize, to: usize, x: &[f32], dim: usize| -> Vec<f32> {
        x[from * 2 * dim..to * 2 * dim].to_vec()
    };
    let first = BasedShape { seq_len: 50, ..sh };
    let second = BasedShape { seq_len: 80, ..sh };
    let start = api::BasedStreamState {
        s: s0.clone(),
        keys: Vec::new(),
        values: Vec::new(),
        cached: 0,
    };
    let (y1, st1) = api::based_with_state(
        dev,
        first,
        &piece(0, 50, &q, 64),
        &piece(0, 50, &k, 64),
        &piece(0, 50, &v, 64),
        0.125,
        Some(&start),
    )
    .unwrap();
    let (y2, st2) = api::based_with_state(
        dev,
        second,
        &piece(50, 130, &q, 64),
        &piece(50, 130, &k, 64),
        &piece(50, 130, &v, 64),
        0.125,
        Some(&st1),
    )
    .unwrap();
    let y: Vec<f32> = y1.into_iter().chain(y2).collect();
    check("based in two pieces, o", rel_l2(&wide(&y), &o));
    check(
        "based in two pieces, linear state",
        rel_l2(&wide(&st2.s), &state.s),
    );
    check(
        "based in two pieces, cached keys",
        rel_l2(&wide(&st2.keys), &state.keys),
    );
    assert_eq!(st2.cached, state.cached);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
