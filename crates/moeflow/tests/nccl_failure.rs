//! NCCL failure handling, one thread per GPU: a rank that errors between collectives and a rank
//! that never joins one make every other rank fail within the deadline, naming the rank and the
//! operation. These tests abort communicators, so they run in a test binary (process) of their
//! own, apart from tests/nccl.rs. Needs the `cuda` feature and at least two GPUs; with fewer
//! every test prints SKIPPED and checks nothing.
#![cfg(feature = "cuda")]

mod common;

use common::{gpus, Gpus};
use moeflow::backend::cuda::run_ranks_nccl;
use moeflow::comm::Communicator;
use moeflow::MoeError;
use std::time::{Duration, Instant};

#[test]
fn a_failing_rank_fails_every_rank_within_the_deadline() {
    let Some(Gpus { n, _serial }) = gpus("a_failing_rank_fails_every_rank_within_the_deadline") else { return };
    let timeout = Duration::from_secs(5);
    let devices: Vec<usize> = (0..n).collect();
    // Rank 1 returns an error between two collectives: the others must not wait for it.
    let start = Instant::now();
    let results = run_ranks_nccl(&devices, timeout, |c| {
        c.barrier()?;
        if c.rank() == 1 {
            return Err(MoeError::Config("injected failure".into()));
        }
        c.all_to_all_v("after the failure", vec![vec![1u8; 1 << 20]; c.size()])?;
        Ok(())
    });
    let elapsed = start.elapsed();
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank fails").to_string();
        if rank != 1 {
            assert!(e.contains("rank 1") && e.contains("injected failure"), "rank {rank}: {e}");
            assert!(e.contains("after the failure") || e.contains("rank body"), "rank {rank}: {e}");
        }
        eprintln!("rank {rank}: {e}");
    }
    assert!(elapsed < timeout + Duration::from_secs(10), "took {elapsed:?}");
    // Rank 1 silently skips a collective: the others time out and abort.
    let start = Instant::now();
    let results = run_ranks_nccl(&devices, timeout, |c| {
        c.barrier()?;
        if c.rank() != 1 {
            c.all_to_all_v("skipped by rank 1", vec![vec![2u8; 4096]; c.size()])?;
        } else {
            std::thread::sleep(timeout * 2);
        }
        Ok(())
    });
    let elapsed = start.elapsed();
    for (rank, r) in results.iter().enumerate() {
        if rank != 1 {
            let e = r.as_ref().expect_err("the waiting ranks fail").to_string();
            assert!(e.contains("skipped by rank 1") && e.contains("timed out"), "rank {rank}: {e}");
            eprintln!("rank {rank}: {e}");
        }
    }
    assert!(elapsed < timeout * 2 + Duration::from_secs(15), "took {elapsed:?}");
}
