//! `attention --grids decode`: the decoding grid of issue 10 §2 and the project's split-KV
//! decoding kernels as implementations ([`kernelpages::attention::decode_gpu`]):
//! `flash_decode` reads the case's K and V where every implementation reads them
//! (`[B, KVH, T, D]`, one page per sequence), `flash_decode_paged` and `flash_decode_paged256`
//! read the same values moved into vLLM pages of [`PAGE`] and [`PAGE_LARGE`] keys handed out in
//! reverse order (the rearrangement happens at upload, outside the timing). Decoding rows carry GB/s
//! ([`AttentionCase::bytes_moved`]) besides TFLOP/s.

use kernelpages::attention::decode_gpu::{self, row_blocks, CacheLayout, DecodePlan, Decoder};
use kernelpages::attention::AttentionCase;
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::own;
use kernelpages::runner::protocol::{Job, Reply};

/// The split-KV decoding implementation on the contiguous cache (what `dot_product_attention`
/// runs for a decoding shape).
pub const CONTIGUOUS: &str = decode_gpu::IMPLEMENTATION;
/// The split-KV decoding implementation on a paged cache of [`PAGE`]-key pages.
pub const PAGED: &str = "flash_decode_paged";
/// The same on pages of [`PAGE_LARGE`] keys (issue 10 asks for pages of 16 to 256 tokens).
pub const PAGED_LARGE: &str = "flash_decode_paged256";

/// Set to a positive count, forces the number of key ranges of every decoding row the process
/// measures (a probe of the split against the plan's one wave; the row's note gives the split
/// that ran). Unset, empty or not a positive count: the plan's.
pub const SPLITS_ENV: &str = "KP_DECODE_SPLITS";

/// The forced split count [`SPLITS_ENV`]'s value `v` asks for.
fn forced_splits(v: Option<&str>) -> Option<usize> {
    v.and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}
/// All three, with their library column.
pub const IMPLEMENTATIONS: [(&str, &str); 3] = [
    (CONTIGUOUS, "kernelpages"),
    (PAGED, "kernelpages"),
    (PAGED_LARGE, "kernelpages"),
];
/// The decoding document's figures are drawn against the cache length.
pub const AXES: [&str; 1] = ["seq_len_kv"];
/// True for `flash_decode` and the paged ones.
pub fn is_decode(implementation: &str) -> bool {
    IMPLEMENTATIONS.iter().any(|(n, _)| *n == implementation)
}
/// Keys per page of `flash_decode_paged` (vLLM's default block size).
pub const PAGE: usize = 16;
/// Keys per page of `flash_decode_paged256`.
pub const PAGE_LARGE: usize = 256;

/// Keys per page of a paged implementation; `None` for the contiguous cache.
pub fn page_of(implementation: &str) -> Option<usize> {
    match implementation {
        PAGED => Some(PAGE),
        PAGED_LARGE => Some(PAGE_LARGE),
        _ => None,
    }
}

/// The decoding grid: 32 query heads on 8 kv heads, head_dim 128, bf16; 1, 2 and 8 query rows
/// (causal bottom-right: speculative tokens see the cache and the tokens before them) against
/// caches of 4k, 32k and 128k keys at batch 1 and 8, and 4k and 32k at batch 64. `quick`: batch
/// 1 and 8, 1 query row, 4k keys.
pub fn cases(quick: bool) -> Vec<AttentionCase> {
    let mut sizes: Vec<(usize, usize)> = Vec::new();
    let lens: &[usize] = if quick {
        &[4096]
    } else {
        &[4096, 32768, 131072]
    };
    for &b in &[1, 8] {
        for &l in lens {
            sizes.push((b, l));
        }
    }
    if !quick {
        sizes.extend([(64, 4096), (64, 32768)]);
    }
    let queries: &[usize] = if quick { &[1] } else { &[1, 2, 8] };
    let mut out = Vec::new();
    for &(batch, len) in &sizes {
        for &tq in queries {
            out.push(AttentionCase {
                seq_len_q: tq,
                seq_len_kv: len,
                kv_heads: 8,
                causal: true,
                ..AttentionCase::new(batch, 32, 1, 128)
            });
        }
    }
    out
}

/// One input set on the device: Q, the cache as the implementation reads it, its block table
/// and the sequences' lengths.
pub struct DecodeSet {
    q: cudarc::driver::CudaSlice<u16>,
    k: cudarc::driver::CudaSlice<u16>,
    v: cudarc::driver::CudaSlice<u16>,
    table: cudarc::driver::CudaSlice<i32>,
    lens: cudarc::driver::CudaSlice<i32>,
}

/// The case process's launcher for both decoding implementations.
struct DecodeLaunch {
    dec: Decoder,
    case: AttentionCase,
    layout: CacheLayout,
    max_pages: usize,
    /// Keys per page, or `None` for the contiguous cache.
    page: Option<usize>,
    lse: cudarc::driver::CudaSlice<f32>,
}

