//! Split-KV decoding on the GPU over a paged or contiguous KV cache (issue 10 §2):
//! `kernels/flash_decode.cu` compiled by NVRTC, checked against [`super::decode`]'s float64
//! reference.
//!
//! Flash-decoding (Dao, Haziza, Massa and Sizov, 2023): the keys of each sequence are split into
//! ranges of [`DecodePlan::keys_per_split`] keys; one CTA per (split, kv head, sequence) attends
//! the kv head's G = heads / kv_heads query heads (GQA) with all their query rows
//! (one or two 16-row tensor-core row tiles a CTA, [`row_tiles`]; more rows take several CTAs,
//! [`row_blocks`]) to its range and writes a partial output and log-sum-exp; the CTA of a
//! (sequence, kv head, row block) that finishes last merges its rows' partials exactly
//! ([`super::decode::combine`]'s formula), in the same kernel (with one range the CTA writes
//! the output directly). Splitting is what fills the GPU when batch × kv_heads
//! CTAs would not: [`DecodePlan::for_shape`] fills one wave of [`ctas_per_sm`] CTAs per SM.
//!
//! Shapes and dtypes: Q and O `[batch, heads, seq_len_q, head_dim]` in bf16 or fp16 (16-bit
//! words); the cache as [`CacheLayout`] describes, in the same dtype; `block_table`
//! `[batch, max_pages]` i32 page numbers; `seq_lens` `[batch]` i32; LSE `[batch, heads,
//! seq_len_q]` f32, natural log, +∞ for a row that sees no key (its output 0). Causal is
//! bottom-right: query i of sequence b sees key t when t ≤ i + seq_lens\[b\] − seq_len_q.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::cuda::{DeviceInputs, PRELUDE_SRC};
use super::sm90::{tma_map_16_box, TmaMap};
use super::{AttentionCase, Dtype, Pass};
use crate::gpu::{Gpu, GpuError};

/// Source of the decoding kernels (after [`PRELUDE_SRC`]).
pub const DECODE_SRC: &str = include_str!("../../kernels/flash_decode.cu");

/// Keys per tile in the split kernel (`KT` in `kernels/flash_decode.cu`).
pub const KEY_TILE: usize = 64;

/// Set to `0`, keeps every [`Decoder`] the process builds on the cp.async loader even where the
/// TMA loader applies (for timing one against the other).
pub const TMA_ENV: &str = "KP_DECODE_TMA";

/// The name of the split-KV kernel on a contiguous cache in documents and in
/// `api::implementation`: what `dot_product_attention` runs on CUDA for a decoding shape
/// ([`takes`]).
pub const IMPLEMENTATION: &str = "flash_decode";

/// The decoding kernels' shape for attention case `c` (its scale resolved).
pub fn shape_of(c: &AttentionCase) -> DecodeShape {
    DecodeShape {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        seq_len_q: c.seq_len_q,
        head_dim: c.head_dim,
        dtype: c.dtype,
        causal: c.causal,
        scale: c.scale(),
    }
}

/// Why the split-KV kernels do not take case `c`, or `None` when they do: a forward pass of
/// a decoding shape ([`AttentionCase::is_decoding`]) that [`DecodeShape::unsupported`]
/// accepts. The dispatch sends exactly the cases this accepts to [`forward`].
pub fn unsupported_case(c: &AttentionCase) -> Option<String> {
    if c.pass != Pass::Fwd {
        return Some("the decoding kernels are forward only".into());
    }
    if !c.is_decoding() {
        return Some(format!(
            "not a decoding shape (at most {} query rows against at least {} keys)",
            AttentionCase::DECODE_MAX_QUERIES,
            AttentionCase::DECODE_MIN_KEYS
        ));
    }
    shape_of(c).unsupported()
}

/// True when `dot_product_attention` on CUDA runs case `c` on the split-KV kernel.
pub fn takes(c: &AttentionCase) -> bool {
    unsupported_case(c).is_none()
}

/// One split-KV decoding call of case `c` on the contiguous `[B, KVH, T, D]` K and V of `inp`
/// (each sequence's length from `inp.kv_lens`), writing O (`[B, H, seq_len_q, D]` words of the
/// case's dtype) into `out`: plans for the device's SMs, compiles (cached per process), and
/// launches the split kernel. For repeated calls keep a [`Decoder`].
///
/// # Errors
/// [`GpuError::Config`] when [`unsupported_case`] refuses `c`; compile and driver errors.
pub fn forward(
    gpu: &Gpu,
    c: &AttentionCase,
    inp: &DeviceInputs,
    out: &mut CudaSlice<u16>,
) -> Result<(), GpuError> {
    if let Some(why) = unsupported_case(c) {
        return Err(GpuError::Config(why));
    }
    let shape = shape_of(c);
    let sms = gpu.describe()?.sm_count.map_or(1, |n| n as usize);
    let plan = DecodePlan::for_shape(&shape, c.seq_len_kv, sms, None);
    let mut dec = Decoder::new(gpu, shape, plan)?;
    let table: Vec<i32> = (0..c.batch as i32).collect();
    let table = gpu.stream.clone_htod(&table)?;
    let mut lse = gpu
        .stream
        .alloc_zeros::<f32>(c.batch * c.heads * c.seq_len_q)?;
    dec.launch(
        gpu,
        &inp.q,
        &inp.k,
        &inp.v,
        &table,
        &inp.kv_lens,
        CacheLayout::contiguous(c.seq_len_kv, c.kv_heads, c.head_dim),
        1,
        out,
        &mut lse,
    )
}

