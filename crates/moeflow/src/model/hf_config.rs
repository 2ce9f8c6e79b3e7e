//! Typed access to a Hugging Face `config.json`, with errors that name the missing key.

use crate::error::{MoeError, Result};
use serde_json::Value;

/// A parsed `config.json`.
#[derive(Clone, Debug)]
pub struct HfConfig {
    /// The raw JSON.
    pub json: Value,
    /// `model_type`.
    pub model_type: String,
}

impl HfConfig {
    /// Parses `text` (the contents of `config.json`).
    pub fn parse(text: &str, path: &str) -> Result<Self> {
        let json: Value =
            serde_json::from_str(text).map_err(|e| MoeError::Json { context: format!("parsing {path}"), source: e })?;
        if !json.is_object() {
            return Err(MoeError::Format(format!("{path}: not a JSON object")));
        }
        let model_type = match json.get("model_type") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                return Err(MoeError::Format(format!("{path}: no 'model_type' (the model family, e.g. \"mixtral\")")))
            }
            Some(v) => return Err(MoeError::Format(format!("{path}: 'model_type' is {v}, not a string"))),
        };
        Ok(HfConfig { json, model_type })
    }

    fn missing(&self, key: &str) -> MoeError {
        MoeError::Config(format!("config.json ({}): missing or invalid '{key}'", self.model_type))
    }

    /// A required non-negative integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.json.get(key).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| self.missing(key))
    }

    /// The first of `keys` present (configs name some fields differently across versions).
    pub fn usize_any(&self, keys: &[&str]) -> Result<usize> {
        keys.iter()
            .find_map(|k| self.json.get(*k).and_then(Value::as_u64))
            .map(|v| v as usize)
            .ok_or_else(|| self.missing(&keys.join("' or '")))
    }

    /// An optional non-negative integer (absent or null: `default`).
    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_u64().map(|v| v as usize).ok_or_else(|| self.missing(key)),
        }
    }

    /// An optional number.
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.missing(key)),
        }
    }

    /// An optional boolean.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.missing(key)),
        }
    }

    /// An optional string.
    pub fn str_or<'a>(&'a self, key: &str, default: &'a str) -> Result<&'a str> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_str().ok_or_else(|| self.missing(key)),
        }
    }

    /// An optional list of integers.
    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => {
                a.iter().map(|v| v.as_u64().map(|v| v as usize).ok_or_else(|| self.missing(key))).collect()
            }
            Some(_) => Err(self.missing(key)),
        }
    }
}