/// Elements of each of K and V as the case's process uploads them: the pages [`to_pages`] fills
/// (at least one), or the contiguous `[B, KVH, T, D]` cache.
fn cache_elems(c: &AttentionCase, page: Option<usize>) -> usize {
    let row = c.kv_heads * c.head_dim;
    match page {
        Some(page) => page_count(c, page).max(1) * page * row,
        None => c.kv_elems(),
    }
}

/// Pages of `page` keys that the case's sequences fill.
fn page_count(c: &AttentionCase, page: usize) -> usize {
    (0..c.batch).map(|b| c.kv_len(b).div_ceil(page)).sum()
}

/// `[B, KVH, T, D]` words moved into pages `[num_pages, page, KVH, D]` handed out in reverse
/// order (page `num_pages − 1` first), with the block table `[B, max_pages]`; pages hold only
/// each sequence's keys (`kv_len(b)`), the rest of a last page zero.
fn to_pages(c: &AttentionCase, x: &[u16], page: usize, max_pages: usize) -> (Vec<u16>, Vec<i32>) {
    let (kvh, t, d) = (c.kv_heads, c.seq_len_kv, c.head_dim);
    let n_pages = page_count(c, page);
    let mut pages = vec![0u16; n_pages.max(1) * page * kvh * d];
    let mut table = vec![0i32; c.batch * max_pages];
    let mut next = n_pages;
    for b in 0..c.batch {
        for p in 0..c.kv_len(b).div_ceil(page) {
            next -= 1;
            table[b * max_pages + p] = next as i32;
            for r in 0..page {
                let key = p * page + r;
                if key >= c.kv_len(b) {
                    break;
                }
                for h in 0..kvh {
                    let src = ((b * kvh + h) * t + key) * d;
                    let dst = ((next * page + r) * kvh + h) * d;
                    pages[dst..dst + d].copy_from_slice(&x[src..src + d]);
                }
            }
        }
    }
    (pages, table)
}

