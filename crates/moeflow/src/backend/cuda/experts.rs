//! [`CudaExperts`]: the compute stage of the modular layer on one GPU, so that every strategy
//! of `dispatch/` runs its experts there (one GPU per rank). Rows arrive in host memory from
//! the strategy, are grouped by local expert and uploaded in bf16, run through per-expert bf16
//! GEMMs with f32 accumulation around the activation kernel, and come back as unweighted slot
//! rows (`-0.0` where the slot's expert lives elsewhere), exactly like the CPU experts.

use super::blas_handle::BlasHandle;
use super::layer::{act_and_mul, gemm_bf16};
use super::{err, Gpu};
use crate::error::{MoeError, Result};
use crate::experts::{Activation, ActivationFormat, BatchedInput, ExpertInput, ExpertWeights, Experts};
use crate::reduce::{WeightAndReduce, WeightedSum};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr};
use std::sync::Mutex;

/// Device buffers for up to `rows` rows.
struct Rows {
    rows: usize,
    a: CudaSlice<u16>,
    h13: CudaSlice<u16>,
    act: CudaSlice<u16>,
    y: CudaSlice<u16>,
    expert_of_row: CudaSlice<i32>,
}

/// Expert weights resident on one GPU (bf16), with their activation and biases.
pub struct CudaExperts {
    gpu: Gpu,
    blas: BlasHandle,
    act_kernel: CudaFunction,
    experts: usize,
    hidden: usize,
    inter: usize,
    activation: Activation,
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    b13: Option<CudaSlice<f32>>,
    b2: Option<Vec<f32>>,
    bufs: Mutex<Option<Rows>>,
}

/// One expert's rows: `(local expert, first row, rows)`.
type Segment = (usize, usize, usize);

impl CudaExperts {
    /// Uploads `weights` (quantized ones dequantized, then stored as bf16) to GPU `device`.
    pub fn new(weights: &ExpertWeights, activation: Activation, device: usize) -> Result<Self> {
        let (e, h, i) = weights.validate("cuda experts")?;
        let gpu = Gpu::new(device)?;
        gpu.ctx.bind_to_thread().map_err(|x| err("binding context", x))?;
        let s = &gpu.stream;
        let bf16 = |v: Vec<f32>| -> Vec<u16> { v.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect() };
        let w13 = s.clone_htod(&bf16(weights.w13_f32())).map_err(|x| err("upload", x))?;
        let w2 = s.clone_htod(&bf16(weights.w2_f32())).map_err(|x| err("upload", x))?;
        let b13 = match &weights.b13 {
            Some(b) => Some(s.clone_htod(&b.to_f32_vec()).map_err(|x| err("upload", x))?),
            None => None,
        };
        let blas = BlasHandle::new(s.clone())?;
        let act_kernel = gpu.function("act_and_mul")?;
        Ok(CudaExperts {
            blas,
            act_kernel,
            experts: e,
            hidden: h,
            inter: i,
            activation,
            w13,
            w2,
            b13,
            b2: weights.b2.as_ref().map(|b| b.to_f32_vec()),
            bufs: Mutex::new(None),
            gpu,
        })
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.gpu.stream).0
    }

    /// Runs `a [rows, H]` (bf16 bits, grouped as `segments` say) through the experts and
    /// returns `y [rows, H]` (bf16 bits); rows outside every segment are left undefined.
    fn run(&self, a: &[u16], rows: usize, segments: &[Segment], expert_of_row: &[i32]) -> Result<Vec<u16>> {
        let (h, i) = (self.hidden, self.inter);
        self.gpu.ctx.bind_to_thread().map_err(|x| err("binding context", x))?;
        let s = &self.gpu.stream;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        if guard.as_ref().is_none_or(|b| b.rows < rows) {
            let n = rows.max(1).next_power_of_two();
            let alloc = |len: usize| s.alloc_zeros::<u16>(len).map_err(|x| err("alloc", x));
            *guard = Some(Rows {
                rows: n,
                a: alloc(n * h)?,
                h13: alloc(n * 2 * i)?,
                act: alloc(n * i)?,
                y: alloc(n * h)?,
                expert_of_row: s.alloc_zeros::<i32>(n).map_err(|x| err("alloc", x))?,
            });
        }
        let b = guard.as_mut().expect("allocated");
        if rows == 0 {
            return Ok(Vec::new());
        }
        s.memcpy_htod(a, &mut b.a.slice_mut(0..rows * h)).map_err(|x| err("upload rows", x))?;
        s.memcpy_htod(expert_of_row, &mut b.expert_of_row.slice_mut(0..rows)).map_err(|x| err("upload", x))?;
        let (pa, ph13, pact, py) = (self.ptr(&b.a), self.ptr(&b.h13), self.ptr(&b.act), self.ptr(&b.y));
        let (w13, w2) = (self.ptr(&self.w13), self.ptr(&self.w2));
        for &(e, start, n) in segments {
            let off = |base: u64, width: usize| base + (start * width * 2) as u64;
            gemm_bf16(&self.blas, w13 + (e * 2 * i * h * 2) as u64, 2 * i, h, off(pa, h), off(ph13, 2 * i), n)?;
        }
        let b13 = self.b13.as_ref().map_or(0u64, |x| self.ptr(x));
        // The expert map only matters for the bias.
        let erp = if b13 == 0 { 0 } else { self.ptr(&b.expert_of_row) };
        act_and_mul(&self.gpu.stream, &self.act_kernel, self.activation, [ph13, b13, erp, 0, pact], 0, rows, i)?;
        for &(e, start, n) in segments {
            let off = |base: u64, width: usize| base + (start * width * 2) as u64;
            gemm_bf16(&self.blas, w2 + (e * h * i * 2) as u64, h, i, off(pact, i), off(py, h), n)?;
        }
        let mut y = vec![0u16; rows * h];
        s.memcpy_dtoh(&b.y.slice(0..rows * h), &mut y).map_err(|x| err("download", x))?;
        Ok(y)
    }

    /// `y` row `r` (bf16 bits) plus expert `e`'s `b2` into `dst` as f32.
    fn emit(&self, y: &[u16], r: usize, e: usize, dst: &mut [f32]) {
        let h = self.hidden;
        let row = &y[r * h..(r + 1) * h];
        match &self.b2 {
            Some(b2) => dst
                .iter_mut()
                .zip(row)
                .zip(&b2[e * h..(e + 1) * h])
                .for_each(|((o, &v), &b)| *o = half::bf16::from_bits(v).to_f32() + b),
            None => dst.iter_mut().zip(row).for_each(|(o, &v)| *o = half::bf16::from_bits(v).to_f32()),
        }
    }
}

