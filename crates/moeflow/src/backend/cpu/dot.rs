//! The bf16 dot-product GEMM of the CPU experts: `C[rows_s, :] = bf16(A[rows_s, :]) · W[e_s]^T`,
//! the rows of A rounded to bf16 and the weights kept in bf16, their products summed in f32
//! two reduction steps at a time. This is what AVX512-BF16's `vdpbf16ps` computes (on AMD
//! Zen 4 at twice the rate of f32 fused multiply-adds; docs/tuning.md), and what GPUs and
//! PyTorch's bf16 layers compute.
//!
//! Each output element is accumulated pair by pair in increasing `k`: for the pair
//! `(2q, 2q + 1)`, `acc = fma(a[2q + 1], w[2q + 1], acc)`, then `acc = fma(a[2q], w[2q], acc)`,
//! and a result below f32's normal range becomes a zero of its sign (the instruction's
//! flush-to-zero). Inputs below bf16's normal range are zeros too (flushed when rounding A and
//! packing W). Products of two bf16 values are exact in f32, so this is the instruction's
//! arithmetic bit for bit (`avx512_matches_the_portable_kernel` checks it on random operands);
//! the portable kernel does the same, so a row's result depends only on the row and the
//! weights, whichever kernel or thread computes it.

use super::gemm::{row_blocks, run_segments, GemmShape, PanelKernel, Rows, Segment, Tile};
use super::packed::NR;
use half::bf16;
use rayon::prelude::*;

/// Reduction pairs per cache block: a panel's block (`KC_PAIRS · NR` words, 16 KiB) stays in L1
/// across row blocks.
const KC_PAIRS: usize = 256;
/// Rows per micro-kernel call: one 16-lane accumulator each, enough independent chains to
/// cover the instruction's latency.
const MR: usize = 12;

/// How the CPU experts multiply bf16 weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Matmul {
    /// [`Bf16Matmul::Dot`] where it doubles the arithmetic rate (AMD CPUs with AVX512-BF16:
    /// Zen 4 on), [`Bf16Matmul::Widen`] elsewhere. On Intel's AVX512-BF16 Xeons the dot
    /// product's peak is no higher than the FMA peak and the layer no faster, so there the
    /// exact widening costs nothing (docs/tuning.md).
    #[default]
    Auto,
    /// Weights widened to f32 exactly, activations kept in f32, f32 fused multiply-adds.
    Widen,
    /// Activations rounded to bf16, bf16 products summed in f32 by pairs (this module); the
    /// portable kernel computes the same bits where AVX512-BF16 is missing, much more slowly.
    Dot,
}

impl Bf16Matmul {
    /// Whether bf16 weights take the dot-product kernel on this CPU.
    pub fn uses_dot(self) -> bool {
        match self {
            Bf16Matmul::Auto => available() && amd(),
            Bf16Matmul::Widen => false,
            Bf16Matmul::Dot => true,
        }
    }

    /// What bf16 weights get on this CPU, in words: `"bf16 dot products (AVX512-BF16)"` and
    /// the like.
    pub fn describe(self) -> &'static str {
        match (self.uses_dot(), available()) {
            (true, true) => "bf16 dot products (AVX512-BF16)",
            (true, false) => "bf16 dot products (portable kernel: no AVX512-BF16 here)",
            (false, _) => "widened to f32",
        }
    }
}

impl std::fmt::Display for Bf16Matmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bf16Matmul::Auto => "auto",
            Bf16Matmul::Widen => "widen",
            Bf16Matmul::Dot => "dot",
        })
    }
}

impl std::str::FromStr for Bf16Matmul {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Bf16Matmul::Auto),
            "widen" => Ok(Bf16Matmul::Widen),
            "dot" => Ok(Bf16Matmul::Dot),
            other => Err(format!("bf16 matmul '{other}': expected auto, widen or dot")),
        }
    }
}