impl own::Launcher for DecodeLaunch {
    type Set = DecodeSet;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<DecodeSet, GpuError> {
        let [q, k, v, ..] = host else {
            return Err(GpuError::Config("decoding takes q, k, v".into()));
        };
        let c = &self.case;
        let lens: Vec<i32> = (0..c.batch).map(|b| c.kv_len(b) as i32).collect();
        let (k, v, table) = if let Some(page) = self.page {
            let (kp, table) = to_pages(c, k, page, self.max_pages);
            let (vp, _) = to_pages(c, v, page, self.max_pages);
            (
                gpu.stream.clone_htod(&kp)?,
                gpu.stream.clone_htod(&vp)?,
                table,
            )
        } else {
            (
                gpu.stream.clone_htod(k)?,
                gpu.stream.clone_htod(v)?,
                (0..c.batch as i32).collect(),
            )
        };
        Ok(DecodeSet {
            q: gpu.stream.clone_htod(q)?,
            k,
            v,
            table: gpu.stream.clone_htod(&table)?,
            lens: gpu.stream.clone_htod(&lens)?,
        })
    }
    fn replicate(&self, gpu: &Gpu, s: &DecodeSet) -> Result<DecodeSet, GpuError> {
        Ok(DecodeSet {
            q: gpu.stream.clone_dtod(&s.q)?,
            k: gpu.stream.clone_dtod(&s.k)?,
            v: gpu.stream.clone_dtod(&s.v)?,
            table: gpu.stream.clone_dtod(&s.table)?,
            lens: gpu.stream.clone_dtod(&s.lens)?,
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        s: &DecodeSet,
        outs: &mut [cudarc::driver::CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let [o] = outs else {
            return Err(GpuError::Config("decoding writes one output".into()));
        };
        self.dec.launch(
            gpu,
            &s.q,
            &s.k,
            &s.v,
            &s.table,
            &s.lens,
            self.layout,
            self.max_pages,
            o,
            &mut self.lse,
        )
    }
    fn temporary_bytes(&self) -> u64 {
        self.dec.temporary_bytes() + self.lse.len() as u64 * 4
    }
    fn residual_bytes(&self) -> Option<u64> {
        None
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process of `flash_decode` and the paged ones: compile, first call, check
/// and time one case (`own::measure`).
pub fn measure(job: &Job) -> Reply {
    let c = match super::job_case(job, decode_gpu::unsupported_case) {
        Ok(c) => c,
        Err(reply) => return *reply,
    };
    let page = page_of(&job.implementation);
    let mut planned: Option<String> = None;
    let mut reply = own::measure(job, |gpu| {
        let sms = gpu.describe()?.sm_count.map_or(1, |n| n as usize);
        let shape = decode_gpu::shape_of(&c);
        let forced = forced_splits(std::env::var(SPLITS_ENV).ok().as_deref());
        let plan = DecodePlan::for_shape(&shape, c.seq_len_kv, sms, forced);
        let mut n = note(&c, &job.implementation, plan);
        if let Some(k) = forced {
            n.push_str(&format!(
                " (the split forced by {SPLITS_ENV}={k}: not what dot_product_attention plans)"
            ));
        }
        planned = Some(n);
        let dec = Decoder::new(gpu, shape, plan)?;
        let compile_s = dec.compile_s;
        let (layout, max_pages) = if let Some(page) = page {
            (
                CacheLayout::paged(page, c.kv_heads, c.head_dim),
                c.seq_len_kv.div_ceil(page).max(1),
            )
        } else {
            (
                CacheLayout::contiguous(c.seq_len_kv, c.kv_heads, c.head_dim),
                1,
            )
        };
        if let Some(n) = planned.as_mut() {
            n.push_str(if dec.uses_tma(layout, max_pages, cache_elems(&c, page)) {
                "; K and V tiles by TMA tensor copies (compute capability 9.0)"
            } else {
                "; K and V tiles by cp.async"
            });
        }
        let lse = gpu
            .stream
            .alloc_zeros::<f32>(c.batch * c.heads * c.seq_len_q)?;
        Ok((
            DecodeLaunch {
                dec,
                case: c.clone(),
                layout,
                max_pages,
                page,
                lse,
            },
            compile_s,
        ))
    });
    if reply.row.status == kernelpages::schema::Status::Ok {
        reply.row.notes.extend(planned);
    }
    reply
}

/// The note on a decoding row: the split `plan` chose and the cache layout.
pub fn note(c: &AttentionCase, implementation: &str, plan: DecodePlan) -> String {
    let cache = if let Some(page) = page_of(implementation) {
        format!("vLLM pages of {page} keys, handed out in reverse order")
    } else {
        "the contiguous [B, KVH, T, D] cache".to_string()
    };
    let rows = decode_gpu::shape_of(c).rows();
    let blocks = row_blocks(rows, c.head_dim);
    format!(
        "split-KV: {} splits of {} keys per (sequence, kv head), {} CTAs, {}; reads {cache}",
        plan.splits,
        plan.keys_per_split,
        plan.splits * c.batch * c.kv_heads * blocks,
        if plan.splits > 1 {
            "the last CTA of each (sequence, kv head) combining the ranges"
        } else {
            "each writing its rows' output"
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::attention::{Dtype, Pass};

    #[test]
    fn forced_splits_take_positive_counts_only() {
        assert_eq!(forced_splits(Some("48")), Some(48));
        assert_eq!(forced_splits(Some(" 16 ")), Some(16));
        for bad in [Some("0"), Some("-3"), Some("many"), Some(""), None] {
            assert_eq!(forced_splits(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn pages_hold_each_key_once_in_reverse_order() {
        let c = AttentionCase {
            seq_len_q: 1,
            seq_len_kv: 40,
            kv_heads: 2,
            kv_lens: Some(vec![40, 17]),
            ..AttentionCase::new(2, 4, 1, 8)
        };
        let n = c.batch * c.kv_heads * c.seq_len_kv * c.head_dim;
        let x: Vec<u16> = (0..n as u32).map(|i| i as u16).collect();
        let max_pages = 40usize.div_ceil(PAGE);
        let (pages, table) = to_pages(&c, &x, PAGE, max_pages);
        // 3 + 2 pages; sequence 0's first page is the last one.
        assert_eq!(pages.len(), 5 * PAGE * 2 * 8);
        assert_eq!(cache_elems(&c, Some(PAGE)), pages.len());
        assert_eq!(cache_elems(&c, None), x.len());
        assert_eq!(&table[..3], &[4, 3, 2]);
        assert_eq!(&table[3..5], &[1, 0]);
        for b in 0..2 {
            for h in 0..2 {
                for key in 0..c.kv_len(b) {
                    let page = table[b * max_pages + key / PAGE] as usize;
                    let at = ((page * PAGE + key % PAGE) * 2 + h) * 8;
                    let src = ((b * 2 + h) * 40 + key) * 8;
                    assert_eq!(&pages[at..at + 8], &x[src..src + 8], "b{b} h{h} key {key}");
                }
            }
        }
    }

    #[test]
    fn the_grid_is_decoding_shapes_the_kernels_run() {
        let all = cases(false);
        assert_eq!(all.len(), (2 * 3 + 2) * 3);
        for c in &all {
            assert!(c.is_decoding(), "{c:?}");
            assert_eq!(decode_gpu::unsupported_case(c), None, "{c:?}");
            assert!(c.bytes_moved() > 0.0);
        }
        let big = AttentionCase {
            pass: Pass::FwdBwd,
            ..all[0].clone()
        };
        assert!(decode_gpu::unsupported_case(&big)
            .unwrap()
            .contains("forward only"));
        let square = AttentionCase::new(4, 8, 4096, 128);
        assert!(decode_gpu::unsupported_case(&square)
            .unwrap()
            .contains("not a decoding shape"));
        let f32c = AttentionCase {
            dtype: Dtype::F32,
            ..all[0].clone()
        };
        assert!(decode_gpu::unsupported_case(&f32c).is_some());
        let plan = DecodePlan::for_shape(&decode_gpu::shape_of(&all[0]), 32768, 132, None);
        let n = note(&all[0], PAGED, plan);
        assert!(
            n.contains("32 splits of 1024 keys") && n.contains("pages of 16 keys"),
            "{n}"
        );
        assert!(note(&all[0], PAGED_LARGE, plan).contains("pages of 256 keys"));
        assert_eq!(page_of(CONTIGUOUS), None);
    }
}
