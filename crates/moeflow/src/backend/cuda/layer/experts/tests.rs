//! Every implementation of the device experts contract against an f64 MLP of the same bf16
//! values, on the layouts it takes, with poisoned outputs.

use super::{CublasGrouped, CublasPadded, CublasPerExpert, DeviceExperts, ExpertRows, Hopper, Masked};
use crate::backend::cuda::layer::{dptr, CudaMoeLayer};
use crate::config::MoeConfig;
use crate::experts::Activation;
use crate::router::RouterConfig;
use crate::{preset, DType};
use half::bf16;

/// Experts with 0, 1, a few, many and no rows, grouped and padded to the largest; each
/// implementation the layer has on this GPU runs both layouts it takes, and its rows are
/// checked against f64 (`y = W2 · act(W13 · a)`, the intermediate rounded to bf16 as on the
/// device); rows of no expert keep their poison where the implementation reads the counts on
/// the device. Needs a GPU; says loudly when it skips.
#[test]
fn every_device_experts_implementation_matches_f64() {
    if crate::backend::cuda::skip_without_gpu("every_device_experts_implementation_matches_f64") {
        return;
    }
    let (h, i) = (256usize, 96usize);
    let counts: Vec<usize> = vec![0, 1, 37, 5, 70, 0, 2];
    let e = counts.len();
    let config: MoeConfig =
        preset::config(h, i, e, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 11);
    let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
    let (g, s) = (&layer.gpu, &layer.gpu.stream);
    let round = |x: f32| bf16::from_f32(x).to_f64();
    let (w13, w2): (Vec<f64>, Vec<f64>) = (
        weights.experts.w13_f32().into_iter().map(round).collect(),
        weights.experts.w2_f32().into_iter().map(round).collect(),
    );
    let grouped_rows: usize = counts.iter().sum();
    let cap = *counts.iter().max().unwrap();
    let mut impls: Vec<(&'static dyn DeviceExperts, bool, bool)> = vec![
        // (implementation, takes grouped, takes padded)
        (&CublasPadded, false, true),
        (&CublasGrouped, true, false),
        (&CublasPerExpert, true, false),
    ];
    if layer.masked {
        impls.push((&Masked, true, true));
    }
    if layer.k.hopper.is_some() {
        impls.push((&Hopper, true, true));
    } else {
        eprintln!("SKIPPED the Hopper implementation: not a Hopper GPU");
    }
    let poison = 0x7fc1u16; // a NaN that no product yields
    let mut guard = None;
    let b = layer.buffers(&mut guard, 64).unwrap();
    for (imp, grouped, padded) in impls {
        for padded_layout in [false, true].into_iter().filter(|&p| if p { padded } else { grouped }) {
            let rows = if padded_layout { e * cap } else { grouped_rows };
            let first: Vec<usize> = if padded_layout {
                (0..e).map(|x| x * cap).collect()
            } else {
                counts.iter().scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect()
            };
            let mut expert_of_row = vec![-1i32; rows];
            for x in 0..e {
                expert_of_row[first[x]..first[x] + counts[x]].iter_mut().for_each(|r| *r = x as i32);
            }
            let a: Vec<u16> = preset::uniform(rows * h, 1.0, 12).iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
            let ad = s.clone_htod(&a).unwrap();
            let h13 = s.alloc_zeros::<u16>(rows * 2 * i).unwrap();
            let act = s.alloc_zeros::<u16>(rows * i).unwrap();
            let yd = s.clone_htod(&vec![poison; rows * h]).unwrap();
            let eor = s.clone_htod(&expert_of_row).unwrap();
            let cd = s.clone_htod(&counts.iter().map(|&c| c as i32).collect::<Vec<_>>()).unwrap();
            let od = s.clone_htod(&first.iter().map(|&c| c as i32).collect::<Vec<_>>()).unwrap();
            let r = ExpertRows {
                imp,
                a: dptr(&ad, g),
                h13: dptr(&h13, g),
                act: dptr(&act, g),
                y: dptr(&yd, g),
                expert_of_row: if padded_layout { 0 } else { dptr(&eor, g) },
                experts: e,
                cap: if padded_layout { cap } else { 0 },
                rows,
                busy: rows,
                groups: super::groups_of(&counts),
                counts: dptr(&cd, g),
                offsets: dptr(&od, g),
                gather: None,
                y_rows: None,
            };
            imp.run(&layer, b, &r, &|_| Ok(())).unwrap();
            let y = s.clone_dtoh(&yd).unwrap();
            let what = format!("{} on the {} layout", imp.name(), if padded_layout { "padded" } else { "grouped" });
            let v = |x: u16| bf16::from_bits(x).to_f64();
            for x in 0..e {
                for row in first[x]..first[x] + counts[x] {
                    let inp = &a[row * h..(row + 1) * h];
                    let dot = |w: &[f64], n: usize, j: usize, kd: usize, xin: &dyn Fn(usize) -> f64| {
                        (0..kd).map(|q| w[(x * n + j) * kd + q] * xin(q)).sum::<f64>()
                    };
                    let up = |j: usize| dot(&w13, 2 * i, j, h, &|q| v(inp[q]));
                    let mid: Vec<f64> =
                        (0..i).map(|j| round(Activation::Silu.apply_f64(up(j), up(i + j)) as f32)).collect();
                    for j in 0..h {
                        let want = dot(&w2, h, j, i, &|q| mid[q]);
                        let got = v(y[row * h + j]);
                        let tol = 2e-2 * (1.0 + want.abs());
                        assert!((got - want).abs() <= tol, "{what}: expert {x} row {row} col {j}: {got} vs {want}");
                    }
                }
            }
            if padded_layout && (imp.name() == "hopper" || imp.name() == "masked") {
                for (row, _) in expert_of_row.iter().enumerate().filter(|(_, &x)| x < 0) {
                    assert!(
                        y[row * h..(row + 1) * h].iter().all(|&q| q == poison),
                        "{what}: padding row {row} written"
                    );
                }
            }
            eprintln!("device experts match f64: {what}");
        }
    }
}
