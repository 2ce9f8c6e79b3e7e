//! The grouped GEMM of the CPU experts: for every row segment `s` (rows of one expert),
//! `C[rows_s, :] = A[rows_s, :] · W[e_s]^T`, with `W` packed in panels (see `packed`).
//!
//! Every output element is accumulated with fused multiply-adds in increasing `k` order,
//! whatever the number of rows, the segment or the thread that computes it. A row's result
//! therefore depends only on that row and the weights: batching, chunking and expert
//! parallelism cannot change a bit of it. The AVX2 kernel and the portable one agree exactly.

use super::packed::{PackedMatrices, PanelElem, NR};
use rayon::prelude::*;

/// Rows computed together by one micro-kernel call.
const MR: usize = 6;
/// Reduction block: one panel block (`KC * NR` f32 = 16 KiB) stays in L1 across row blocks.
const KC: usize = 256;
/// Panels handled by one parallel task.
const PANELS_PER_TASK: usize = 4;
/// GEMM rows handled by one parallel task at most: their `KC`-deep slice of A (256 KiB of f32)
/// stays in L2 while the task's panels pass over it (docs/tuning.md).
const ROWS_PER_TASK: usize = 256;

/// One expert's rows: GEMM rows `row_start..row_start + rows`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the matrix in the packed stack.
    pub expert: usize,
    /// First row.
    pub row_start: usize,
    /// Row count.
    pub rows: usize,
}

/// Where the GEMM's rows of one operand lie in its buffer: row `j` at `stride · j`, or at
/// `stride · index[j]` with an index list (a gather for `A`, a scatter for `C`, so rows grouped
/// by expert need not be copied into that order).
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    /// Elements from one buffer row to the next.
    pub stride: usize,
    /// Buffer row of each GEMM row, if not the identity.
    pub index: Option<&'a [u32]>,
}

impl<'a> Rows<'a> {
    /// GEMM row `j` is buffer row `j`.
    pub fn strided(stride: usize) -> Self {
        Rows { stride, index: None }
    }

    /// GEMM row `j` is buffer row `index[j]`.
    pub fn indexed(stride: usize, index: &'a [u32]) -> Self {
        Rows { stride, index: Some(index) }
    }

    /// Buffer row of GEMM row `j`.
    #[inline]
    pub fn of(&self, j: usize) -> usize {
        self.index.map_or(j, |ix| ix[j] as usize)
    }

    /// Checks that GEMM rows `range` lie in a buffer of `len` elements, `width` used per row.
    pub(super) fn check(&self, range: std::ops::Range<usize>, width: usize, len: usize, what: &str) {
        if let Some(ix) = self.index {
            assert!(range.end <= ix.len(), "gemm {what} index length");
        }
        for j in range {
            assert!(self.of(j) * self.stride + width <= len, "gemm {what} bounds");
        }
    }
}

/// A raw output pointer shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks built by `run_segments` write disjoint (row, column range) tiles of C (every
// GEMM row maps to its own buffer row, checked there), and the pointer outlives the parallel
// scope that uses it.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two tasks touch the same element.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `C[r, n] = Σ_k A[r, k] · W_e[n, k]` for the rows `r` of every segment, `A`'s and `C`'s rows
/// found through `a_rows` and `c_rows`.
///
/// `A` rows have `K = w.k` used columns, `C` rows `w.n` written columns. Every row must lie
/// inside its buffer, and no two GEMM rows may write the same `C` row (both checked; a
/// violation panics, as slice indexing does).
pub fn grouped_gemm<T: PanelElem>(
    a: &[f32],
    a_rows: Rows,
    segments: &[Segment],
    w: &PackedMatrices<T>,
    c: &mut [f32],
    c_rows: Rows,
) {
    assert!(a_rows.stride >= w.k, "gemm strides");
    for s in segments {
        a_rows.check(s.row_start..s.row_start + s.rows, w.k, a.len(), "A");
    }
    // SAFETY: every GEMM row's `k` elements lie in `a` (checked above), as the kernels read them.
    unsafe { run_segments(a, a_rows, segments, w, c, c_rows) }
}