fn to_bf16(x: &[f32], out: &mut Vec<u16>) {
    out.extend(x.iter().map(|&v| half::bf16::from_f32(v).to_bits()));
}

impl Experts for CudaExperts {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn supports(&self, _format: ActivationFormat) -> bool {
        true
    }

    fn dims(&self) -> (usize, usize, usize) {
        (self.experts, self.hidden, self.inter)
    }

    fn workspace_len(&self, _tokens: usize, _k: usize) -> usize {
        0
    }

    fn weight_and_reduce(&self) -> &'static dyn WeightAndReduce {
        &WeightedSum
    }

    fn apply(&self, input: &ExpertInput, _workspace: &mut [f32], out: &mut [f32]) -> Result<()> {
        let (h, k) = (self.hidden, input.k);
        let slots = input.tokens * k;
        if out.len() != slots * h || input.hidden.len() != input.tokens * h {
            return Err(MoeError::shape("expert input/output", [input.tokens, k, h], out.len()));
        }
        let groups = input.group_slots(self.experts)?;
        let rows = groups.rows();
        let segments: Vec<Segment> = groups.segments().collect();
        let mut expert_of_row = vec![0i32; rows];
        for &(e, start, n) in &segments {
            expert_of_row[start..start + n].fill(e as i32);
        }
        let mut a = Vec::with_capacity(rows * h);
        for &s in &groups.order {
            let t = s as usize / k;
            to_bf16(&input.hidden[t * h..(t + 1) * h], &mut a);
        }
        let y = self.run(&a, rows, &segments, &expert_of_row)?;
        for (s, dst) in out.chunks_mut(h.max(1)).enumerate().take(slots) {
            match groups.row_of_slot[s] {
                u32::MAX => dst.iter_mut().for_each(|x| *x = -0.0),
                r => self.emit(&y, r as usize, expert_of_row[r as usize] as usize, dst),
            }
        }
        Ok(())
    }

    fn apply_batched(&self, input: &BatchedInput, _workspace: &mut [f32], out: &mut [f32]) -> Result<()> {
        let (h, cap) = (self.hidden, input.capacity);
        input.check(self.experts, h, out)?;
        // Only the valid rows travel: pack them, run, and write them back in place.
        let (mut a, mut segments, mut expert_of_row) = (Vec::new(), Vec::new(), Vec::new());
        for (e, &n) in input.counts.iter().enumerate() {
            if n > 0 {
                segments.push((e, expert_of_row.len(), n));
                to_bf16(&input.hidden[e * cap * h..(e * cap + n) * h], &mut a);
                expert_of_row.extend(std::iter::repeat_n(e as i32, n));
            }
        }
        let y = self.run(&a, expert_of_row.len(), &segments, &expert_of_row)?;
        for &(e, start, n) in &segments {
            for j in 0..n {
                let dst = &mut out[(e * cap + j) * h..(e * cap + j + 1) * h];
                self.emit(&y, start + j, e, dst);
            }
        }
        Ok(())
    }
}