/// Threads per CTA of the split kernel.
pub const THREADS: usize = 128;

/// Head dimensions the decoding kernels are instantiated for.
pub const DECODE_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Most CTAs per SM the split kernel is built for (its launch bounds at head_dim ≤ 128).
pub const CTAS_PER_SM: usize = 2;

/// Shared memory of one SM of compute capability 9.0 (228 KiB), of which each resident CTA
/// also takes 1 KiB for the system.
const SM_SHARED_BYTES: usize = 228 * 1024;

/// CTAs of the split kernel with `row_tiles` row tiles that fit one SM at `head_dim` (by
/// shared memory, at most [`CTAS_PER_SM`]): 2 at head_dim 64 and 128, 1 at 256 (140 KiB each).
/// Its launch bounds and [`DecodePlan::for_shape`]'s wave use it.
pub fn ctas_per_sm(head_dim: usize, row_tiles: usize) -> usize {
    (SM_SHARED_BYTES / (split_smem_bytes(head_dim, row_tiles) + 1024)).clamp(1, CTAS_PER_SM)
}

/// Query rows of one mma.m16n8k16 row tile; a CTA of the split kernel attends
/// [`row_tiles`] of them (`RM` = 16 · `MT`; rows past G × seq_len_q are zero and never
/// written).
pub const ROW_TILE: usize = 16;

/// Row tiles per CTA (`MT`) for `rows` query rows per kv head at `head_dim`: two when the rows
/// need more than one tile and the accumulators of 32 rows fit the registers (head_dim ≤ 128),
/// so both tiles share every K and V fragment and the cache is read once per 32 rows; else
/// one.
pub fn row_tiles(rows: usize, head_dim: usize) -> usize {
    if rows > ROW_TILE && head_dim <= 128 {
        2
    } else {
        1
    }
}

/// Where key `t` of sequence `b` and kv head `h` lives, in elements:
/// `page_stride · block_table[b][t / page_size] + row_stride · (t % page_size) + head_stride · h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// Keys per page.
    pub page_size: usize,
    /// Elements between pages.
    pub page_stride: usize,
    /// Elements between consecutive keys of a page.
    pub row_stride: usize,
    /// Elements between kv heads.
    pub head_stride: usize,
}

impl CacheLayout {
    /// vLLM's pages `[num_pages, page_size, kv_heads, head_dim]`.
    pub fn paged(page_size: usize, kv_heads: usize, head_dim: usize) -> CacheLayout {
        CacheLayout {
            page_size,
            page_stride: page_size * kv_heads * head_dim,
            row_stride: kv_heads * head_dim,
            head_stride: head_dim,
        }
    }

    /// True for [`CacheLayout::contiguous`]'s layout at `kv_heads` and `head_dim`: each page a
    /// `[kv_heads, page_size, head_dim]` slab (what the TMA loader's tensor maps describe).
    pub fn is_contiguous(&self, kv_heads: usize, head_dim: usize) -> bool {
        *self == CacheLayout::contiguous(self.page_size, kv_heads, head_dim)
    }

    /// True for [`CacheLayout::paged`]'s layout at `kv_heads` and `head_dim` (vLLM's pages
    /// `[num_pages, page_size, kv_heads, head_dim]`).
    pub fn is_paged(&self, kv_heads: usize, head_dim: usize) -> bool {
        *self == CacheLayout::paged(self.page_size, kv_heads, head_dim)
    }

    /// A contiguous cache `[batch, kv_heads, max_len, head_dim]` (the layout of the rest of
    /// `crate::attention`): one page of `max_len` keys per sequence, block table `[[b]]`.
    pub fn contiguous(max_len: usize, kv_heads: usize, head_dim: usize) -> CacheLayout {
        CacheLayout {
            page_size: max_len.max(1),
            page_stride: kv_heads * max_len.max(1) * head_dim,
            row_stride: head_dim,
            head_stride: max_len.max(1) * head_dim,
        }
    }
}

