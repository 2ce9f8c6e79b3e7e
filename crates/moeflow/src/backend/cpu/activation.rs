//! The gated activation over a whole row, `out[j] = act(gate[j]) · up[j]`, eight lanes at a
//! time with AVX2 for the activations built on `exp` (SiLU and GPT-OSS's clamped SwiGLU); the
//! GELUs, and machines without AVX2, take [`Activation::apply`] element by element.
//!
//! Every element goes through the same vector code, the row's tail included (padded to a full
//! vector), so an element's result depends only on its own gate and up values: batching and
//! chunking cannot change a bit of it.

use crate::experts::Activation;

/// Writes `out[j] = act(gate[j]) · up[j]` for every `j`; the three slices have one length.
pub fn gated_row(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len(), "activation row lengths");
    #[cfg(target_arch = "x86_64")]
    if matches!(act, Activation::Silu | Activation::SwigluOai { .. })
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: AVX2 and FMA were detected just above.
        unsafe { avx2::gated_row(act, gate, up, out) };
        return;
    }
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = act.apply(g, u);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Activation;
    use std::arch::x86_64::*;

    /// As [`super::gated_row`], for SiLU and the clamped SwiGLU.
    ///
    /// # Safety
    /// Requires AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gated_row(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
        let body = out.len() / 8 * 8;
        for j in (0..body).step_by(8) {
            let (g, u) = (_mm256_loadu_ps(gate.as_ptr().add(j)), _mm256_loadu_ps(up.as_ptr().add(j)));
            _mm256_storeu_ps(out.as_mut_ptr().add(j), lanes(act, g, u));
        }
        if body < out.len() {
            let n = out.len() - body;
            let (mut g, mut u, mut o) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            g[..n].copy_from_slice(&gate[body..]);
            u[..n].copy_from_slice(&up[body..]);
            _mm256_storeu_ps(o.as_mut_ptr(), lanes(act, _mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())));
            out[body..].copy_from_slice(&o[..n]);
        }
    }

    /// `act(g) · u` on eight lanes, in the operation order of [`Activation::apply`].
    #[inline(always)]
    unsafe fn lanes(act: Activation, g: __m256, u: __m256) -> __m256 {
        let one = _mm256_set1_ps(1.0);
        match act {
            Activation::SwigluOai { alpha, limit } => {
                let lim = _mm256_set1_ps(limit);
                // `gate.min(limit)` keeps `limit` for a NaN gate (minps returns its second
                // operand then); `up.clamp` keeps a NaN up (the constant goes first).
                let g = _mm256_min_ps(g, lim);
                let u = _mm256_max_ps(_mm256_set1_ps(-limit), _mm256_min_ps(lim, u));
                let e = exp(_mm256_mul_ps(_mm256_set1_ps(-alpha), g));
                _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_div_ps(g, _mm256_add_ps(one, e)))
            }
            // SiLU (the only other activation routed here).
            _ => {
                let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
                _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
            }
        }
    }

    /// `e^x` on eight lanes, within 2 ulp: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (ln 2 split
    /// in two parts so `r` is exact), a degree-7 polynomial for `e^r` (Cephes' coefficients),
    /// and `2^n` built in the exponent bits. Results that would be subnormal become 0 (an
    /// absolute error below 1.2e-38); past the largest finite result, +∞.
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        const MAX_X: f32 = 88.722_83; // ln(f32::MAX)
        const MIN_X: f32 = -87.336_55; // ln(f32::MIN_POSITIVE)
        let xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(MIN_X)), _mm256_set1_ps(MAX_X));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            xc,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        // 2^n must stay a normal number: n ≤ 127 (r then reaches ln 2 at the top of the range,
        // where the polynomial is still accurate to about 1e-7).
        let n = _mm256_min_ps(n, _mm256_set1_ps(127.0));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let er = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0));
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        let y = _mm256_mul_ps(er, two_n);
        let y =
            _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(MAX_X)));
        _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(MIN_X)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    const ACTS: [Activation; 5] = [
        Activation::Silu,
        Activation::GPT_OSS,
        Activation::SwigluOai { alpha: 0.5, limit: 3.0 },
        Activation::GeluErf,
        Activation::GeluTanh,
    ];

    /// Gates over the whole useful range and past both ends of `exp`, with exact zeros.
    fn gate_values(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 7 {
                0 => rng.gen_range(-120.0..120.0),
                1 => 0.0,
                2 => rng.gen_range(-1e-3..1e-3),
                _ => rng.gen_range(-12.0..12.0),
            })
            .collect()
    }

    #[test]
    fn rows_match_the_f64_definition() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for act in ACTS {
            for len in [0, 1, 7, 8, 9, 31, 1000] {
                let gate = gate_values(&mut rng, len);
                let up: Vec<f32> = (0..len).map(|_| rng.gen_range(-9.0..9.0)).collect();
                let mut out = vec![f32::NAN; len];
                gated_row(act, &gate, &up, &mut out);
                // The exp-based activations are held to a relative bound, widened by the f32
                // rounding of exp's argument (`alpha · gate`, up to 6e-8 of it, which exp turns
                // into a relative error); the GELUs (computed element by element) to the bound
                // of their own test, since `1 + tanh` and `1 + erf` cancel for very negative gates.
                let alpha = match act {
                    Activation::Silu => Some(0.0),
                    Activation::SwigluOai { alpha, .. } => Some(alpha as f64),
                    _ => None,
                };
                for j in 0..len {
                    let want = act.apply_f64(gate[j] as f64, up[j] as f64);
                    let got = out[j] as f64;
                    let tol = match alpha {
                        Some(a) => (1e-6 + 6e-8 * a * (gate[j] as f64).abs()) * want.abs() + 1e-30,
                        None => 1e-6 * (1.0 + want.abs()),
                    };
                    assert!((got - want).abs() <= tol, "{act:?} gate {} up {}: {got} vs {want}", gate[j], up[j]);
                }
            }
        }
    }

    #[test]
    fn an_element_does_not_depend_on_its_position() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for act in ACTS {
            let gate = gate_values(&mut rng, 27);
            let up: Vec<f32> = (0..27).map(|_| rng.gen_range(-9.0..9.0)).collect();
            let mut row = vec![0f32; 27];
            gated_row(act, &gate, &up, &mut row);
            for j in 0..27 {
                let mut one = [0f32];
                gated_row(act, &gate[j..=j], &up[j..=j], &mut one);
                assert_eq!(one[0].to_bits(), row[j].to_bits(), "{act:?} element {j}");
            }
        }
    }

    #[test]
    fn nan_and_infinite_inputs_follow_the_scalar_definition() {
        for act in ACTS {
            let gate = [f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY, 2.0];
            let up = [1.0, f32::NAN, 1.0, 1.0, f32::INFINITY];
            let mut out = [0f32; 5];
            gated_row(act, &gate, &up, &mut out);
            for j in 0..5 {
                let want = act.apply(gate[j], up[j]);
                assert!(
                    want.to_bits() == out[j].to_bits() || (want.is_nan() && out[j].is_nan()),
                    "{act:?} gate {} up {}: {} vs {want}",
                    gate[j],
                    up[j],
                    out[j]
                );
            }
        }
    }
}
