//! Permute → expert GEMMs → unpermute: the compute stage of the layer.
//!
//! Weights use the standard layout: `w13 [E, 2I, H]` (gate rows, then up rows) and
//! `w2 [E, H, I]`, with optional f32 biases `b13 [E, 2I]` and `b2 [E, H]`.

mod activation;
mod cpu;
mod reference;

pub use activation::Activation;
pub use cpu::CpuExperts;

pub use reference::{expert_row_f64, ReferenceExperts, WeightValues};

use crate::error::{MoeError, Result};
use crate::quant::WeightQuant;
use crate::reduce::WeightAndReduce;
use crate::tensor::Tensor;
use crate::DType;

/// How a strategy hands tokens to the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationFormat {
    /// `[rows, H]` with their top-k ids; the experts permute rows by expert themselves.
    Standard,
    /// `[local_experts, capacity, H]` with per-expert counts (fixed shapes).
    Batched,
}

/// The weights of `num_experts` gated MLP experts.
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `[E, 2I, H]`: gate projection rows, then up projection rows (f32, bf16 or f16).
    pub w13: Tensor,
    /// `[E, H, I]`: down projection.
    pub w2: Tensor,
    /// Optional `[E, 2I]` bias of the first GEMM.
    pub b13: Option<Tensor>,
    /// Optional `[E, H]` bias of the second GEMM.
    pub b2: Option<Tensor>,
    /// Set when `w13`/`w2` hold quantized codes (fp8 e4m3 or int8) with these scales.
    pub quant: Option<QuantizedScales>,
}

/// Scales of quantized expert weights: `w13 [E, scales_len(2I, H)]`, `w2 [E, scales_len(H, I)]`.
#[derive(Clone, Debug)]
pub struct QuantizedScales {
    /// The storage format.
    pub format: WeightQuant,
    /// Scales of `w13`.
    pub w13: Tensor,
    /// Scales of `w2`.
    pub w2: Tensor,
}

/// Raw codes and scales of quantized expert weights.
#[derive(Clone, Debug)]
pub struct QuantizedCodes {
    /// Storage format.
    pub format: WeightQuant,
    /// `w13` codes `[E, 2I, H]`.
    pub w13: Vec<u8>,
    /// `w13` scales.
    pub w13_scales: Vec<f32>,
    /// `w2` codes `[E, H, I]`.
    pub w2: Vec<u8>,
    /// `w2` scales.
    pub w2_scales: Vec<f32>,
}

/// The codes of a quantized weight tensor (fp8 bits or int8 two's complement).
fn code_bytes(t: &Tensor) -> Vec<u8> {
    use crate::tensor::CpuStorage;
    match t.cpu() {
        CpuStorage::F8E4M3(v) => v.iter().map(|x| x.to_bits()).collect(),
        CpuStorage::I8(v) => v.iter().map(|&x| x as u8).collect(),
        _ => Vec::new(),
    }
}

impl ExpertWeights {
    /// `(E, H, I)` read from `w13` and `w2`, after checking that all shapes agree.
    pub fn dims(&self) -> Result<(usize, usize, usize)> {
        let s1 = self.w13.shape();
        if s1.len() != 3 || !s1[1].is_multiple_of(2) {
            return Err(MoeError::shape("w13", "[E, 2I, H]", s1));
        }
        let (e, i, h) = (s1[0], s1[1] / 2, s1[2]);
        self.w2.expect_shape("w2", &[e, h, i])?;
        if let Some(b) = &self.b13 {
            b.expect_shape("b13", &[e, 2 * i])?;
        }
        if let Some(b) = &self.b2 {
            b.expect_shape("b2", &[e, h])?;
        }
        let expected = match &self.quant {
            None => [DType::F32, DType::BF16, DType::F16].as_slice(),
            Some(q) => {
                if q.format == WeightQuant::Fp8Block(0) {
                    return Err(MoeError::Config("fp8 weight block size must be positive".into()));
                }
                q.w13.expect_shape("w13 scales", &[e, q.format.scales_len(2 * i, h)])?;
                q.w2.expect_shape("w2 scales", &[e, q.format.scales_len(h, i)])?;
                match q.format {
                    WeightQuant::Fp8Block(_) => [DType::F8E4M3].as_slice(),
                    WeightQuant::Int8Channel | WeightQuant::Mxfp4 => [DType::I8].as_slice(),
                }
            }
        };
        for (what, t) in [("w13", &self.w13), ("w2", &self.w2)] {
            if !expected.contains(&t.dtype()) {
                let names: Vec<&str> = expected.iter().map(|d| d.name()).collect();
                return Err(MoeError::DType {
                    what: what.into(),
                    expected: names.join(" or "),
                    got: t.dtype().to_string(),
                });
            }
        }
        Ok((e, h, i))
    }

