//! Quick look at `attention::cpu_flash` throughput (not the measured protocol: that is
//! `attention --device cpu`): `cargo run --release --example cpu_flash_bench -- B H T D [causal]`.

use std::time::Instant;

use kernelpages::attention::cpu_flash::{dot_product_attention_into, normal_f32, Options, Shape};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let n = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (b, h, t, d) = (n(0, 4), n(1, 8), n(2, 2048), n(3, 128));
    let causal = a.get(4).is_some_and(|s| s == "causal");
    let shape = Shape::self_attention(b, h, h, t, d);
    let to_bf16 = |x: Vec<f32>| x.into_iter().map(half::bf16::from_f32).collect::<Vec<_>>();
    let q = to_bf16(normal_f32(shape.q_elems(), 1));
    let k = to_bf16(normal_f32(shape.kv_elems(), 2));
    let v = to_bf16(normal_f32(shape.kv_elems(), 3));
    let mut o = vec![half::bf16::ZERO; shape.q_elems()];
    let opts = Options {
        causal,
        scale: None,
    };
    let flops = 4.0 * (b * h) as f64 * (t * t * d) as f64 / if causal { 2.0 } else { 1.0 };
    for _ in 0..5 {
        let t0 = Instant::now();
        dot_product_attention_into(&q, &k, &v, &shape, &opts, &mut o).unwrap();
        let s = t0.elapsed().as_secs_f64();
        println!("{:.4} s  {:.1} GFLOP/s", s, flops / s / 1e9);
    }
}