/// One decoding call's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeShape {
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Query rows per sequence (1 for one decoding step; more for speculative decoding).
    pub seq_len_q: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// bf16 or fp16.
    pub dtype: Dtype,
    /// Bottom-right causal mask among the query rows.
    pub causal: bool,
    /// Softmax scale (1/√head_dim by default).
    pub scale: f64,
}

impl DecodeShape {
    /// A bf16 shape without a mask, its scale 1/√head_dim.
    pub fn new(
        batch: usize,
        heads: usize,
        kv_heads: usize,
        seq_len_q: usize,
        head_dim: usize,
    ) -> DecodeShape {
        DecodeShape {
            batch,
            heads,
            kv_heads,
            seq_len_q,
            head_dim,
            dtype: Dtype::Bf16,
            causal: false,
            scale: (head_dim as f64).powf(-0.5),
        }
    }

    /// Query rows that share a kv head: (heads / kv_heads) · seq_len_q.
    pub fn rows(&self) -> usize {
        self.heads / self.kv_heads.max(1) * self.seq_len_q
    }

    /// Row tiles per CTA of the split kernel ([`row_tiles`]).
    pub fn row_tiles(&self) -> usize {
        row_tiles(self.rows(), self.head_dim)
    }

    /// CTAs of the split kernel per key range: batch · kv_heads · [`row_blocks`].
    pub fn ctas_per_split(&self) -> usize {
        self.batch * self.kv_heads * row_blocks(self.rows(), self.head_dim)
    }

    /// Why the kernels cannot run this shape, or `None` when they can.
    pub fn unsupported(&self) -> Option<String> {
        if self.dtype == Dtype::F32 {
            return Some("the decoding kernels take bf16 or fp16".into());
        }
        if !DECODE_HEAD_DIMS.contains(&self.head_dim) {
            return Some(format!(
                "head_dim {} (the decoding kernels are built for {DECODE_HEAD_DIMS:?})",
                self.head_dim
            ));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Some(format!(
                "heads {} is not a multiple of kv_heads {}",
                self.heads, self.kv_heads
            ));
        }
        if self.seq_len_q == 0 || self.batch == 0 {
            return Some("an empty batch or query".into());
        }
        None
    }
}

/// CTAs one kv head's `rows` query rows take at `head_dim`, 16 · [`row_tiles`] rows each (each
/// reads the keys; the row blocks of one kv head run side by side, so L2 serves the repeated
/// reads).
pub fn row_blocks(rows: usize, head_dim: usize) -> usize {
    rows.div_ceil(ROW_TILE * row_tiles(rows, head_dim)).max(1)
}

/// How one call is split: `splits` ranges of `keys_per_split` keys (a multiple of
/// [`KEY_TILE`]) cover the longest sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// Ranges per sequence (CTAs along the grid's x axis).
    pub splits: usize,
    /// Keys per range.
    pub keys_per_split: usize,
}

impl DecodePlan {
    /// The split of `shape` ([`DecodePlan::new`]) whose longest sequence has `max_len` keys,
    /// on a device of `sm_count` SMs: one wave is [`ctas_per_sm`] CTAs on every SM.
    pub fn for_shape(
        shape: &DecodeShape,
        max_len: usize,
        sm_count: usize,
        splits: Option<usize>,
    ) -> DecodePlan {
        let wave = ctas_per_sm(shape.head_dim, shape.row_tiles()) * sm_count;
        DecodePlan::new(shape.ctas_per_split(), max_len, wave, splits)
    }

    /// The split of a call of `ctas_per_split` CTAs per key range (batch · kv_heads · row
    /// blocks: [`DecodeShape::ctas_per_split`]) whose longest sequence has `max_len` keys, on a
    /// device where one wave holds `wave` CTAs (CTAs per SM · SMs): a call with fewer CTAs per
    /// range than that takes as many ranges as fill the wave without starting a second one (a
    /// second, partly filled wave would leave most SMs idle while it runs); a call that fills a
    /// wave alone takes one range. No range is shorter than one tile. `splits` forces the number
    /// of ranges (rounded so that every range holds whole tiles; at least 1).
    pub fn new(
        ctas_per_split: usize,
        max_len: usize,
        wave: usize,
        splits: Option<usize>,
    ) -> DecodePlan {
        let tiles = max_len.div_ceil(KEY_TILE).max(1);
        let wanted = splits.unwrap_or_else(|| wave / ctas_per_split.max(1));
        let wanted = wanted.clamp(1, tiles);
        let keys_per_split = tiles.div_ceil(wanted) * KEY_TILE;
        DecodePlan {
            splits: max_len.div_ceil(keys_per_split).max(1),
            keys_per_split,
        }
    }
}

