//! The `moeflow` command line: `demo`, `bench`, `plot`, `check`, `inspect`, `run`, `launch`
//! (see `--help`).

mod bench;
mod check;
mod common;
mod demo;
mod inspect;
mod launch;
mod run;
mod table;

use clap::{Parser, Subcommand};

/// moeflow: the Mixture-of-Experts layer engine.
#[derive(Parser)]
#[command(name = "moeflow", version, about, long_about = None)]
struct Cli {
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
    /// Describe a Hugging Face MoE model directory (architecture, MoE layers, shapes, bytes).
    Inspect(inspect::InspectArgs),
    /// Run one MoE block of a Hugging Face checkpoint on hidden states from a safetensors file.
    Run(run::RunArgs),
    /// Start one process per GPU (RANK, WORLD_SIZE, ... set) running the moeflow command after `--`.
    Launch(launch::LaunchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Plot(args) => bench::plot_file(args),
        Command::Check(args) => check::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Run(args) => run::run(args),
        Command::Launch(args) => launch::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
