//! What the SASS of a sentinel kernel does before its first peer store:
//! instructions in program order up to the first system-scope 128-bit store
//! (`STG.E.128.STRONG.SYS`, the first push), and how many global loads and
//! block barriers come before it. Static counts: branches to the tail and
//! misaligned paths that come earlier in program order are included, so the
//! executed path on aligned data is shorter.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// The path from entry to the first peer store of one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirstPeerStore {
    /// SASS instructions before the store, in program order.
    pub instructions: u32,
    /// `LDG` instructions among them.
    pub global_loads: u32,
    /// `BAR` instructions among them.
    pub barriers: u32,
}

/// `true` for a SASS instruction line (`/*0a70*/  OPCODE ...`).
fn instruction(line: &str) -> Option<&str> {
    let t = line.trim_start();
    let rest = t.strip_prefix("/*")?;
    let (addr, body) = rest.split_once("*/")?;
    addr.chars().all(|c| c.is_ascii_hexdigit()).then_some(body.trim())
}

/// The path to the first `STG.E.128.STRONG.SYS` in `sass` (one function),
/// `None` when there is none.
pub fn first_peer_store(sass: &str) -> Option<FirstPeerStore> {
    let mut path = FirstPeerStore { instructions: 0, global_loads: 0, barriers: 0 };
    for line in sass.lines() {
        let Some(body) = instruction(line) else { continue };
        // Strip a predicate (`@P0 `, `@!P1 `).
        let op = body.strip_prefix('@').map_or(body, |b| b.split_once(' ').map_or(b, |(_, r)| r.trim_start()));
        if op.starts_with("STG.E.128.STRONG.SYS") {
            return Some(path);
        }
        path.instructions += 1;
        if op.starts_with("LDG") {
            path.global_loads += 1;
        }
        if op.starts_with("BAR") {
            path.barriers += 1;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_up_to_the_first_system_scope_vector_store() {
        let sass = "\
.text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.64.STRONG.GPU R30, desc[UR10][R30.64] ;
        /*0020*/               @P4 LDG.E.U16 R8, desc[UR10][R6.64] ;
.L_x_1:
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   STG.E.128 desc[UR10][R2.64], R4 ;
        /*0050*/                   STG.E.128.STRONG.SYS desc[UR10][R8.64], R4 ;
        /*0060*/                   EXIT ;
";
        assert_eq!(first_peer_store(sass), Some(FirstPeerStore { instructions: 5, global_loads: 2, barriers: 1 }));
        assert_eq!(first_peer_store("        /*0000*/ EXIT ;\n"), None);
    }
}