/// Name and source of the split kernel for `head_dim`, `row_tiles` (1, or 2 at head_dim ≤ 128)
/// and `dtype`; with `tma` (compute capability 9.0 only, head_dim a multiple of 64) the source
/// also holds its TMA build, [`tma_kernel_name`] of the name, which takes the tensor maps of K
/// and V and the paged copies' rows ([`tma_page_rows`]; 0 for the contiguous cache) after the
/// portable kernel's arguments.
pub fn decode_source(
    head_dim: usize,
    row_tiles: usize,
    dtype: Dtype,
    tma: bool,
) -> (String, String) {
    let bf = dtype == Dtype::Bf16;
    let dt = dtype.as_str();
    let split = format!("flash_decode_split_{dt}_d{head_dim}_m{row_tiles}");
    let ctas = ctas_per_sm(head_dim, row_tiles);
    let params = "const u16* Q, const u16* K, const u16* V, const int* block_table, const int* \
                  seq_lens, float* Opart, float* Lpart, int* counters, u16* O, float* LSE, int \
                  Tq, int H, int KVH, int page_size, int max_pages, long long page_stride, long \
                  long row_stride, long long head_stride, int keys_per_split, float scale_log2, \
                  int causal";
    let args = "Q, K, V, block_table, seq_lens, Opart, Lpart, counters, O, LSE, Tq, H, KVH, \
                page_size, max_pages, page_stride, row_stride, head_stride, keys_per_split, \
                scale_log2, causal";
    let kernel = |name: &str, extra: &str, tma: bool, maps: &str| {
        format!(
            "extern \"C\" __global__ void __launch_bounds__({THREADS}, {ctas}) {name}({params}\
             {extra}) {{ flash_decode_split<{head_dim}, {row_tiles}, {bf}, {tma}>({args}, \
             {maps}); }}\n"
        )
    };
    let mut src = format!(
        "{PRELUDE_SRC}\n{DECODE_SRC}\n{}",
        kernel(&split, "", false, "nullptr, nullptr, 0")
    );
    if tma {
        src.push_str(&kernel(
            &tma_kernel_name(&split),
            ", const __grid_constant__ TmaMap tmk, const __grid_constant__ TmaMap tmv, int tma_rows",
            true,
            "&tmk, &tmv, tma_rows",
        ));
    }
    (split, src)
}

/// The page size below [`KEY_TILE`] whose pages the TMA build copies one each (a tile is then
/// four whole pages). Pages of 8 and 32 keys would take the same copies, but no GPU test has
/// run them yet.
pub const TMA_SMALL_PAGE: usize = 16;

/// Keys per TMA copy of the TMA build on a paged cache of `page_size`-key pages: the page for
/// [`TMA_SMALL_PAGE`], [`KEY_TILE`] for a multiple of it (a tile lies in one page); `None` for
/// other sizes, which keep the cp.async loader.
pub fn tma_page_rows(page_size: usize) -> Option<usize> {
    if page_size == TMA_SMALL_PAGE {
        Some(page_size)
    } else if page_size.is_multiple_of(KEY_TILE) && page_size > 0 {
        Some(KEY_TILE)
    } else {
        None
    }
}

/// The TMA build's name of split kernel `split` ([`decode_source`] with `tma`).
pub fn tma_kernel_name(split: &str) -> String {
    format!("{split}_tma")
}

/// Most splits one call may have at `head_dim` with `row_tiles` row tiles: the CTA that
/// combines keeps the weights of its 16 · `row_tiles` rows for every split in the ring's
/// shared memory, whose tiles are unpadded in the TMA build (at least 384 at head_dim 64 with
/// two row tiles; a plan for one wave asks for at most 264 on an H200).
pub fn max_splits(head_dim: usize, row_tiles: usize) -> usize {
    let ring_bytes = ring_stages(head_dim) * 2 * KEY_TILE * head_dim * 2;
    ring_bytes / 4 / (ROW_TILE * row_tiles)
}

/// Stages of the split kernel's K/V tile ring at `head_dim` (`NS`: three at head_dim ≤ 128,
/// where two CTAs fit an SM, two at 256).
pub fn ring_stages(head_dim: usize) -> usize {
    if head_dim <= 128 {
        3
    } else {
        2
    }
}

/// Dynamic shared memory of the split kernel, bytes (`DecodeSmem::BYTES`): the ring's stages
/// of a K and a V tile of [`KEY_TILE`] keys, then 16 · `row_tiles` rows of Q, every row padded
/// by 8 elements of 2 bytes, then 16 bytes for the combine's flag.
pub fn split_smem_bytes(head_dim: usize, row_tiles: usize) -> usize {
    (ring_stages(head_dim) * 2 * KEY_TILE + ROW_TILE * row_tiles) * (head_dim + 8) * 2 + 16
}

