pub mod backend;
pub mod dtype;
pub mod error;
pub mod router;
pub mod tensor;