/// Packed weights and the micro-kernel that reads them: what the blocking loops of
/// [`run_segments`] need to know.
pub(super) trait PanelKernel: Sync {
    /// Element of A the kernel reads: an f32, or a pair of bf16 reduction steps in a `u32`.
    type A: Copy + Sync;
    /// Element of a packed panel (`NR` of them per reduction step).
    type B: Copy;
    /// Reduction steps per cache block: one block of a panel stays in L1 across row blocks.
    const KC: usize;
    /// Rows per micro-kernel call at most.
    const MR: usize;
    /// Matrices, columns, reduction steps (in elements of A) and panels.
    fn shape(&self) -> GemmShape;
    /// Panel `p` of matrix `e`: `NR` elements per reduction step.
    fn panel(&self, e: usize, p: usize) -> &[Self::B];
    /// One micro-kernel call over `mr ≤ MR` rows.
    ///
    /// # Safety
    /// The tile's pointers must be valid for `mr` rows as described on [`Tile`].
    unsafe fn kernel(mr: usize, t: Tile<Self::A, Self::B>);
}

impl<T: PanelElem> PanelKernel for PackedMatrices<T> {
    type A = f32;
    type B = T;
    const KC: usize = KC;
    const MR: usize = MR;
    fn shape(&self) -> GemmShape {
        GemmShape { experts: self.count, n: self.n, k: self.k, panels: self.panels() }
    }
    fn panel(&self, e: usize, p: usize) -> &[T] {
        PackedMatrices::panel(self, e, p)
    }
    unsafe fn kernel(mr: usize, t: Tile<f32, T>) {
        dispatch_kernel(avx2_available(), mr, t)
    }
}

/// The grouped GEMM over any packed weights: checks C and the segments, then computes every
/// non-empty segment's rows, one parallel task per group of `PANELS_PER_TASK` panels and
/// `ROWS_PER_TASK` rows (tasks write disjoint (row, panel) tiles of C).
///
/// Panics (as slice indexing does) when an expert index is out of range, a C row lies outside
/// its buffer, or two GEMM rows write the same C row.
///
/// # Safety
/// Every GEMM row of the segments must be readable in `a` through `a_rows` the way `P::kernel`
/// reads it (for f32 A, `k` elements from `a_rows.of(j) · stride`; see
/// [`PanelKernel::kernel`]). The callers check or construct this.
pub(super) unsafe fn run_segments<P: PanelKernel>(
    a: &[P::A],
    a_rows: Rows,
    segments: &[Segment],
    w: &P,
    c: &mut [f32],
    c_rows: Rows,
) {
    let GemmShape { experts, n, panels, .. } = w.shape();
    assert!(c_rows.stride >= n, "gemm strides");
    let mut written = vec![false; if n == 0 { 0 } else { c.len() / c_rows.stride.max(1) + 1 }];
    for s in segments {
        assert!(s.expert < experts, "gemm expert index");
        let rows = s.row_start..s.row_start + s.rows;
        c_rows.check(rows.clone(), n, c.len(), "C");
        if n > 0 {
            for j in rows {
                assert!(!std::mem::replace(&mut written[c_rows.of(j)], true), "gemm C rows written twice");
            }
        }
    }
    let groups = panels.div_ceil(PANELS_PER_TASK);
    // Tasks in (segment, panel group, rows) order: the tasks a thread takes in turn share the
    // group's panels, which stay in L2.
    let tasks: Vec<(Segment, usize)> = segments
        .iter()
        .filter(|s| s.rows > 0)
        .flat_map(|&s| {
            (0..groups).flat_map(move |g| {
                (0..s.rows.div_ceil(ROWS_PER_TASK)).map(move |b| {
                    let first = b * ROWS_PER_TASK;
                    let rows = ROWS_PER_TASK.min(s.rows - first);
                    (Segment { row_start: s.row_start + first, rows, ..s }, g)
                })
            })
        })
        .collect();
    let out = OutPtr(c.as_mut_ptr());
    let run = |&(s, g): &(Segment, usize)| {
        let p0 = g * PANELS_PER_TASK;
        // SAFETY: this task writes only the C rows of its GEMM rows (each its own buffer row,
        // checked above) in the columns of its panels; tasks differ in rows (disjoint) or panel
        // group. A is readable as the caller vouches.
        unsafe { segment_tile(a, a_rows, s, w, p0..(p0 + PANELS_PER_TASK).min(panels), out.get(), c_rows) };
    };
    if tasks.len() > 1 {
        tasks.par_iter().for_each(run);
    } else {
        tasks.iter().for_each(run);
    }
}