/// Dynamic shared memory of the split kernel's TMA build, bytes (`DecodeSmem<D, MT, true>::BYTES`):
/// the ring's stages of unpadded (128-byte-swizzled) K and V tiles, Q's padded rows, an mbarrier
/// per stage, the combine's flag, and up to 1 KiB to align the ring to 1,024 bytes.
pub fn split_smem_bytes_tma(head_dim: usize, row_tiles: usize) -> usize {
    let stages = ring_stages(head_dim);
    stages * 2 * KEY_TILE * head_dim * 2
        + ROW_TILE * row_tiles * (head_dim + 8) * 2
        + stages * 8
        + 16
        + 1024
}

/// Rows of the partial buffers for `rows` query rows under `plan`: one per row and range, or
/// a single placeholder when one range writes the output itself.
fn partial_rows(rows: usize, plan: DecodePlan) -> usize {
    if plan.splits > 1 {
        rows * plan.splits
    } else {
        1
    }
}

/// The compiled kernel, partial buffers and counters for one shape and plan.
pub struct Decoder {
    shape: DecodeShape,
    plan: DecodePlan,
    split: CudaFunction,
    smem: u32,
    /// The TMA build and its shared memory, on compute capability 9.0 at head_dim 64, 128 and
    /// 256 unless [`TMA_ENV`] is `0`: what [`Decoder::launch`] runs where
    /// [`Decoder::uses_tma`] says so (the contiguous cache, pages of [`tma_page_rows`]).
    tma: Option<(CudaFunction, u32)>,
    /// Whether [`Decoder::launch`] may use the TMA build ([`Decoder::set_tma`]).
    tma_on: bool,
    /// CTAs per kv head along the grid's y axis ([`row_blocks`]).
    row_blocks: usize,
    opart: CudaSlice<f32>,
    lpart: CudaSlice<f32>,
    /// One completion counter per (sequence, kv head and row block): zero between calls.
    counters: CudaSlice<i32>,
    /// NVRTC compile + load time, s.
    pub compile_s: f64,
}

impl Decoder {
    /// Compiles the kernels for `shape` (see [`DecodeShape::unsupported`]) and allocates the
    /// partials for `plan`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an unsupported shape or one needing more shared memory than
    /// the device allows; compile and driver errors.
    pub fn new(gpu: &Gpu, shape: DecodeShape, plan: DecodePlan) -> Result<Decoder, GpuError> {
        if let Some(why) = shape.unsupported() {
            return Err(GpuError::Config(why));
        }
        let mt = shape.row_tiles();
        let most = max_splits(shape.head_dim, mt);
        if plan.splits > most {
            return Err(GpuError::Config(format!(
                "{} splits (the combine holds at most {most} weights per row at head_dim {})",
                plan.splits, shape.head_dim
            )));
        }
        let want_tma = gpu.arch() == "sm_90a"
            && shape.head_dim.is_multiple_of(64)
            && std::env::var(TMA_ENV).map_or(true, |v| v != "0");
        let (split_name, src) = decode_source(shape.head_dim, mt, shape.dtype, want_tma);
        let compiled = gpu.compile(&format!("{split_name}.cu"), &src)?;
        let smem = split_smem_bytes(shape.head_dim, mt) as u32;
        super::cuda::check_smem(gpu, &split_name, smem)?;
        let split = gpu.function(&compiled.module, &split_name, smem)?;
        let tma = if want_tma {
            let name = tma_kernel_name(&split_name);
            let bytes = split_smem_bytes_tma(shape.head_dim, mt) as u32;
            super::cuda::check_smem(gpu, &name, bytes)?;
            Some((gpu.function(&compiled.module, &name, bytes)?, bytes))
        } else {
            None
        };
        let rows = shape.batch * shape.heads * shape.seq_len_q;
        let blocks = row_blocks(shape.rows(), shape.head_dim);
        Ok(Decoder {
            row_blocks: blocks,
            counters: gpu
                .stream
                .alloc_zeros::<i32>(shape.batch * shape.kv_heads * blocks)?,
            shape,
            plan,
            split,
            smem,
            tma,
            tma_on: true,
            // One range writes O directly: no partials.
            opart: gpu
                .stream
                .alloc_zeros::<f32>(partial_rows(rows, plan) * shape.head_dim)?,
            lpart: gpu.stream.alloc_zeros::<f32>(partial_rows(rows, plan))?,
            compile_s: compiled.compile_s,
        })
    }

    /// The plan the decoder was built for.
    pub fn plan(&self) -> DecodePlan {
        self.plan
    }

    /// Lets [`Decoder::launch`] use the TMA build where it applies (`true`, the default) or
    /// keeps it on the cp.async loader (`false`; the GPU test compares the two bit for bit).
    pub fn set_tma(&mut self, on: bool) {
        self.tma_on = on;
    }

