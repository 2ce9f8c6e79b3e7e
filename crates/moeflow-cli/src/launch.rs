//! `moeflow launch --gpus N -- <moeflow arguments>`: starts N local processes of this program,
//! one per GPU (or, with `--backend cpu`, N CPU ranks talking over TCP), with the torchrun-style
//! variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT) and a fresh job token (MOEFLOW_JOB) set, and waits for them. When one fails, the others get a grace period (their
//! own collectives fail within their deadline once the failure is known) and are then killed.

use moeflow::{MoeError, Result};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Arguments of `moeflow launch`.
#[derive(clap::Args, Debug)]
pub struct LaunchArgs {
    /// Processes to start (rank r uses GPU r under `--backend cuda`).
    #[arg(long, visible_alias = "procs")]
    gpus: usize,
    /// Port of rank 0's rendezvous (default: a free one).
    #[arg(long)]
    port: Option<u16>,
    /// Seconds the other ranks get to exit after one failed, before they are killed.
    #[arg(long, default_value_t = 90)]
    grace: u64,
    /// The moeflow command each process runs, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

pub fn run(args: LaunchArgs) -> Result<()> {
    if args.gpus == 0 {
        return Err(MoeError::Config("--gpus must be at least 1".into()));
    }
    // One process a rank on this machine: as many as in-process ranks may be, no more.
    if args.gpus > moeflow::comm::MAX_THREAD_RANKS {
        return Err(MoeError::Config(format!(
            "--gpus {}: at most {} processes on one machine",
            args.gpus,
            moeflow::comm::MAX_THREAD_RANKS
        )));
    }
    let exe = std::env::current_exe().map_err(|e| MoeError::Io { context: "finding moeflow".into(), source: e })?;
    let port = match args.port {
        Some(p) => p,
        None => {
            moeflow::comm::free_port().map_err(|e| MoeError::Io { context: "choosing a port".into(), source: e })?
        }
    };
    let job = moeflow::comm::JobId::random();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..args.gpus {
        let child = Command::new(&exe)
            .args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", args.gpus.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("MOEFLOW_JOB", job.as_str())
            .spawn()
            .map_err(|e| MoeError::Io { context: format!("starting rank {rank}"), source: e })?;
        children.push(child);
    }
    let mut codes: Vec<Option<i32>> = vec![None; args.gpus];
    let mut first_failure: Option<(usize, Instant)> = None;
    while codes.iter().any(Option::is_none) {
        for (rank, child) in children.iter_mut().enumerate() {
            if codes[rank].is_none() {
                if let Ok(Some(status)) = child.try_wait() {
                    let code = status.code().unwrap_or(-1);
                    codes[rank] = Some(code);
                    if code != 0 && first_failure.is_none() {
                        eprintln!("moeflow launch: rank {rank} exited with {status}");
                        first_failure = Some((rank, Instant::now()));
                    }
                }
            }
        }
        if let Some((_, since)) = first_failure {
            if since.elapsed() > Duration::from_secs(args.grace) {
                for (rank, child) in children.iter_mut().enumerate() {
                    if codes[rank].is_none() {
                        eprintln!("moeflow launch: killing rank {rank} ({}s after the first failure)", args.grace);
                        let _ = child.kill();
                        let _ = child.wait();
                        codes[rank] = Some(-9);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match first_failure {
        None => Ok(()),
        Some((rank, _)) => Err(MoeError::Config(format!(
            "rank {rank} failed first; exit codes by rank: {:?}",
            codes.iter().map(|c| c.unwrap_or(-1)).collect::<Vec<_>>()
        ))),
    }
}