/// The dimensions of a stack of packed weight matrices.
#[derive(Clone, Copy, Debug)]
pub(super) struct GemmShape {
    /// Matrices in the stack.
    pub experts: usize,
    /// Output columns.
    pub n: usize,
    /// Reduction steps (elements of A per row).
    pub k: usize,
    /// Panels of `NR` columns per matrix.
    pub panels: usize,
}

/// Rows split into near-equal blocks of at most `mr`, so no block is starved of independent
/// accumulators: `(blocks, base, extra)`, the first `extra` blocks having `base + 1` rows and
/// the others `base`.
pub(super) fn row_blocks(rows: usize, mr: usize) -> (usize, usize, usize) {
    let blocks = rows.div_ceil(mr);
    (blocks, rows / blocks.max(1), rows % blocks.max(1))
}

/// Computes one segment's rows for panels `panels` of its expert.
///
/// # Safety
/// `c` must be valid for writes of the C rows of the segment's GEMM rows (through `c_rows`)
/// in the columns covered by `panels`, and no other thread may touch them meanwhile.
unsafe fn segment_tile<P: PanelKernel>(
    a: &[P::A],
    a_rows: Rows,
    s: Segment,
    w: &P,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    c_rows: Rows,
) {
    let GemmShape { n, k, panels: all_panels, .. } = w.shape();
    if k == 0 {
        for r in 0..s.rows {
            let row = c.add(c_rows.of(s.row_start + r) * c_rows.stride);
            for p in panels.clone() {
                for j in p * NR..((p + 1) * NR).min(n) {
                    *row.add(j) = 0.0;
                }
            }
        }
        return;
    }
    // Each row's start in A and in C, found once.
    let a_row: Vec<*const P::A> =
        (0..s.rows).map(|r| a.as_ptr().add(a_rows.of(s.row_start + r) * a_rows.stride)).collect();
    let c_row: Vec<*mut f32> = (0..s.rows).map(|r| c.add(c_rows.of(s.row_start + r) * c_rows.stride)).collect();
    let (blocks, base, extra) = row_blocks(s.rows, P::MR);
    // The (k block, panel) steps of this task, in the order they run. With several row blocks,
    // k blocks outer: every panel's block reuses the rows' k slice from L1. With one row block
    // (decode-sized batches, where streaming the weights is all the time there is), panels
    // outer: each panel is read start to end, one sequential stream for the prefetchers.
    let k_blocks = k.div_ceil(P::KC);
    let n_panels = panels.len();
    let step = |i: usize| -> (usize, usize) {
        let (kb, p) = if blocks > 1 { (i / n_panels, i % n_panels) } else { (i % k_blocks, i / k_blocks) };
        (kb * P::KC, panels.start + p)
    };
    let steps = k_blocks * n_panels;
    for i in 0..steps {
        let (k0, p) = step(i);
        let kc = P::KC.min(k - k0);
        let panel = w.panel(s.expert, p);
        // Every row block reuses this panel's k block from L1. Meanwhile the block read next
        // (the next step's, or at the end the first block of the panel after this task's,
        // which the task after it in order reads) comes in from memory, a share per row block,
        // so memory traffic is spread over the whole computation instead of stalling the
        // first row block.
        let next = if i + 1 < steps {
            let (k1, p1) = step(i + 1);
            Some((w.panel(s.expert, p1).as_ptr().add(k1 * NR), P::KC.min(k - k1)))
        } else if panels.end < all_panels {
            Some((w.panel(s.expert, panels.end).as_ptr(), P::KC.min(k)))
        } else {
            None
        };
        let (next_ptr, next_bytes) =
            next.map_or((std::ptr::null(), 0), |(ptr, kc_next)| (ptr as *const u8, kc_next * NR * size_of::<P::B>()));
        let share = next_bytes.div_ceil(blocks);
        let mut r = 0;
        for blk in 0..blocks {
            let mr = base + usize::from(blk < extra);
            let lo = (blk * share).min(next_bytes);
            let tile = Tile {
                a: a_row.as_ptr().add(r),
                a_col: k0,
                b: panel.as_ptr().add(k0 * NR),
                kc,
                c: c_row.as_ptr().add(r),
                c_col: p * NR,
                cols: NR.min(n - p * NR),
                accumulate: k0 > 0,
                prefetch: (next_ptr.wrapping_add(lo), (lo + share).min(next_bytes) - lo),
            };
            P::kernel(mr, tile);
            r += mr;
        }
    }
}

