//! Round trips: exact on representable values, bounded elsewhere, defined at the edges.

use super::*;
use rand::{Rng, SeedableRng};

#[test]
fn representable_values_round_trip_exactly() {
    // int8: multiples of amax / 127 with amax = 127.
    let x: Vec<f32> = (-127..=127).map(|v| v as f32).collect();
    let q = quantize(QuantConfig::Int8, &x, x.len()).unwrap();
    assert_eq!(dequantize(&q), x);
    // fp8: e4m3 values with amax = 448 (scale 1) are exact, per token and per block.
    let x: Vec<f32> =
        [448.0, -448.0, 0.5, 1.0, -2.25, 0.015625, 3.5, -0.0, 240.0, 0.001953125, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
            .repeat(16);
    for cfg in [QuantConfig::Fp8, QuantConfig::Fp8Block] {
        let q = quantize(cfg, &x, x.len()).unwrap();
        assert_eq!(dequantize(&q), x, "{cfg}");
    }
    // MXFP8: a power-of-two scale keeps e4m3 values exact whenever amax is a power of two
    // times 448.
    let x: Vec<f32> = [896.0, -1.0, 4.0, 0.5].repeat(8);
    let q = quantize(QuantConfig::Mxfp8, &x, 32).unwrap();
    assert_eq!(q.scales, vec![2.0]);
    assert_eq!(dequantize(&q), x);
}

#[test]
fn random_rows_stay_within_half_a_step() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for cfg in QuantConfig::ALL {
        for h in [1, 31, 129, 300] {
            let x: Vec<f32> =
                (0..5 * h).map(|_| rng.gen_range(-3.0..3.0) * if rng.gen_bool(0.1) { 100.0 } else { 1.0 }).collect();
            let q = quantize(cfg, &x, h).unwrap();
            assert_eq!(q.rows(), 5);
            assert_eq!(q.scales.len(), 5 * cfg.scales_per_row(h));
            let y = dequantize(&q);
            let g = cfg.group(h);
            for (r, (xr, yr)) in x.chunks(h).zip(y.chunks(h)).enumerate() {
                for (gi, (xg, yg)) in xr.chunks(g).zip(yr.chunks(g)).enumerate() {
                    let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    for (a, b) in xg.iter().zip(yg) {
                        let err = (*a as f64 - *b as f64).abs();
                        // Relative to the value for fp8 (floating point), to amax for int8;
                        // values far below amax fall into e4m3's subnormals: 2^-9 of the scale.
                        let bound = match cfg {
                            QuantConfig::Int8 => cfg.step() * amax * 1.0001,
                            QuantConfig::None => 0.0,
                            _ => cfg.step() * (*a as f64).abs() + amax / 448.0 * 2f64.powi(-9) * 2.0,
                        };
                        assert!(err <= bound + 1e-12, "{cfg} h {h} row {r} group {gi}: {a} -> {b}");
                    }
                }
            }
        }
    }
}

#[test]
fn zeros_saturation_and_non_finite() {
    for cfg in QuantConfig::ALL {
        let q = quantize(cfg, &[0.0; 64], 64).unwrap();
        assert!(dequantize(&q).iter().all(|&v| v == 0.0), "{cfg}: zero rows stay zero");
        assert!(q.scales.iter().all(|s| s.is_finite()));
        let e = quantize(cfg, &[1.0, f32::NAN], 2).unwrap_err().to_string();
        assert!(e.contains("non-finite"), "{cfg}: {e}");
        assert!(quantize(cfg, &[1.0, f32::INFINITY], 2).is_err());
    }
    // Saturation at the code level.
    assert_eq!(fp8_e4m3_decode(fp8_e4m3_encode(1e6)), 448.0);
    assert_eq!(fp8_e4m3_decode(fp8_e4m3_encode(-1e6)), -448.0);
    // Denormals: the smallest e4m3 subnormal is 2^-9.
    assert_eq!(fp8_e4m3_decode(fp8_e4m3_encode(2f32.powi(-9))), 2f32.powi(-9));
    assert_eq!(fp8_e4m3_decode(fp8_e4m3_encode(2f32.powi(-12))), 0.0);
    assert_eq!("fp8-block".parse::<QuantConfig>().unwrap(), QuantConfig::Fp8Block);
    assert!("fp4".parse::<QuantConfig>().unwrap_err().to_string().contains("mxfp8"));
}

#[test]
fn bytes_per_format() {
    assert_eq!(QuantConfig::None.row_bytes(7168), 4 * 7168);
    assert_eq!(QuantConfig::Fp8.row_bytes(7168), 7168);
    assert_eq!(QuantConfig::Fp8Block.scales_per_row(7168), 56);
    assert_eq!(QuantConfig::Mxfp8.scales_per_row(7168), 224);
    assert_eq!(QuantConfig::Int8.scales_per_row(7168), 1);
}
