//! The measured-`auto` mode: a leaf (the environment layer, `env.rs`,
//! parses it without depending on the selection).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Whether and how much a communicator measures at start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AutoMeasure {
    /// The cost model (or a `tune` table) decides; nothing is measured.
    /// The default until measured `auto` has run on a GPU (it has only run
    /// in CPU tests so far).
    #[default]
    Off,
    /// The bounded default sweep (`Sweep::for_mode`).
    On,
    /// Every applicable algorithm at every `tune` size, more replays.
    Full,
}

impl AutoMeasure {
    pub fn name(self) -> &'static str {
        match self {
            AutoMeasure::Off => "off",
            AutoMeasure::On => "on",
            AutoMeasure::Full => "full",
        }
    }
}

impl fmt::Display for AutoMeasure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AutoMeasure {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<AutoMeasure, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "model" => Ok(AutoMeasure::Off),
            "on" | "1" | "" => Ok(AutoMeasure::On),
            "full" => Ok(AutoMeasure::Full),
            other => Err(format!("`{other}`: expected off, on or full")),
        }
    }
}