/// Whether this CPU is AMD's (its AVX512-BF16 dot product runs at twice the FMA rate).
fn amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: every x86-64 CPU has `cpuid` and its leaf 0, the vendor string (the
        // intrinsic is safe on recent toolchains, `unsafe` on older ones).
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat() == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs the AVX512-BF16 kernel (otherwise the portable one computes the same
/// bits, slowly).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as its bits: NaN stays NaN (quieted),
/// overflow gives ±∞, and results below bf16's normal range become zeros of their sign.
#[inline]
pub fn round_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    // Both outcomes computed and one selected, so loops over rows vectorize.
    let rounded = flush_subnormal((b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16);
    let quiet_nan = ((b >> 16) | 0x0040) as u16;
    if x.is_nan() {
        quiet_nan
    } else {
        rounded
    }
}

/// Two values rounded to bf16 as one word: `lo` in the low half.
#[inline]
fn round_pair(lo: f32, hi: f32) -> u32 {
    u32::from(round_to_bf16(lo)) | u32::from(round_to_bf16(hi)) << 16
}

/// A bf16 below the normal range becomes a zero of its sign.
#[inline]
fn flush_subnormal(h: u16) -> u16 {
    if h & 0x7f80 == 0 {
        h & 0x8000
    } else {
        h
    }
}

/// `count` bf16 matrices `[n, k]` packed for the dot-product kernel: panel `p` of matrix `e`
/// holds, for each pair `q` of reduction steps and column `j < NR`, the word
/// `w[p·NR + j, 2q] | w[p·NR + j, 2q + 1] << 16` at `q · NR + j` (zeros past `n` and `k`).
#[derive(Clone, Debug)]
pub struct PairPanels {
    /// Number of stacked matrices (experts).
    pub count: usize,
    /// Output columns of each matrix.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    data: Vec<u32>,
}

impl PairPanels {
    /// Packs `count` row-major matrices `[n, k]` stored back to back in `src`.
    pub fn pack(src: &[bf16], count: usize, n: usize, k: usize) -> Self {
        assert_eq!(src.len(), count * n * k, "packed source length");
        let (panels, pairs) = (n.div_ceil(NR), k.div_ceil(2));
        // Zeroed by the allocator, so the pages are first touched by the parallel packing.
        let mut data: Vec<u32> = bytemuck::zeroed_vec(count * panels * pairs * NR);
        if pairs > 0 {
            data.par_chunks_mut(pairs * NR).enumerate().for_each(|(idx, panel)| {
                let (e, p) = (idx / panels, idx % panels);
                for j in 0..NR.min(n - p * NR) {
                    let row = &src[(e * n + p * NR + j) * k..][..k];
                    for (kk, v) in row.iter().enumerate() {
                        panel[kk / 2 * NR + j] |= u32::from(flush_subnormal(v.to_bits())) << (16 * (kk % 2));
                    }
                }
            });
        }
        PairPanels { count, n, k, data }
    }

    /// Pairs of reduction steps (`k` rounded up to even, halved).
    pub fn pairs(&self) -> usize {
        self.k.div_ceil(2)
    }

    /// Bytes held by the packed data.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

impl PanelKernel for PairPanels {
    type A = u32;
    type B = u32;
    const KC: usize = KC_PAIRS;
    const MR: usize = MR;
    fn shape(&self) -> GemmShape {
        GemmShape { experts: self.count, n: self.n, k: self.pairs(), panels: self.n.div_ceil(NR) }
    }
    fn panel(&self, e: usize, p: usize) -> &[u32] {
        let len = NR * self.pairs();
        &self.data[(e * self.n.div_ceil(NR) + p) * len..][..len]
    }
    unsafe fn kernel(mr: usize, t: Tile<u32, u32>) {
        #[cfg(target_arch = "x86_64")]
        if available() {
            return avx512::kernel(mr, &t);
        }
        portable_kernel(mr, &t)
    }
}

/// `C[r, n] = Σ_k bf16(A[r, k]) · W_e[n, k]` for the rows `r` of every segment, summed as the
/// module describes; `A`'s and `C`'s rows found through `a_rows` and `c_rows`, as in
/// [`super::gemm::grouped_gemm`] (the same checks, the same panics).
pub fn dot_grouped_gemm(a: &[f32], a_rows: Rows, segments: &[Segment], w: &PairPanels, c: &mut [f32], c_rows: Rows) {
    assert!(a_rows.stride >= w.k, "gemm strides");
    for s in segments {
        a_rows.check(s.row_start..s.row_start + s.rows, w.k, a.len(), "A");
    }
    with_scratch(|packed| {
        let offsets = interleave_rows(a, a_rows, segments, w.k, packed);
        // SAFETY: `interleave_rows` lays out every segment's row blocks exactly as
        // `segment_tile` splits them for this kernel (`row_blocks` with the same `MR`), each
        // block `mr · pairs` words from its first row's offset.
        unsafe { run_segments(packed, Rows::indexed(1, &offsets), segments, w, c, c_rows) }
    })
}

/// Runs `f` on this thread's buffer for the interleaved copy of A, kept between calls (as
/// large as the largest GEMM input seen) so its pages are faulted in once, not every call.
/// The buffer is taken out for the call rather than borrowed across it: a caller on a rayon
/// worker may run another GEMM on this thread while it waits for its own tasks, and that one
/// then gets a fresh buffer instead of a borrow panic.
fn with_scratch<R>(f: impl FnOnce(&mut Vec<u32>) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut buffer = SCRATCH.with_borrow_mut(std::mem::take);
    let result = f(&mut buffer);
    SCRATCH.with_borrow_mut(|kept| {
        if kept.capacity() < buffer.capacity() {
            *kept = buffer;
        }
    });
    result
}

/// The rows of A that the segments read, rounded to bf16 pairs into `packed` and laid out as
/// the kernel reads them: each segment's rows split into the blocks `segment_tile` gives one
/// kernel call ([`row_blocks`] of at most `MR`), a block of `mr` rows
/// holding pair `q` of its row `r` at `q · mr + r`, so the kernel reads every row through one
/// pointer. Returns, for each GEMM row, where its block starts plus its place in the block
/// (the kernel takes the block's start from its first row; a row no segment reads gets 0).
fn interleave_rows(a: &[f32], a_rows: Rows, segments: &[Segment], k: usize, packed: &mut Vec<u32>) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let gemm_rows = segments.iter().map(|s| s.row_start + s.rows).max().unwrap_or(0);
    let mut offsets = vec![0u32; gemm_rows];
    // (first GEMM row, rows) of every block, in buffer order.
    let mut blocks = Vec::new();
    let mut len = 0usize;
    for s in segments.iter().filter(|s| s.rows > 0) {
        let (count, base, extra) = row_blocks(s.rows, MR);
        let mut first = s.row_start;
        for b in 0..count {
            let mr = base + usize::from(b < extra);
            for r in 0..mr {
                offsets[first + r] = u32::try_from(len + r).expect("GEMM input over 2^32 words");
            }
            blocks.push((first, mr));
            first += mr;
            len += mr * pairs;
        }
    }
    // Every word is written below; the fill only sizes the buffer.
    packed.clear();
    packed.resize(len, 0);
    let mut rest = packed.as_mut_slice();
    let mut work = Vec::with_capacity(blocks.len());
    for &(first, mr) in &blocks {
        let (block, tail) = rest.split_at_mut(mr * pairs);
        work.push((first, mr, block));
        rest = tail;
    }
    work.into_par_iter().with_min_len(4).for_each(|(first, mr, block)| {
        let rows: Vec<&[f32]> = (0..mr).map(|r| &a[a_rows.of(first + r) * a_rows.stride..][..k]).collect();
        // CHUNK pairs of every row rounded at once (contiguous, so it vectorizes), then
        // written out pair-major.
        const CHUNK: usize = 32;
        let mut tmp = [[0u32; CHUNK]; MR];
        for q0 in (0..pairs).step_by(CHUNK) {
            let n = CHUNK.min(pairs - q0);
            for (row, t) in rows.iter().zip(tmp.iter_mut()) {
                let part = &row[2 * q0..(2 * (q0 + n)).min(k)];
                let (whole, tail) = part.split_at(part.len() & !1);
                for (w, x) in t.iter_mut().zip(whole.chunks_exact(2)) {
                    *w = round_pair(x[0], x[1]);
                }
                if let [last] = tail {
                    t[n - 1] = round_pair(*last, 0.0);
                }
            }
            for (q, out) in block[q0 * mr..(q0 + n) * mr].chunks_exact_mut(mr).enumerate() {
                for (w, t) in out.iter_mut().zip(&tmp) {
                    *w = t[q];
                }
            }
        }
    });
    offsets
}

/// The reference micro-kernel: the pairs' fused multiply-adds in the instruction's order, each
/// result flushed to zero below f32's normal range.
///
/// # Safety
/// The tile's pointers must be valid for `mr` rows as described on [`Tile`].
unsafe fn portable_kernel(mr: usize, t: &Tile<u32, u32>) {
    let widen = |word: u32, high: bool| f32::from_bits(if high { word & 0xffff_0000 } else { word << 16 });
    let flush = |x: f32| if x.is_subnormal() { 0f32.copysign(x) } else { x };
    let block = (*t.a).add(t.a_col * mr);
    for r in 0..mr {
        let out = (*t.c.add(r)).add(t.c_col);
        for j in 0..t.cols {
            let mut acc = if t.accumulate { *out.add(j) } else { 0.0 };
            for q in 0..t.kc {
                let (x, w) = (*block.add(q * mr + r), *t.b.add(q * NR + j));
                acc = flush(widen(x, true).mul_add(widen(w, true), acc));
                acc = flush(widen(x, false).mul_add(widen(w, false), acc));
            }
            *out.add(j) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Tile, MR, NR};
    use std::arch::x86_64::*;

    /// Dispatches `mr` rows to the kernel compiled for that many accumulators.
    ///
    /// # Safety
    /// Requires AVX512F and AVX512-BF16 (checked by the caller) and valid tile pointers.
    pub(super) unsafe fn kernel(mr: usize, t: &Tile<u32, u32>) {
        match mr {
            1 => rows::<1>(t),
            2 => rows::<2>(t),
            3 => rows::<3>(t),
            4 => rows::<4>(t),
            5 => rows::<5>(t),
            6 => rows::<6>(t),
            7 => rows::<7>(t),
            8 => rows::<8>(t),
            9 => rows::<9>(t),
            10 => rows::<10>(t),
            11 => rows::<11>(t),
            _ => rows::<MR>(t),
        }
    }

    /// `M` rows × 16 columns: per pair of reduction steps, one panel row of 16 weight pairs
    /// and, for each row, its activation pair broadcast into one `vdpbf16ps`.
    ///
    /// # Safety
    /// As [`kernel`].
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn rows<const M: usize>(t: &Tile<u32, u32>) {
        let block = (*t.a).add(t.a_col * M);
        let out: [*mut f32; M] = std::array::from_fn(|r| (*t.c.add(r)).add(t.c_col));
        let mask: __mmask16 = if t.cols >= NR { !0 } else { (1u16 << t.cols) - 1 };
        let mut acc = [_mm512_setzero_ps(); M];
        if t.accumulate {
            for (v, &p) in acc.iter_mut().zip(&out) {
                *v = _mm512_maskz_loadu_ps(mask, p);
            }
        }
        // The next block's cache lines, spread evenly over the pairs.
        let (pf, pf_len) = t.prefetch;
        let per_step = pf_len.div_ceil(t.kc.max(1));
        let (mut due, mut sent) = (0, 0);
        for q in 0..t.kc {
            due = (due + per_step).min(pf_len);
            while sent < due {
                _mm_prefetch(pf.add(sent) as *const i8, _MM_HINT_T0);
                sent += 64;
            }
            let w: __m512bh = std::mem::transmute(_mm512_loadu_si512(t.b.add(q * NR) as *const _));
            let pair = block.add(q * M);
            for (r, v) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*pair.add(r) as i32));
                // The broadcast pair as the memory operand folds into the instruction ({1to16}); a
                // separate broadcast costs a vector pipe slot (docs/tuning.md).
                *v = _mm512_dpbf16_ps(*v, w, x);
            }
        }
        for (v, &p) in acc.iter().zip(&out) {
            _mm512_mask_storeu_ps(p, mask, *v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The module's arithmetic, written out: bf16-rounded A, exact products, pairs summed odd
    /// step first, flush to zero after each step.
    fn naive(a: &[f32], w: &[bf16], m: usize, n: usize, k: usize) -> Vec<f32> {
        naive_flushing(a, w, m, n, k, true)
    }

    /// As [`naive`], flushing subnormal sums to zero or not.
    fn naive_flushing(a: &[f32], w: &[bf16], m: usize, n: usize, k: usize, ftz: bool) -> Vec<f32> {
        let flush = |x: f32| if ftz && x.is_subnormal() { 0f32.copysign(x) } else { x };
        let bf = |bits: u16| f32::from_bits(u32::from(flush_subnormal(bits)) << 16);
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for q in 0..k.div_ceil(2) {
                    for kk in [2 * q + 1, 2 * q] {
                        if kk < k {
                            let x = bf(round_to_bf16(a[i * k + kk]));
                            acc = flush(x.mul_add(bf(w[j * k + kk].to_bits()), acc));
                        } else {
                            acc = flush(0f32.mul_add(0.0, acc));
                        }
                    }
                }
                c[i * n + j] = acc;
            }
        }
        c
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn rounding_matches_half_and_flushes_subnormals() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..100_000 {
            let x = f32::from_bits(rng.gen());
            let got = round_to_bf16(x);
            let want = bf16::from_f32(x);
            if x.is_nan() {
                assert!(bf16::from_bits(got).is_nan());
            } else if want.to_bits() & 0x7f80 == 0 {
                assert_eq!(got, want.to_bits() & 0x8000, "{x:e}");
            } else {
                assert_eq!(got, want.to_bits(), "{x:e}");
            }
        }
        assert_eq!(round_to_bf16(f32::MAX), bf16::INFINITY.to_bits());
        assert_eq!(round_to_bf16(-1e-39), 0x8000);
    }

    #[test]
    fn matches_the_written_out_arithmetic_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Odd and even K, over two cache blocks, N past a panel, row counts past MR.
        for &(m, n, k) in &[(1, 1, 1), (7, 17, 3), (13, 33, 300), (12, 16, 256), (2, 5, 0), (25, 40, 2 * KC_PAIRS + 5)]
        {
            let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f32(rng.gen_range(-1.0..1.0))).collect();
            let packed = PairPanels::pack(&w, 1, n, k);
            let mut c = vec![f32::NAN; m * n];
            let seg = [Segment { expert: 0, row_start: 0, rows: m }];
            dot_grouped_gemm(&a, Rows::strided(k), &seg, &packed, &mut c, Rows::strided(n));
            assert_eq!(bits(&c), bits(&naive(&a, &w, m, n, k)), "m {m} n {n} k {k}");
        }
    }

    /// The packed weights, always through the portable kernel.
    struct Portable<'a>(&'a PairPanels);

    impl PanelKernel for Portable<'_> {
        type A = u32;
        type B = u32;
        const KC: usize = KC_PAIRS;
        const MR: usize = MR;
        fn shape(&self) -> GemmShape {
            self.0.shape()
        }
        fn panel(&self, e: usize, p: usize) -> &[u32] {
            PanelKernel::panel(self.0, e, p)
        }
        unsafe fn kernel(mr: usize, t: Tile<u32, u32>) {
            portable_kernel(mr, &t)
        }
    }

    /// Operands of ordinary size, and tiny ones whose products and sums pass through f32's
    /// subnormal range: the AVX512-BF16 kernel, the portable one and the written-out
    /// arithmetic must agree on every bit.
    #[test]
    fn avx512_matches_the_portable_kernel() {
        if !available() {
            eprintln!("SKIPPED avx512_matches_the_portable_kernel: this CPU has no AVX512-BF16");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (m, n, k) = (MR + 5, 2 * NR + 3, 2 * KC_PAIRS + 7);
        for tiny in [false, true] {
            let value = |rng: &mut rand::rngs::StdRng| {
                let e: u32 = if tiny { rng.gen_range(58..66) } else { rng.gen_range(100..140) };
                f32::from_bits(rng.gen::<u32>() & 0x807f_ffff | e << 23)
            };
            let a: Vec<f32> = (0..m * k).map(|_| value(&mut rng)).collect();
            let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f32(value(&mut rng))).collect();
            let packed = PairPanels::pack(&w, 1, n, k);
            let seg = [Segment { expert: 0, row_start: 0, rows: m }];
            let mut fast = vec![f32::NAN; m * n];
            dot_grouped_gemm(&a, Rows::strided(k), &seg, &packed, &mut fast, Rows::strided(n));
            let mut rounded = Vec::new();
            let offsets = interleave_rows(&a, Rows::strided(k), &seg, k, &mut rounded);
            let mut slow = vec![f32::NAN; m * n];
            // SAFETY: the blocks were laid out for this kernel's MR.
            unsafe {
                run_segments(
                    &rounded,
                    Rows::indexed(1, &offsets),
                    &seg,
                    &Portable(&packed),
                    &mut slow,
                    Rows::strided(n),
                )
            };
            let want = naive(&a, &w, m, n, k);
            let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
            for (i, ((f, s), n)) in fast.iter().zip(&slow).zip(&want).enumerate() {
                assert!(same(*f, *s) && same(*s, *n), "element {i}: {f:e} (avx512), {s:e} (portable), {n:e}");
            }
            if tiny {
                // Some sums did pass through the subnormal range, so the flush was exercised.
                assert_ne!(bits(&want), bits(&naive_flushing(&a, &w, m, n, k, false)));
            }
        }
    }

    #[test]
    fn segments_and_indexed_rows() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (e, n, k, tokens) = (3, 20, 37, 9);
        let x: Vec<f32> = (0..tokens * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let w: Vec<bf16> = (0..e * n * k).map(|_| bf16::from_f32(rng.gen_range(-1.0..1.0))).collect();
        let packed = PairPanels::pack(&w, e, n, k);
        // 14 GEMM rows reading tokens (some twice), written to scattered rows of C.
        let token_of_row: Vec<u32> = (0..14).map(|j| (j * 5 % tokens) as u32).collect();
        let c_of_row: Vec<u32> = (0..14).map(|j| ((j * 3) % 14) as u32).collect();
        let segs = [
            Segment { expert: 2, row_start: 0, rows: 4 },
            Segment { expert: 0, row_start: 4, rows: 0 },
            Segment { expert: 1, row_start: 4, rows: 10 },
        ];
        let mut c = vec![f32::NAN; 14 * n];
        dot_grouped_gemm(&x, Rows::indexed(k, &token_of_row), &segs, &packed, &mut c, Rows::indexed(n, &c_of_row));
        for s in segs {
            let we = &w[s.expert * n * k..(s.expert + 1) * n * k];
            for j in s.row_start..s.row_start + s.rows {
                let t = token_of_row[j] as usize;
                let want = naive(&x[t * k..(t + 1) * k], we, 1, n, k);
                let row = c_of_row[j] as usize;
                assert_eq!(bits(&c[row * n..(row + 1) * n]), bits(&want), "row {j}");
            }
        }
    }

    /// GEMMs run from many rayon tasks at once (on worker threads, which may run another of
    /// them while waiting for their own) give each caller its own result, bit for bit as alone.
    #[test]
    fn nested_in_rayon_tasks() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (m, n, k) = (40, 16 * NR, 300);
        let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f32(rng.gen_range(-1.0..1.0))).collect();
        let packed = PairPanels::pack(&w, 1, n, k);
        let seg = [Segment { expert: 0, row_start: 0, rows: m }];
        let inputs: Vec<Vec<f32>> = (0..16).map(|_| (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect()).collect();
        let gemm = |a: &[f32]| {
            let mut c = vec![f32::NAN; m * n];
            dot_grouped_gemm(a, Rows::strided(k), &seg, &packed, &mut c, Rows::strided(n));
            bits(&c)
        };
        let alone: Vec<Vec<u32>> = inputs.iter().map(|a| gemm(a)).collect();
        let nested: Vec<Vec<u32>> = inputs.par_iter().map(|a| gemm(a)).collect();
        assert!(alone == nested);
    }

    /// A GEMM started while this thread's scratch is in use (as a rayon worker does when it
    /// runs another task while waiting) gets a buffer of its own, and the larger one is kept.
    #[test]
    fn scratch_can_be_taken_again_while_in_use() {
        let inner_len = with_scratch(|outer| {
            outer.resize(100, 7);
            let inner = with_scratch(|inner| {
                inner.resize(10, 1);
                inner.len()
            });
            assert_eq!(outer, &vec![7; 100], "the outer call's buffer is untouched");
            inner
        });
        assert_eq!(inner_len, 10);
        with_scratch(|kept| assert!(kept.capacity() >= 100, "the larger buffer is kept"));
    }

    #[test]
    #[should_panic(expected = "gemm A bounds")]
    fn rows_outside_a_are_refused() {
        let packed = PairPanels::pack(&[bf16::ONE; 4], 1, 2, 2);
        let mut c = vec![0f32; 4];
        let seg = [Segment { expert: 0, row_start: 0, rows: 2 }];
        dot_grouped_gemm(&[1.0; 2], Rows::indexed(2, &[0, 1]), &seg, &packed, &mut c, Rows::strided(2));
    }
}