    /// [`ExpertWeights::dims`] after [`ExpertWeights::check_values`]: what every constructor of
    /// experts checks before it computes anything.
    pub fn validate(&self, what: &str) -> Result<(usize, usize, usize)> {
        let dims = self.dims()?;
        self.check_values(what)?;
        Ok(dims)
    }

    /// Checks that every weight, bias and scale is finite and that quantized weights decode to
    /// finite values (scale times the format's largest code; MXFP4 codes below 16). Errors name
    /// `what` (e.g. "routed experts"), the tensor, the expert and the index within it.
    pub fn check_values(&self, what: &str) -> Result<()> {
        let experts = self.w13.shape().first().copied().unwrap_or(0).max(1);
        let named = |name: &str, t: &Tensor| -> Result<()> {
            match t.first_nonfinite() {
                None => Ok(()),
                Some((i, value)) => {
                    let per = (t.elem_count() / experts).max(1);
                    Err(MoeError::NonFinite {
                        what: format!("{name} of expert {} ({what})", i / per),
                        index: i % per,
                        value,
                    })
                }
            }
        };
        named("w13", &self.w13)?;
        named("w2", &self.w2)?;
        for (name, b) in [("b13", &self.b13), ("b2", &self.b2)] {
            if let Some(b) = b {
                named(name, b)?;
            }
        }
        let Some(q) = &self.quant else { return Ok(()) };
        let largest = q.format.largest_code();
        for (name, scales) in [("w13 scales", &q.w13), ("w2 scales", &q.w2)] {
            named(name, scales)?;
            let per = (scales.elem_count() / experts).max(1);
            if let Some((i, &s)) = scales.to_f32_vec().iter().enumerate().find(|(_, s)| !(*s * largest).is_finite()) {
                return Err(MoeError::NonFinite {
                    what: format!(
                        "{name} of expert {} ({what}): scale {s:e} times the largest {:?} code {largest}",
                        i / per,
                        q.format
                    ),
                    index: i % per,
                    value: s * largest,
                });
            }
        }
        if q.format == WeightQuant::Mxfp4 {
            for (name, t) in [("w13", &self.w13), ("w2", &self.w2)] {
                if let crate::tensor::CpuStorage::I8(v) = t.cpu() {
                    if let Some(i) = v.iter().position(|&c| !(0..16).contains(&c)) {
                        let per = (v.len() / experts).max(1);
                        return Err(MoeError::Format(format!(
                            "{name} of expert {} ({what}): MXFP4 code {} at index {} is not a 4-bit code",
                            i / per,
                            v[i],
                            i % per
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// `w13` as f32 values (dequantized when quantized).
    pub fn w13_f32(&self) -> Vec<f32> {
        match &self.quant {
            None => self.w13.to_f32_vec(),
            Some(q) => {
                let s = self.w13.shape();
                q.format.dequantize(&code_bytes(&self.w13), &q.w13.to_f32_vec(), s[0], s[1], s[2])
            }
        }
    }

    /// `w2` as f32 values (dequantized when quantized).
    pub fn w2_f32(&self) -> Vec<f32> {
        match &self.quant {
            None => self.w2.to_f32_vec(),
            Some(q) => {
                let s = self.w2.shape();
                q.format.dequantize(&code_bytes(&self.w2), &q.w2.to_f32_vec(), s[0], s[1], s[2])
            }
        }
    }

    /// Codes and scales of `w13` and `w2` when quantized.
    pub fn codes(&self) -> Option<QuantizedCodes> {
        let q = self.quant.as_ref()?;
        Some(QuantizedCodes {
            format: q.format,
            w13: code_bytes(&self.w13),
            w13_scales: q.w13.to_f32_vec(),
            w2: code_bytes(&self.w2),
            w2_scales: q.w2.to_f32_vec(),
        })
    }

    /// The same experts stored in `format` (quantized from their f32 values).
    pub fn quantized(&self, format: WeightQuant) -> Result<ExpertWeights> {
        let (e, h, i) = self.dims()?;
        let (c13, s13) = format.quantize(&self.w13_f32(), e, 2 * i, h)?;
        let (c2, s2) = format.quantize(&self.w2_f32(), e, h, i)?;
        let codes = |c: Vec<u8>, shape: &[usize]| {
            Tensor::new(
                shape,
                match format {
                    WeightQuant::Fp8Block(_) => {
                        crate::tensor::CpuStorage::F8E4M3(c.into_iter().map(float8::F8E4M3::from_bits).collect())
                    }
                    WeightQuant::Int8Channel | WeightQuant::Mxfp4 => {
                        crate::tensor::CpuStorage::I8(c.into_iter().map(|b| b as i8).collect())
                    }
                },
            )
        };
        Ok(ExpertWeights {
            w13: codes(c13, &[e, 2 * i, h])?,
            w2: codes(c2, &[e, h, i])?,
            b13: self.b13.clone(),
            b2: self.b2.clone(),
            quant: Some(QuantizedScales {
                format,
                w13: Tensor::from_f32(&[e, format.scales_len(2 * i, h)], s13)?,
                w2: Tensor::from_f32(&[e, format.scales_len(h, i)], s2)?,
            }),
        })
    }

    /// The experts `ids` (logical ids, in slot order) as a new stack.
    pub fn select(&self, ids: &[usize]) -> Result<ExpertWeights> {
        let pick = |t: &Tensor| t.index_select0(ids);
        Ok(ExpertWeights {
            w13: pick(&self.w13)?,
            w2: pick(&self.w2)?,
            b13: self.b13.as_ref().map(pick).transpose()?,
            b2: self.b2.as_ref().map(pick).transpose()?,
            quant: match &self.quant {
                None => None,
                Some(q) => Some(QuantizedScales { format: q.format, w13: pick(&q.w13)?, w2: pick(&q.w2)? }),
            },
        })
    }

    /// Bytes of all expert weights.
    pub fn bytes(&self) -> usize {
        [Some(&self.w13), Some(&self.w2), self.b13.as_ref(), self.b2.as_ref()]
            .iter()
            .flatten()
            .map(|t| t.size_in_bytes())
            .sum()
    }
}

/// The tokens one rank's experts process, in the standard format.
#[derive(Clone, Copy, Debug)]
pub struct ExpertInput<'a> {
    /// `[tokens, H]` activations as dispatched (already weighted when applied on input).
    pub hidden: &'a [f32],
    /// Number of rows.
    pub tokens: usize,
    /// Global expert ids `[tokens, k]`.
    pub ids: &'a [i32],
    /// Router weights `[tokens, k]`.
    pub weights: &'a [f32],
    /// Experts per token.
    pub k: usize,
    /// Global expert → local slot, `-1` where the expert lives elsewhere (`None`: all local).
    pub expert_map: Option<&'a [i32]>,
    /// The router weights were multiplied into `hidden` already.
    pub weights_applied: bool,
}

impl ExpertInput<'_> {
    /// The local slot of the expert in `(token, slot)`, or `None` when it is not here.
    #[inline]
    pub fn local_expert(&self, flat_slot: usize) -> Option<usize> {
        let g = self.ids[flat_slot] as usize;
        match self.expert_map {
            None => Some(g),
            Some(m) => usize::try_from(m[g]).ok(),
        }
    }
}

/// A standard-format batch's slots grouped by local expert, in slot order within an expert.
#[derive(Clone, Debug)]
pub struct SlotGroups {
    /// Expert `e` owns rows `offsets[e]..offsets[e + 1]` (`[experts + 1]`).
    pub offsets: Vec<usize>,
    /// The flat slot (`token · k + j`) of each row.
    pub order: Vec<u32>,
    /// The row of each slot, `u32::MAX` where the slot's expert lives elsewhere.
    pub row_of_slot: Vec<u32>,
}

impl SlotGroups {
    /// Rows in all groups.
    pub fn rows(&self) -> usize {
        self.order.len()
    }

    /// `(expert, first row, rows)` of every expert with rows.
    pub fn segments(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.offsets.windows(2).enumerate().filter(|(_, w)| w[1] > w[0]).map(|(e, w)| (e, w[0], w[1] - w[0]))
    }
}

impl ExpertInput<'_> {
    /// Groups the slots by local expert among `experts`; a local slot past `experts` is an
    /// error naming its token and slot.
    pub fn group_slots(&self, experts: usize) -> Result<SlotGroups> {
        let slots = self.tokens * self.k;
        let local: Vec<Option<usize>> = (0..slots).map(|s| self.local_expert(s)).collect();
        let mut offsets = vec![0usize; experts + 1];
        for (s, l) in local.iter().enumerate() {
            let Some(l) = *l else { continue };
            if l >= experts {
                return Err(MoeError::ExpertOutOfRange {
                    id: l as i64,
                    num_experts: experts,
                    token: s / self.k,
                    slot: s % self.k,
                });
            }
            offsets[l + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let mut next = offsets.clone();
        let mut order = vec![0u32; offsets[experts]];
        let mut row_of_slot = vec![u32::MAX; slots];
        for (s, l) in local.iter().enumerate() {
            if let Some(l) = *l {
                order[next[l]] = s as u32;
                row_of_slot[s] = next[l] as u32;
                next[l] += 1;
            }
        }
        Ok(SlotGroups { offsets, order, row_of_slot })
    }
}

/// Rows in the batched format: `hidden [local, capacity, H]`, expert `e` using its first
/// `counts[e]` rows.
#[derive(Clone, Copy, Debug)]
pub struct BatchedInput<'a> {
    /// `[local, capacity, H]`.
    pub hidden: &'a [f32],
    /// Rows per expert.
    pub capacity: usize,
    /// Valid rows per local expert.
    pub counts: &'a [usize],
}

impl BatchedInput<'_> {
    /// Checks the input and `out` against `experts` experts of hidden size `h`: shapes, and no
    /// expert over capacity.
    pub fn check(&self, experts: usize, h: usize, out: &[f32]) -> Result<()> {
        let (cap, rows) = (self.capacity, experts * self.capacity);
        if self.counts.len() != experts || self.hidden.len() != rows * h || out.len() != rows * h {
            return Err(MoeError::shape("batched expert input", [experts, cap, h], self.hidden.len()));
        }
        if let Some(e) = self.counts.iter().position(|&c| c > cap) {
            return Err(MoeError::Config(format!("expert {e} holds {} rows, capacity {cap}", self.counts[e])));
        }
        Ok(())
    }
}

/// An expert implementation: sizes its workspace, computes, and says how its output is reduced.
pub trait Experts: Send + Sync {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// Whether it consumes `format`.
    fn supports(&self, format: ActivationFormat) -> bool {
        format == ActivationFormat::Standard
    }
    /// `(local experts, H, I)`.
    fn dims(&self) -> (usize, usize, usize);
    /// The format the experts take their input in: prepare quantizes rows to it before they
    /// travel (unless the experts quantize themselves, `defer_input_quant`).
    fn input_quant(&self) -> crate::quant::QuantConfig {
        crate::quant::QuantConfig::None
    }
    /// The experts quantize their input themselves (`defer_input_quant`): prepare sends rows
    /// unquantized and [`Experts::apply`] quantizes them on arrival.
    fn defer_input_quant(&self) -> bool {
        false
    }
    /// f32 elements of scratch space needed for `tokens` rows with `k` slots each.
    fn workspace_len(&self, tokens: usize, k: usize) -> usize;
    /// How finalize must turn this implementation's output into token rows.
    fn weight_and_reduce(&self) -> &'static dyn WeightAndReduce;
    /// Computes the experts for `input`, writing `out` (length from
    /// `weight_and_reduce().expert_output_len`); slots whose expert is not local are `-0.0`.
    fn apply(&self, input: &ExpertInput, workspace: &mut [f32], out: &mut [f32]) -> Result<()>;
    /// f32 elements of scratch space for the batched format with `rows` = local × capacity.
    fn batched_workspace_len(&self, _rows: usize) -> usize {
        0
    }
    /// Computes the batched format: `out [local, capacity, H]` unweighted, valid rows only.
    fn apply_batched(&self, _input: &BatchedInput, _workspace: &mut [f32], _out: &mut [f32]) -> Result<()> {
        Err(MoeError::Unsupported(format!("experts '{}' do not take the batched format", self.name())))
    }
}
