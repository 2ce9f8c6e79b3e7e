//! The CUDA layer's options at the command line's edge: the `MOEFLOW_*` variables, read here
//! and nowhere else (the library takes [`CudaOptions`] typed).

use moeflow::backend::cuda::CudaOptions;
use moeflow::backend::cuda_options::CUDA_VARIABLES;
use moeflow::Result;

/// The options the `MOEFLOW_*` variables of this process set (a clear error naming a
/// variable whose value is not one it takes), deterministic where `--deterministic` asks for
/// it, with the `--transport` of `par`.
pub fn cuda_options(par: &crate::common::ParallelArgs) -> Result<CudaOptions> {
    let mut o = CudaOptions::from_vars(std::env::vars())?;
    o.deterministic |= par.deterministic;
    o.transport = par.transport;
    Ok(o)
}

/// The variables for `--help`.
pub fn variables_help() -> String {
    let mut s = String::from("Environment (GPU layers):\n");
    for (name, what) in CUDA_VARIABLES {
        s += &format!("  {name:<24} {what}\n");
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn help_names_every_variable() {
        let help = super::variables_help();
        for (name, _) in moeflow::backend::cuda_options::CUDA_VARIABLES {
            assert!(help.contains(name), "{name}");
        }
    }
}
