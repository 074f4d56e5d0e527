//! The integration-test binary (one for the whole crate).

mod ptx;
