use half::bf16;
use moeflow::backend::cpu::{gemm::*, packed::*};
fn main() {
    // Hot caches: one expert, 6 rows, 8 panels, K = 256, repeated.
    for &(m, n, k) in &[(6usize, 128usize, 256usize), (32, 128, 256), (32, 128, 2048), (32, 2048, 2048)] {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 * 1e-3 - 0.5).collect();
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 40503usize) % 1000) as f32 * 1e-3 - 0.5).collect();
        let pf = PackedMatrices::pack(&w, 1, n, k);
        let wb: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
        let pb = PackedMatrices::pack(&wb, 1, n, k);
        let segs = [Segment { expert: 0, row_start: 0, rows: m }];
        let mut c = vec![0f32; m * n];
        let reps = (2_000_000_000 / (2 * m * n * k)).max(1);
        let t = std::time::Instant::now();
        for _ in 0..reps {
            grouped_gemm(&a, Rows::strided(k), &segs, &pf, &mut c, Rows::strided(n));
        }
        let f = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            grouped_gemm(&a, Rows::strided(k), &segs, &pb, &mut c, Rows::strided(n));
        }
        let b = t.elapsed().as_secs_f64();
        let fl = (2 * m * n * k * reps) as f64;
        println!("m {m} n {n} k {k}: f32 {:.1} bf16 {:.1} GFLOP/s", fl / f / 1e9, fl / b / 1e9);
    }
}
