//! Weights re-laid out once, at load time, into the panel order the CPU GEMM reads.
//!
//! A weight matrix `W [N, K]` (row-major, as checkpoints store linear layers) becomes
//! `ceil(N / NR)` panels; panel `p` holds `W[p*NR + j, k]` at `k * NR + slot(j)` (`slot` is the
//! identity for f32, an interleave of the two halves for bf16), zero-padded past `N`.
//! Stacked per-expert matrices `[E, N, K]` are packed expert by expert.

use super::gemm::Rows;
use half::bf16;

/// Columns of one packed panel: two AVX2 vectors of f32.
pub const NR: usize = 16;

/// An element the packed GEMM can read: f32, or bf16 widened to f32 on load.
pub trait PanelElem: Copy + Send + Sync + bytemuck::Zeroable + 'static {
    /// Whether the element is bf16 (the kernel widens it with a shift).
    const IS_BF16: bool;
    /// Widen to f32 (exact for both element types).
    fn to_f32(self) -> f32;
    /// Where column `j` of a panel row sits among its `NR` elements. bf16 interleaves the two
    /// halves (columns `j` and `8 + j` share a 32-bit word), so one 32-byte load widens to two
    /// f32 vectors with one shift and one mask.
    #[inline(always)]
    fn slot(j: usize) -> usize {
        j
    }
}

impl PanelElem for f32 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl PanelElem for bf16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn slot(j: usize) -> usize {
        let half = NR / 2;
        if j < half {
            2 * j
        } else {
            2 * (j - half) + 1
        }
    }
}

/// `count` matrices of shape `[n, k]`, each packed into `NR`-wide panels.
#[derive(Clone, Debug)]
pub struct PackedMatrices<T> {
    /// Number of stacked matrices (experts).
    pub count: usize,
    /// Output columns of each matrix (rows of the checkpoint's weight).
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    data: Vec<T>,
}

impl Default for PackedMatrices<f32> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<T: PanelElem> PackedMatrices<T> {
    /// Packs `count` row-major matrices `[n, k]` stored back to back in `src`.
    pub fn pack(src: &[T], count: usize, n: usize, k: usize) -> Self {
        assert_eq!(src.len(), count * n * k, "packed source length");
        let panels = n.div_ceil(NR);
        let per = panels * NR * k;
        // Zeroed by the allocator (fresh pages), so the memory is first touched by the parallel
        // packing below rather than by one thread filling it.
        let mut data: Vec<T> = bytemuck::zeroed_vec(count * per);
        use rayon::prelude::*;
        data.par_chunks_mut(NR * k.max(1)).enumerate().for_each(|(idx, panel)| {
            if k == 0 {
                return;
            }
            let (e, p) = (idx / panels, idx % panels);
            let base = e * n * k;
            for j in 0..NR {
                let col = p * NR + j;
                if col >= n {
                    break;
                }
                let row = &src[base + col * k..base + (col + 1) * k];
                let slot = T::slot(j);
                for (kk, &v) in row.iter().enumerate() {
                    panel[kk * NR + slot] = v;
                }
            }
        });
        Self { count, n, k, data }
    }

    /// Number of panels per matrix.
    pub fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// Panel `p` of matrix `e`: `k * NR` elements.
    #[inline]
    pub fn panel(&self, e: usize, p: usize) -> &[T] {
        let len = NR * self.k;
        let start = (e * self.panels() + p) * len;
        &self.data[start..start + len]
    }

    /// Bytes held by the packed data.
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<T>()
    }
}

impl PackedMatrices<f32> {
    /// An empty buffer for [`PackedMatrices::refill`].
    pub fn empty() -> Self {
        PackedMatrices { count: 0, n: 0, k: 0, data: Vec::new() }
    }

    /// Becomes one matrix `[n, k]` whose row `r` is written by `row(r, out)`, packed in
    /// parallel, reusing the allocation.
    pub fn refill(&mut self, n: usize, k: usize, row: impl Fn(usize, &mut [f32]) + Sync) {
        use rayon::prelude::*;
        let panels = n.div_ceil(NR);
        (self.count, self.n, self.k) = (1, n, k);
        self.data.resize(panels * NR * k, 0.0);
        if k == 0 {
            return;
        }
        self.data.par_chunks_mut(NR * k).enumerate().for_each(|(p, panel)| {
            let mut tmp = vec![0f32; k];
            for j in 0..NR {
                let col = p * NR + j;
                if col < n {
                    row(col, &mut tmp);
                } else {
                    tmp.fill(0.0);
                }
                for (kk, &v) in tmp.iter().enumerate() {
                    panel[kk * NR + j] = v;
                }
            }
        });
    }
}

