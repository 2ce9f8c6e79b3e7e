//! The `moeflow` command line: `demo`, `bench`, `plot`, `check`, `eplb`, `inspect`, `run`, `simulate`, `launch`
//! (see `--help`).

// First, so that its print macros replace std's in every module below.
#[macro_use]
mod output;

mod bench;
mod check;
mod common;
mod cuda_args;
mod demo;
mod eplb;
mod inspect;
mod launch;
mod run;
mod simulate;
mod table;

use clap::{Parser, Subcommand};

/// mimalloc keeps freed memory for reuse: the CPU layer's row buffers of one call (hundreds of
/// MB at large batches) would otherwise be mapped afresh and faulted in page by page on every
/// call (docs/tuning.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The environment a rank of a multi-process job reads (set by `moeflow launch`, torchrun or
/// by hand).
const ENVIRONMENT: &str = "\
Environment of a rank of a multi-process job (set by `moeflow launch`, torchrun or by hand):
  RANK, WORLD_SIZE   this process's rank and the number of processes
  LOCAL_RANK         the GPU of this host it uses (default: RANK)
  MASTER_ADDR        rank 0's address (default 127.0.0.1); rank 0 listens on it only
  MASTER_PORT        rank 0's rendezvous port (default 29500)
  MOEFLOW_JOB        the job token every rank presents; processes of another job are refused
                     (`moeflow launch` sets a fresh one; without it rank 0 draws one)
  MOEFLOW_BIND       the IP this rank's listeners bind to (default: MASTER_ADDR on rank 0, the
                     address that reaches rank 0 elsewhere; 0.0.0.0 for every interface)";

/// [`ENVIRONMENT`] and the GPU layers' variables, for `--help`.
fn environment_help() -> String {
    format!("{ENVIRONMENT}\n\n{}", cuda_args::variables_help())
}

/// moeflow: the Mixture-of-Experts layer engine.
#[derive(Parser)]
#[command(name = "moeflow", version, about, long_about = None, after_help = environment_help())]
struct Cli {
    /// Log debug messages to stderr (connections a rank closed or refused, job stages).
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a preset layer with random weights, check it against the f64 reference, report.
    Demo(demo::DemoArgs),
    /// Time the layer over token counts; GFLOP/s against this machine's measured matmul rate.
    Bench(bench::BenchArgs),
    /// Draw the plots of `bench --plot` (an SVG) from a JSON file written by `bench --json`.
    Plot(bench::PlotArgs),
    /// Every strategy × EP × TP × chunking × dual-batch against one rank and the f64 reference.
    Check(check::CheckArgs),
    /// A placement with replicas of the busiest experts from recorded load statistics,
    /// minimising the busiest rank's load (groups within a node first).
    Eplb(eplb::EplbArgs),
    /// Describe a Hugging Face MoE model directory (architecture, MoE layers, shapes, bytes).
    Inspect(inspect::InspectArgs),
    /// Run one MoE block of a Hugging Face checkpoint on hidden states from a safetensors file.
    Run(run::RunArgs),
    /// Predict the layer's time per stage for EP 1 to 256, NVLink domains and routings, with
    /// and without EPLB, from measured ceilings (`bench --calibrate`, or built-in GPU figures).
    Simulate(simulate::SimulateArgs),
    /// Start one process per GPU (RANK, WORLD_SIZE, ... set) running the moeflow command after `--`.
    Launch(launch::LaunchArgs),
}

fn main() {
    let cli = Cli::parse();
    let level = if cli.verbose { log::LevelFilter::Debug } else { log::LevelFilter::Warn };
    env_logger::Builder::new().filter_level(level).init();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Plot(args) => bench::plot_file(args),
        Command::Check(args) => check::run(args),
        Command::Eplb(args) => eplb::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Run(args) => run::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Launch(args) => launch::run(args),
    };
    output::flush_stdout();
    if let Err(e) = result {
        output::exit_with_error(&e);
    }
}
