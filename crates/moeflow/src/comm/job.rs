//! The identity of a multi-process job: a token every connection between its ranks presents
//! (rendezvous, liveness channel, TCP mesh), so that a process of another job that reaches the
//! same port is told apart and refused instead of joining.

use crate::error::{MoeError, Result};
use std::fmt;
use std::str::FromStr;

/// Longest job token, in bytes.
pub const MAX_JOB_LEN: usize = 64;

/// A job token: 1 to [`MAX_JOB_LEN`] ASCII letters, digits, `-`, `_`, `.` or `:`. A launcher
/// passes the same token to every rank; without one, rank 0 draws a random token and hands it
/// to the others in the rendezvous.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JobId(String);

impl JobId {
    /// The token `s`, or an error naming what is wrong with it.
    pub fn new(s: &str) -> Result<JobId> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.:".contains(c);
        if s.is_empty() || s.len() > MAX_JOB_LEN {
            return Err(MoeError::Config(format!("job token {s:?} must be 1 to {MAX_JOB_LEN} characters")));
        }
        if let Some(c) = s.chars().find(|&c| !allowed(c)) {
            return Err(MoeError::Config(format!(
                "job token {s:?} contains {c:?}; use ASCII letters, digits, '-', '_', '.' or ':'"
            )));
        }
        Ok(JobId(s.to_string()))
    }

    /// A fresh random token (128 bits, as 32 hex digits).
    pub fn random() -> JobId {
        JobId(format!("{:032x}", rand::random::<u128>()))
    }

    /// The token's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for JobId {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<JobId> {
        JobId::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_random_ones_differ() {
        assert_eq!(JobId::new("train-7.a:b_c").unwrap().as_str(), "train-7.a:b_c");
        assert!(JobId::new("").unwrap_err().to_string().contains("1 to 64"));
        assert!(JobId::new(&"x".repeat(65)).is_err());
        assert!(JobId::new("a b").unwrap_err().to_string().contains("' '"));
        let (a, b) = (JobId::random(), JobId::random());
        assert!(a != b && a.as_str().len() == 32 && JobId::new(a.as_str()).is_ok());
    }
}