/// Operands of one micro-kernel call: `mr` rows × `cols` (≤ NR) columns over `kc` reduction
/// steps (elements of `A`).
pub(super) struct Tile<A, B> {
    /// The `mr` rows' starts in `A` (the dot-product kernel reads its whole row block,
    /// interleaved, from the first; see `dot`).
    pub a: *const *const A,
    /// The reduction step the tile starts at.
    pub a_col: usize,
    /// The panel's block: `NR` elements per step.
    pub b: *const B,
    /// Reduction steps.
    pub kc: usize,
    /// The `mr` rows' starts in `C`.
    pub c: *const *mut f32,
    /// The tile's first column in C.
    pub c_col: usize,
    /// Columns written (`NR`, fewer in the last panel).
    pub cols: usize,
    /// Add to C instead of overwriting it (every cache block but the first).
    pub accumulate: bool,
    /// A block to pull into cache while computing: (start, bytes).
    pub prefetch: (*const u8, usize),
}

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// # Safety
/// The tile's pointers must be valid for `mr` rows as described on [`Tile`].
#[inline]
unsafe fn dispatch_kernel<T: PanelElem>(use_avx2: bool, mr: usize, t: Tile<f32, T>) {
    #[cfg(target_arch = "x86_64")]
    if use_avx2 {
        match mr {
            1 => return avx2::kernel::<T, 1>(&t),
            2 => return avx2::kernel::<T, 2>(&t),
            3 => return avx2::kernel::<T, 3>(&t),
            4 => return avx2::kernel::<T, 4>(&t),
            5 => return avx2::kernel::<T, 5>(&t),
            _ => return avx2::kernel::<T, 6>(&t),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = use_avx2; // only the x86-64 build has an AVX2 kernel to choose
    portable_kernel(mr, &t)
}

/// The reference micro-kernel: the same fused multiply-adds in the same order as AVX2.
///
/// # Safety
/// As [`dispatch_kernel`].
unsafe fn portable_kernel<T: PanelElem>(mr: usize, t: &Tile<f32, T>) {
    for r in 0..mr {
        for j in 0..t.cols {
            let cp = (*t.c.add(r)).add(t.c_col + j);
            let mut acc = if t.accumulate { *cp } else { 0.0 };
            for kk in 0..t.kc {
                let av = *(*t.a.add(r)).add(t.a_col + kk);
                let bv = (*t.b.add(kk * NR + T::slot(j))).to_f32();
                acc = av.mul_add(bv, acc);
            }
            *cp = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{PanelElem, Tile, NR};
    use std::arch::x86_64::*;

    /// Loads one panel row (16 columns) as two f32 vectors: columns 0–7 and 8–15. A bf16 row
    /// is one 32-byte load; its interleaved halves widen with a shift and a mask.
    #[inline(always)]
    unsafe fn load16<T: PanelElem>(p: *const T) -> (__m256, __m256) {
        if T::IS_BF16 {
            let v = _mm256_loadu_si256(p as *const __m256i);
            let low = _mm256_slli_epi32(v, 16);
            let high = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000_u32 as i32));
            (_mm256_castsi256_ps(low), _mm256_castsi256_ps(high))
        } else {
            (_mm256_loadu_ps(p as *const f32), _mm256_loadu_ps((p as *const f32).add(8)))
        }
    }

    /// `M` rows × 16 columns, 2·M accumulators in registers.
    ///
    /// # Safety
    /// Requires AVX2 and FMA (checked by the caller) and valid tile pointers.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kernel<T: PanelElem, const M: usize>(t: &Tile<f32, T>) {
        let rows: [*const f32; M] = std::array::from_fn(|r| (*t.a.add(r)).add(t.a_col));
        let out: [*mut f32; M] = std::array::from_fn(|r| (*t.c.add(r)).add(t.c_col));
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        if t.accumulate {
            for (row, &src) in acc.iter_mut().zip(&out) {
                if t.cols == NR {
                    row[0] = _mm256_loadu_ps(src);
                    row[1] = _mm256_loadu_ps(src.add(8));
                } else {
                    let mut buf = [0f32; NR];
                    std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), t.cols);
                    row[0] = _mm256_loadu_ps(buf.as_ptr());
                    row[1] = _mm256_loadu_ps(buf.as_ptr().add(8));
                }
            }
        }
        let mut b = t.b;
        let step = |acc: &mut [[__m256; 2]; M], b: *const T, kk: usize| {
            let (b0, b1) = load16(b);
            for (row, p) in acc.iter_mut().zip(rows.iter()) {
                let av = _mm256_broadcast_ss(&*p.add(kk));
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
        };
        // The prefetch block's cache lines, spread evenly over the loop's four-step rounds.
        let (pf, pf_len) = t.prefetch;
        let per_round = pf_len.div_ceil((t.kc / 4).max(1));
        let (mut pf_due, mut pf_sent) = (0, 0);
        let mut kk = 0;
        while kk + 4 <= t.kc {
            pf_due = (pf_due + per_round).min(pf_len);
            while pf_sent < pf_due {
                _mm_prefetch(pf.add(pf_sent) as *const i8, _MM_HINT_T0);
                pf_sent += 64;
            }
            step(&mut acc, b, kk);
            step(&mut acc, b.add(NR), kk + 1);
            step(&mut acc, b.add(2 * NR), kk + 2);
            step(&mut acc, b.add(3 * NR), kk + 3);
            b = b.add(4 * NR);
            kk += 4;
        }
        while kk < t.kc {
            step(&mut acc, b, kk);
            b = b.add(NR);
            kk += 1;
        }
        for (row, &dst) in acc.iter().zip(&out) {
            if t.cols == NR {
                _mm256_storeu_ps(dst, row[0]);
                _mm256_storeu_ps(dst.add(8), row[1]);
            } else {
                let mut buf = [0f32; NR];
                _mm256_storeu_ps(buf.as_mut_ptr(), row[0]);
                _mm256_storeu_ps(buf.as_mut_ptr().add(8), row[1]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), dst, t.cols);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};

    fn naive(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for kk in 0..k {
                    acc = a[i * k + kk].mul_add(w[j * k + kk], acc);
                }
                c[i * n + j] = acc;
            }
        }
        c
    }

    #[test]
    fn matches_sequential_fma_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(m, n, k) in &[(1, 1, 1), (7, 17, 3), (13, 33, 300), (6, 16, 256), (2, 5, 0), (20, 130, 531)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let packed = PackedMatrices::pack(&w, 1, n, k);
            let mut c = vec![f32::NAN; m * n];
            let seg = [Segment { expert: 0, row_start: 0, rows: m }];
            grouped_gemm(&a, Rows::strided(k), &seg, &packed, &mut c, Rows::strided(n));
            let want = naive(&a, &w, m, n, k);
            assert_eq!(
                c.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "m {m} n {n} k {k}"
            );
        }
    }

    #[test]
    fn bf16_weights_and_segments() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        // K over two cache blocks; segments of one row block, of several, and of several
        // parallel tasks' rows (a partial one last).
        let long = 2 * ROWS_PER_TASK + 5;
        let (e, n, k, m) = (3, 40, KC + 44, 24 + long);
        let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let w: Vec<bf16> = (0..e * n * k).map(|_| bf16::from_f32(rng.gen_range(-1.0..1.0))).collect();
        let packed = PackedMatrices::pack(&w, e, n, k);
        let segs = [
            Segment { expert: 2, row_start: 0, rows: 4 },
            Segment { expert: 0, row_start: 4, rows: 0 },
            Segment { expert: 1, row_start: 4, rows: 7 },
            Segment { expert: 2, row_start: 11, rows: 13 },
            Segment { expert: 0, row_start: 24, rows: long },
        ];
        let mut c = vec![f32::NAN; m * n];
        grouped_gemm(&a, Rows::strided(k), &segs, &packed, &mut c, Rows::strided(n));
        for s in segs {
            let wf: Vec<f32> = w[s.expert * n * k..(s.expert + 1) * n * k].iter().map(|x| x.to_f32()).collect();
            let want = naive(&a[s.row_start * k..(s.row_start + s.rows) * k], &wf, s.rows, n, k);
            assert_eq!(&c[s.row_start * n..(s.row_start + s.rows) * n], &want[..]);
        }
    }

    #[test]
    fn indexed_rows_gather_and_scatter_like_copies() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (e, n, k, tokens) = (2, 37, 70, 9);
        let a: Vec<f32> = (0..tokens * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let w: Vec<bf16> = (0..e * n * k).map(|_| bf16::from_f32(rng.gen_range(-1.0..1.0))).collect();
        let packed = PackedMatrices::pack(&w, e, n, k);
        // GEMM rows read tokens (some twice) and write to scattered rows of a wider buffer.
        let token_of_row: [u32; 8] = [3, 0, 3, 8, 1, 5, 5, 2];
        let out_row: [u32; 8] = [10, 2, 0, 7, 11, 4, 1, 9];
        let segs = [Segment { expert: 1, row_start: 0, rows: 3 }, Segment { expert: 0, row_start: 3, rows: 5 }];
        let ldc = n + 3;
        let mut c = vec![f32::NAN; 12 * ldc];
        grouped_gemm(&a, Rows::indexed(k, &token_of_row), &segs, &packed, &mut c, Rows::indexed(ldc, &out_row));
        // The same through copies: gather, contiguous GEMM, scatter.
        let gathered: Vec<f32> =
            token_of_row.iter().flat_map(|&t| a[t as usize * k..(t as usize + 1) * k].to_vec()).collect();
        let mut dense = vec![0f32; 8 * n];
        grouped_gemm(&gathered, Rows::strided(k), &segs, &packed, &mut dense, Rows::strided(n));
        for (j, &r) in out_row.iter().enumerate() {
            let got = &c[r as usize * ldc..r as usize * ldc + n];
            assert_eq!(got, &dense[j * n..(j + 1) * n], "GEMM row {j}");
            assert!(c[r as usize * ldc + n..(r as usize + 1) * ldc].iter().all(|x| x.is_nan()), "past n");
        }
        for r in [3, 5, 6, 8] {
            assert!(c[r * ldc..(r + 1) * ldc].iter().all(|x| x.is_nan()), "row {r} is not an output row");
        }
    }

    #[test]
    fn rows_written_twice_or_out_of_bounds_are_refused() {
        let packed = PackedMatrices::pack(&[1.0f32; 4 * 3], 1, 4, 3);
        let a = vec![1f32; 2 * 3];
        let seg = [Segment { expert: 0, row_start: 0, rows: 2 }];
        let run = |a_ix: &'static [u32], c_ix: &'static [u32], c_len: usize| {
            let a = a.clone();
            let packed = packed.clone();
            std::panic::catch_unwind(move || {
                let mut c = vec![0f32; c_len];
                grouped_gemm(&a, Rows::indexed(3, a_ix), &seg, &packed, &mut c, Rows::indexed(4, c_ix));
            })
            .map_err(|e| {
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            })
        };
        assert!(run(&[0, 1], &[1, 0], 8).is_ok());
        assert!(run(&[0, 1], &[1, 1], 8).unwrap_err().contains("written twice"));
        assert!(run(&[0, 2], &[0, 1], 8).unwrap_err().contains("A bounds"));
        assert!(run(&[0, 1], &[0, 2], 8).unwrap_err().contains("C bounds"));
        assert!(run(&[0], &[0, 1], 8).unwrap_err().contains("A index length"));
        // Overlapping segments write the same rows too.
        let twice = [Segment { expert: 0, row_start: 0, rows: 2 }, Segment { expert: 0, row_start: 1, rows: 1 }];
        let r = std::panic::catch_unwind(|| {
            let mut c = vec![0f32; 8];
            grouped_gemm(&a, Rows::strided(3), &twice, &packed, &mut c, Rows::strided(4));
        });
        assert!(r.is_err());
    }
}