/// Packed stacked weights in the element type they were given in.
#[derive(Clone, Debug)]
pub enum PackedStack {
    /// f32 weights.
    F32(PackedMatrices<f32>),
    /// bf16 weights, widened in the kernel.
    BF16(PackedMatrices<bf16>),
    /// bf16 weights multiplied with bf16-rounded activations (see [`super::dot`]).
    Bf16Dot(super::dot::PairPanels),
    /// Quantized weights kept as codes and scales; each expert is dequantized into packed f32
    /// panels just before its GEMM, so only one expert at a time exists in f32.
    Quantized {
        /// Storage format.
        format: crate::quant::WeightQuant,
        /// Stacked matrices.
        count: usize,
        /// Rows of each matrix.
        n: usize,
        /// Columns of each matrix.
        k: usize,
        /// `[count, n, k]` codes.
        codes: Vec<u8>,
        /// Scales, `format.scales_len(n, k)` per matrix.
        scales: Vec<f32>,
        /// Reused f32 panels of the expert being computed.
        scratch: std::sync::Arc<std::sync::Mutex<PackedMatrices<f32>>>,
    },
}

impl PackedStack {
    /// Keeps quantized codes and scales of `count` matrices `[n, k]`.
    pub fn quantized(
        format: crate::quant::WeightQuant,
        codes: Vec<u8>,
        scales: Vec<f32>,
        count: usize,
        n: usize,
        k: usize,
    ) -> Self {
        PackedStack::Quantized { format, count, n, k, codes, scales, scratch: Default::default() }
    }

    /// Packs a `[count, n, k]` tensor: bf16 stays bf16 (for the kernel `bf16` picks), every
    /// other float type becomes f32.
    pub fn from_tensor(t: &crate::Tensor, count: usize, n: usize, k: usize, bf16: super::dot::Bf16Matmul) -> Self {
        match t.cpu() {
            crate::tensor::CpuStorage::BF16(v) if bf16.uses_dot() => {
                PackedStack::Bf16Dot(super::dot::PairPanels::pack(v, count, n, k))
            }
            crate::tensor::CpuStorage::BF16(v) => PackedStack::BF16(PackedMatrices::pack(v, count, n, k)),
            _ => PackedStack::F32(PackedMatrices::pack(&t.to_f32_vec(), count, n, k)),
        }
    }

    /// `C[rows_s] = A[rows_s] · W[e_s]^T` for every segment (see [`super::gemm::grouped_gemm`]).
    pub fn gemm(&self, a: &[f32], a_rows: Rows, segments: &[super::gemm::Segment], c: &mut [f32], c_rows: Rows) {
        match self {
            PackedStack::F32(w) => super::gemm::grouped_gemm(a, a_rows, segments, w, c, c_rows),
            PackedStack::BF16(w) => super::gemm::grouped_gemm(a, a_rows, segments, w, c, c_rows),
            PackedStack::Bf16Dot(w) => super::dot::dot_grouped_gemm(a, a_rows, segments, w, c, c_rows),
            PackedStack::Quantized { format, n, k, codes, scales, scratch, .. } => {
                let mut packed = scratch.lock().unwrap_or_else(|p| p.into_inner());
                for s in segments.iter().filter(|s| s.rows > 0) {
                    let d = crate::quant::Dequantizer::new(*format, codes, scales, s.expert, *n, *k);
                    packed.refill(*n, *k, |r, out| d.row(r, out));
                    let one = [super::gemm::Segment { expert: 0, ..*s }];
                    super::gemm::grouped_gemm(a, a_rows, &one, &packed, c, c_rows);
                }
            }
        }
    }

    /// Bytes of packed weights.
    pub fn bytes(&self) -> usize {
        match self {
            PackedStack::F32(w) => w.bytes(),
            PackedStack::BF16(w) => w.bytes(),
            PackedStack::Bf16Dot(w) => w.bytes(),
            PackedStack::Quantized { codes, scales, .. } => codes.len() + 4 * scales.len(),
        }
    }
}