    /// True when [`Decoder::launch`] brings K and V by TMA for a cache of `cache_elems`
    /// elements (each of K and V) laid out as `layout` with `max_pages` pages per sequence: the
    /// TMA build exists (compute capability 9.0, head_dim a multiple of 64, [`TMA_ENV`] not `0`,
    /// [`Decoder::set_tma`] not off), the cache is contiguous (one page a sequence) or paged
    /// with pages of [`tma_page_rows`], it holds whole pages, and its key rows fit the tensor
    /// copies' 32-bit coordinates. Everything else runs the cp.async loader.
    pub fn uses_tma(&self, layout: CacheLayout, max_pages: usize, cache_elems: usize) -> bool {
        self.tma_rows(layout, max_pages, cache_elems).is_some()
    }

    /// The TMA build's `tma_rows` argument for `layout` (0: contiguous; the paged copies' keys),
    /// or `None` where the cp.async loader runs ([`Decoder::uses_tma`]).
    fn tma_rows(&self, layout: CacheLayout, max_pages: usize, cache_elems: usize) -> Option<usize> {
        let (kvh, d) = (self.shape.kv_heads, self.shape.head_dim);
        let page = layout.page_size * kvh * d;
        let whole = cache_elems >= page && cache_elems.is_multiple_of(page);
        if !self.tma_on || self.tma.is_none() || !whole {
            None
        } else if max_pages == 1 && layout.is_contiguous(kvh, d) {
            // The copies address a (sequence, kv head) plane as an int.
            (cache_elems / (layout.page_size * d) <= i32::MAX as usize).then_some(0)
        } else if layout.is_paged(kvh, d) {
            // The copies address a key row as an int (page · page_size + place).
            let fits = cache_elems / (kvh * d) <= i32::MAX as usize;
            tma_page_rows(layout.page_size).filter(|_| fits)
        } else {
            None
        }
    }

    /// Bytes of the partials (temporaries of one call).
    pub fn temporary_bytes(&self) -> u64 {
        let s = &self.shape;
        let rows = partial_rows(s.batch * s.heads * s.seq_len_q, self.plan) as u64;
        rows * (s.head_dim as u64 + 1) * 4 + (s.batch * s.kv_heads * self.row_blocks) as u64 * 4
    }

