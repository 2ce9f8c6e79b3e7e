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

/// One expert's rows: `rows` consecutive rows of `A` and `C` starting at `row_start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the matrix in the packed stack.
    pub expert: usize,
    /// First row.
    pub row_start: usize,
    /// Row count.
    pub rows: usize,
}

/// A raw output pointer shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks built by `grouped_gemm` write disjoint (row range, column range) tiles of C,
// and the pointer outlives the parallel scope that uses it.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two tasks touch the same element.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `C[r, n] = Σ_k A[r, k] · W_e[n, k]` for the rows of every segment.
///
/// `a` is `[rows, lda]` with `K = w.k` used columns; `c` is `[rows, ldc]` with `w.n` written
/// columns. Segments must lie inside both buffers and not overlap.
pub fn grouped_gemm<T: PanelElem>(
    a: &[f32],
    lda: usize,
    segments: &[Segment],
    w: &PackedMatrices<T>,
    c: &mut [f32],
    ldc: usize,
) {
    let (n, k) = (w.n, w.k);
    assert!(lda >= k && ldc >= n, "gemm strides");
    for s in segments {
        assert!(s.expert < w.count, "gemm expert index");
        let end = s.row_start + s.rows;
        assert!(s.rows == 0 || (end - 1) * lda + k <= a.len(), "gemm A bounds");
        assert!(s.rows == 0 || (end - 1) * ldc + n <= c.len(), "gemm C bounds");
    }
    let groups = w.panels().div_ceil(PANELS_PER_TASK);
    let tasks: Vec<(usize, usize)> = segments
        .iter()
        .enumerate()
        .filter(|(_, s)| s.rows > 0)
        .flat_map(|(i, _)| (0..groups).map(move |g| (i, g)))
        .collect();
    let out = OutPtr(c.as_mut_ptr());
    let run = |&(si, g): &(usize, usize)| {
        let s = segments[si];
        let p0 = g * PANELS_PER_TASK;
        let p1 = (p0 + PANELS_PER_TASK).min(w.panels());
        // SAFETY: this task writes only rows `s.row_start..+s.rows` and columns of panels
        // `p0..p1` of C; tasks differ in segment (disjoint rows) or panel group.
        unsafe { segment_tile(a, lda, s, w, p0..p1, out.get(), ldc) };
    };
    if tasks.len() > 1 {
        tasks.par_iter().for_each(run);
    } else {
        tasks.iter().for_each(run);
    }
}

/// Computes one segment's rows for panels `panels` of its expert.
///
/// # Safety
/// `c` must be valid for writes of rows `s.row_start..s.row_start + s.rows` (stride `ldc`)
/// in the columns covered by `panels`, and no other thread may touch them meanwhile.
unsafe fn segment_tile<T: PanelElem>(
    a: &[f32],
    lda: usize,
    s: Segment,
    w: &PackedMatrices<T>,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
) {
    let k = w.k;
    if k == 0 {
        for r in 0..s.rows {
            for p in panels.clone() {
                for j in p * NR..((p + 1) * NR).min(w.n) {
                    *c.add((s.row_start + r) * ldc + j) = 0.0;
                }
            }
        }
        return;
    }
    let use_avx2 = avx2_available();
    // Rows split into near-equal blocks of at most MR, so no block is starved of independent
    // accumulators.
    let blocks = s.rows.div_ceil(MR);
    let mut k0 = 0;
    while k0 < k {
        let kc = KC.min(k - k0);
        for p in panels.clone() {
            let panel = w.panel(s.expert, p);
            // Every row block reuses this panel's k block from L1. Meanwhile the block read
            // next (the next panel's, the first panel's of the next k block, or at the end
            // the first block of the panel after this task's, which the task after it in
            // order reads) comes in from memory, a share per row block, so memory traffic is
            // spread over the whole computation instead of stalling the first row block.
            let next = if p + 1 < panels.end {
                Some((w.panel(s.expert, p + 1).as_ptr().add(k0 * NR), kc))
            } else if k0 + kc < k {
                Some((w.panel(s.expert, panels.start).as_ptr().add((k0 + kc) * NR), KC.min(k - k0 - kc)))
            } else if panels.end < w.panels() {
                Some((w.panel(s.expert, panels.end).as_ptr(), KC.min(k)))
            } else {
                None
            };
            let mut r = 0;
            for blk in 0..blocks {
                let mr = s.rows / blocks + usize::from(blk < s.rows % blocks);
                let row = s.row_start + r;
                let prefetch = match next {
                    Some((ptr, steps)) => {
                        let bytes = steps * NR * std::mem::size_of::<T>();
                        let (lo, hi) = (bytes * blk / blocks, bytes * (blk + 1) / blocks);
                        ((ptr as *const u8).add(lo), hi - lo)
                    }
                    None => (std::ptr::null(), 0),
                };
                let tile = Tile {
                    a: a.as_ptr().add(row * lda + k0),
                    lda,
                    b: panel.as_ptr().add(k0 * NR),
                    kc,
                    c: c.add(row * ldc + p * NR),
                    ldc,
                    cols: NR.min(w.n - p * NR),
                    accumulate: k0 > 0,
                    prefetch,
                };
                dispatch_kernel(use_avx2, mr, tile);
                r += mr;
            }
        }
        k0 += kc;
    }
}

