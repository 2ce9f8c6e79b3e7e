use half::bf16;
use moeflow::backend::cpu::{gemm::*, packed::*};
fn main() {
    let (e, n, k, m) = (64usize, 2048usize, 2048usize, 32usize);
    let w: Vec<f32> = (0..e * n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 * 1e-3 - 0.5).collect();
    let a: Vec<f32> = (0..e * m * k).map(|i| ((i * 40503usize) % 1000) as f32 * 1e-3 - 0.5).collect();
    let segs: Vec<Segment> = (0..e).map(|x| Segment { expert: x, row_start: x * m, rows: m }).collect();
    let mut c = vec![0f32; e * m * n];
    let pf = PackedMatrices::pack(&w, e, n, k);
    let wb: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
    let pb = PackedMatrices::pack(&wb, e, n, k);
    drop(w);
    let flops = 2.0 * (e * m * n * k) as f64;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        grouped_gemm(&a, Rows::strided(k), &segs, &pf, &mut c, Rows::strided(n));
        let f = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        grouped_gemm(&a, Rows::strided(k), &segs, &pb, &mut c, Rows::strided(n));
        let b = t.elapsed().as_secs_f64();
        println!("f32 {:.1} GFLOP/s  bf16 {:.1} GFLOP/s", flops / f / 1e9, flops / b / 1e9);
    }
}