    /// Launches one decoding call on the stream: O and LSE for Q against the cache `k`, `v`
    /// laid out as `layout`, sequence b's pages `block_table[b * max_pages ..]` (enough pages
    /// for `seq_lens[b]` keys), its length `seq_lens[b]` (keys past the plan's
    /// `splits · keys_per_split` fall to the last split).
    ///
    /// # Errors
    /// Driver errors, the tensor maps' among them where the TMA build runs
    /// ([`Decoder::uses_tma`]).
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        q: &CudaSlice<u16>,
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        block_table: &CudaSlice<i32>,
        seq_lens: &CudaSlice<i32>,
        layout: CacheLayout,
        max_pages: usize,
        o: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = &self.shape;
        let (tq, h, kvh) = (s.seq_len_q as i32, s.heads as i32, s.kv_heads as i32);
        let (page_size, max_pages_i) = (layout.page_size as i32, max_pages as i32);
        let (ps, rs, hs) = (
            layout.page_stride as i64,
            layout.row_stride as i64,
            layout.head_stride as i64,
        );
        let kps = self.plan.keys_per_split as i32;
        let scale_log2 = (s.scale * std::f64::consts::LOG2_E) as f32;
        let causal = i32::from(s.causal);
        let tma_rows = if v.len() == k.len() {
            self.tma_rows(layout, max_pages, k.len())
        } else {
            None
        };
        let (func, smem) = match (&self.tma, tma_rows) {
            (Some((f, bytes)), Some(_)) => (f, *bytes),
            _ => (&self.split, self.smem),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                self.plan.splits as u32,
                (s.kv_heads * self.row_blocks) as u32,
                s.batch as u32,
            ),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        // The tensor maps of K and V: the contiguous cache as [planes][page_size][head_dim]
        // (plane = page · kv_heads + kv head) in boxes of 64 keys, the paged one as
        // [pages · page_size][kv_heads][head_dim] in boxes of one head and `rows` keys. The
        // guards live until after the launch (dropping one records the buffer's read on this
        // stream, which must follow the kernel's TMA reads).
        let (kp, _gk) = k.device_ptr(&gpu.stream);
        let (vp, _gv) = v.device_ptr(&gpu.stream);
        // (tma_rows said the cache is whole pages and the same size for K and V.)
        let maps: Option<[TmaMap; 2]> = if let Some(rows) = tma_rows {
            let (dims, bx) = if rows == 0 {
                let slab = layout.page_size * s.head_dim;
                let dims = (k.len() / slab, layout.page_size, s.head_dim);
                (dims, [64, KEY_TILE as u32, 1])
            } else {
                let dims = (k.len() / (s.kv_heads * s.head_dim), s.kv_heads, s.head_dim);
                (dims, [64, 1, rows as u32])
            };
            Some([
                tma_map_16_box(kp, dims, bx, s.dtype)?,
                tma_map_16_box(vp, dims, bx, s.dtype)?,
            ])
        } else {
            None
        };
        let rows_arg = tma_rows.unwrap_or(0) as i32;
        let mut b = gpu.stream.launch_builder(func);
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(block_table)
            .arg(seq_lens)
            .arg(&mut self.opart)
            .arg(&mut self.lpart)
            .arg(&mut self.counters)
            .arg(o)
            .arg(lse)
            .arg(&tq)
            .arg(&h)
            .arg(&kvh)
            .arg(&page_size)
            .arg(&max_pages_i)
            .arg(&ps)
            .arg(&rs)
            .arg(&hs)
            .arg(&kps)
            .arg(&scale_log2)
            .arg(&causal);
        if let Some(maps) = &maps {
            b.arg(&maps[0]).arg(&maps[1]).arg(&rows_arg);
        }
        // SAFETY: the arguments match `flash_decode_split_*(const u16* Q, const u16* K, const
        // u16* V, const int* block_table, const int* seq_lens, float* Opart, float* Lpart, int*
        // counters, u16* O, float* LSE, int Tq, int H, int KVH, int page_size, int max_pages,
        // long long page_stride, long long row_stride, long long head_stride, int
        // keys_per_split, float scale_log2, int causal)`, and the `_tma` build's two TmaMap
        // values and `int tma_rows` after them (maps of K and V over whole pages of the
        // buffers, as tma_rows checked; the table's page numbers below k.len() / (page_size ·
        // kv_heads · head_dim) as the caller's layout promises, and a tensor copy past a map's
        // end reads zeros rather than memory); Opart, Lpart and the counters (zero between
        // calls: the kernel sets them back) were allocated for this shape and plan (the
        // combine's weights fit its shared memory: `new` checked [`max_splits`]), O holds rows ·
        // head_dim words and LSE rows; the caller gives the cache, table and lengths `layout`
        // and `max_pages` describe.
        unsafe { b.launch(cfg)? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_longest_sequence_in_whole_tiles() {
        for (ctas, len, sms, forced) in [
            (8, 32768, 132, None),
            (64, 32768, 132, None),
            (128, 32768, 132, None),
            (512, 4096, 132, None),
            (8, 1, 132, None),
            (1, 100, 132, Some(7)),
            (16, 1000, 132, Some(64)),
        ] {
            let p = DecodePlan::new(ctas, len, CTAS_PER_SM * sms, forced);
            assert_eq!(p.keys_per_split % KEY_TILE, 0, "{p:?}");
            assert!(p.splits * p.keys_per_split >= len, "{p:?} covers {len}");
            assert!(
                (p.splits - 1) * p.keys_per_split < len.max(1),
                "{p:?}: an empty split"
            );
            if forced.is_none() && len >= KEY_TILE * 64 {
                let wave = CTAS_PER_SM * sms;
                // One wave, at least half full; or one range when the CTAs fill a wave alone.
                if ctas < wave {
                    assert!(ctas * p.splits <= wave, "{p:?}: a second wave");
                    assert!(2 * ctas * p.splits > wave, "{p:?} leaves SMs idle");
                } else {
                    assert_eq!(p.splits, 1, "{p:?}");
                }
            }
        }
        // Batch 1, 8 kv heads, 32k keys on 132 SMs: 32 splits of 1024 keys (33 asked, whole tiles),
        // 256 CTAs; batch 8:
        // 4 splits of 8192 (256 CTAs, not 5 splits and a second wave of 56).
        let p = DecodePlan::new(8, 32768, 264, None);
        assert_eq!((p.splits, p.keys_per_split), (32, 1024));
        let p = DecodePlan::new(64, 32768, 264, None);
        assert_eq!((p.splits, p.keys_per_split), (4, 8192));
        let s = DecodeShape::new(8, 32, 8, 8, 128);
        // GQA 4:1 with 8 tokens: 32 rows, one CTA of two row tiles per (sequence, kv head).
        assert_eq!(s.ctas_per_split(), 8 * 8);
        // One CTA per SM at head_dim 256 (its shared memory): the wave is one per SM.
        assert_eq!(
            [(64, 1), (64, 2), (128, 1), (128, 2), (256, 1)].map(|(d, m)| ctas_per_sm(d, m)),
            [CTAS_PER_SM, CTAS_PER_SM, CTAS_PER_SM, CTAS_PER_SM, 1]
        );
        let wide = DecodeShape::new(1, 32, 8, 1, 256);
        assert_eq!(DecodePlan::for_shape(&wide, 32768, 132, None).splits, 16);
    }

    #[test]
    fn layouts_place_keys_as_documented() {
        // vLLM pages [pages, page, kvh, d]: key 5 of page 16 at row 5, head 3.
        let l = CacheLayout::paged(16, 8, 128);
        assert_eq!(
            (l.page_stride, l.row_stride, l.head_stride),
            (16 * 8 * 128, 8 * 128, 128)
        );
        // [B, KVH, T, D]: sequence b is page b; key t of head h at (h * T + t) * D.
        let c = CacheLayout::contiguous(20, 32, 128);
        assert_eq!(c.page_size, 20);
        assert_eq!(c.page_stride, 32 * 20 * 128);
        assert_eq!(3 * c.head_stride + 7 * c.row_stride, (3 * 20 + 7) * 128);
        // Only the contiguous layout is what the TMA build's tensor maps describe.
        assert!(c.is_contiguous(32, 128));
        assert!(!c.is_contiguous(8, 128) && !c.is_contiguous(32, 64));
        assert!(!l.is_contiguous(8, 128));
        assert!(l.is_paged(8, 128) && !l.is_paged(4, 128) && !c.is_paged(32, 128));
        // TMA copies: a page of 16 keys each, a 64-key tile of a longer page.
        let rows: Vec<Option<usize>> = [4, 7, 8, 16, 20, 32, 64, 96, 256]
            .iter()
            .map(|&p| tma_page_rows(p))
            .collect();
        let want = [
            None,
            None,
            None,
            Some(16),
            None,
            None,
            Some(64),
            None,
            Some(64),
        ];
        assert_eq!(rows, want);
    }

    #[test]
    fn unsupported_shapes_say_why() {
        let s = DecodeShape::new(1, 32, 8, 1, 128);
        assert_eq!(
            (s.dtype, s.causal, s.scale),
            (Dtype::Bf16, false, 128f64.powf(-0.5))
        );
        assert_eq!(s.unsupported(), None);
        // GQA 4:1 with 1, 4 and 8 query rows: one CTA up to 16 rows, then one per 16.
        assert_eq!(row_blocks(s.rows(), 128), 1);
        assert_eq!(row_blocks(16, 128), 1);
        // 17 to 32 rows: one CTA of two row tiles at head_dim <= 128, two CTAs at 256.
        assert_eq!((row_tiles(17, 128), row_blocks(17, 128)), (2, 1));
        assert_eq!((row_tiles(32, 64), row_blocks(32, 64)), (2, 1));
        assert_eq!((row_tiles(32, 256), row_blocks(32, 256)), (1, 2));
        assert_eq!(row_blocks(64, 128), 2);
        for (bad, what) in [
            (DecodeShape { head_dim: 96, ..s }, "head_dim 96"),
            (
                DecodeShape {
                    dtype: Dtype::F32,
                    ..s
                },
                "bf16 or fp16",
            ),
            (DecodeShape { kv_heads: 5, ..s }, "not a multiple"),
        ] {
            let why = bad.unsupported().expect("unsupported");
            assert!(why.contains(what), "{why}");
        }
        // Shared memory: three stages of a K and a V tile plus 16 rows of Q at head_dim 128
        // (two CTAs fit the H200's 228 KiB per SM), two stages at 256.
        // (+ a 16-byte flag).
        assert_eq!(split_smem_bytes(128, 1), (3 * 2 * 64 + 16) * 136 * 2 + 16);
        assert!(2 * (split_smem_bytes(128, 2) + 1024) <= 228 * 1024);
        assert_eq!(split_smem_bytes(256, 1), (2 * 2 * 64 + 16) * 264 * 2 + 16);
        // The TMA build: unpadded tiles, Q padded, three mbarriers, the flag and 1 KiB of
        // alignment; two CTAs still fit an SM at head_dim 128 with two row tiles.
        assert_eq!(
            split_smem_bytes_tma(128, 1),
            3 * 2 * 64 * 128 * 2 + 16 * 136 * 2 + 3 * 8 + 16 + 1024
        );
        assert!(2 * (split_smem_bytes_tma(128, 2) + 1024) <= 228 * 1024);
        // The combine's weights: 16 · row tiles rows × splits floats in the ring (its smaller,
        // unpadded TMA form), which a one-wave plan never exceeds (264 CTAs on an H200, 1 per
        // kv head and sequence).
        assert_eq!(max_splits(128, 1), 3 * 2 * 64 * 128 * 2 / 4 / 16);
        assert!(DECODE_HEAD_DIMS
            .iter()
            .all(|&d| max_splits(d, row_tiles(32, d)) >= CTAS_PER_SM * 132));
    }
}