/// Operands of one micro-kernel call: `mr` rows × `cols` (≤ NR) columns over `kc` steps.
struct Tile<T> {
    a: *const f32,
    lda: usize,
    b: *const T,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    accumulate: bool,
    /// A block to pull into cache while computing: (start, bytes).
    prefetch: (*const u8, usize),
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
unsafe fn dispatch_kernel<T: PanelElem>(use_avx2: bool, mr: usize, t: Tile<T>) {
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
unsafe fn portable_kernel<T: PanelElem>(mr: usize, t: &Tile<T>) {
    for r in 0..mr {
        for j in 0..t.cols {
            let cp = t.c.add(r * t.ldc + j);
            let mut acc = if t.accumulate { *cp } else { 0.0 };
            for kk in 0..t.kc {
                let av = *t.a.add(r * t.lda + kk);
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
    pub(super) unsafe fn kernel<T: PanelElem, const M: usize>(t: &Tile<T>) {
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        if t.accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                let src = t.c.add(r * t.ldc);
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
        let mut rows = [t.a; M];
        for (r, p) in rows.iter_mut().enumerate() {
            *p = t.a.add(r * t.lda);
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
        for (r, row) in acc.iter().enumerate() {
            let dst = t.c.add(r * t.ldc);
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
            grouped_gemm(&a, k, &seg, &packed, &mut c, n);
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
        // K over two cache blocks; segments of one row block and of several.
        let (e, n, k, m) = (3, 40, KC + 44, 24);
        let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let w: Vec<bf16> = (0..e * n * k).map(|_| bf16::from_f32(rng.gen_range(-1.0..1.0))).collect();
        let packed = PackedMatrices::pack(&w, e, n, k);
        let segs = [
            Segment { expert: 2, row_start: 0, rows: 4 },
            Segment { expert: 0, row_start: 4, rows: 0 },
            Segment { expert: 1, row_start: 4, rows: 7 },
            Segment { expert: 2, row_start: 11, rows: 13 },
        ];
        let mut c = vec![f32::NAN; m * n];
        grouped_gemm(&a, k, &segs, &packed, &mut c, n);
        for s in segs {
            let wf: Vec<f32> = w[s.expert * n * k..(s.expert + 1) * n * k].iter().map(|x| x.to_f32()).collect();
            let want = naive(&a[s.row_start * k..(s.row_start + s.rows) * k], &wf, s.rows, n, k);
            assert_eq!(&c[s.row_start * n..(s.row_start + s.rows) * n], &want[..]);
        }
    }
}
