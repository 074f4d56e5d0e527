//! The rendezvous wire format: a fixed 40-byte header, then the payload.
//!
//! ```text
//!   magic   [u8; 8]  b"TPARDZV\0"
//!   version u16      PROTOCOL_VERSION
//!   kind    u16      Hello | Welcome | Gather | Result | Abort | Reject
//!   job     [u8; 16] the communicator's job id (from the Id)
//!   sender  u32      the sender's rank
//!   round   u32      all-gather round (0 for hello/welcome)
//!   length  u32      payload bytes (<= MAX_PAYLOAD)
//! ```
//! All integers little-endian. Every field is checked on receipt; a length
//! is checked before anything is allocated for it.

use std::io::{Read, Write};

pub const MAGIC: [u8; 8] = *b"TPARDZV\0";
pub const PROTOCOL_VERSION: u16 = 1;
pub const HEADER_BYTES: usize = 40;
/// Largest payload of any frame (a result frame carries every rank's
/// contribution, each limited to `MAX_CONTRIBUTION`).
pub const MAX_PAYLOAD: usize = 64 << 20;
/// Largest contribution of one rank to an all-gather.
pub const MAX_CONTRIBUTION: usize = 4 << 20;

#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hello = 1,
    Welcome = 2,
    Gather = 3,
    Result = 4,
    Abort = 5,
    Reject = 6,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Gather,
            4 => Kind::Result,
            5 => Kind::Abort,
            6 => Kind::Reject,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub job: [u8; 16],
    pub sender: u32,
    pub round: u32,
    pub payload: Vec<u8>,
}

/// Why a frame was refused.
#[derive(Debug)]
pub enum WireError {
    /// The connection closed (cleanly or not) before a whole frame arrived.
    Closed,
    /// The read or write timed out.
    TimedOut,
    Io(std::io::Error),
    /// The bytes are not a valid frame of this protocol and job.
    Invalid(String),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Closed => f.write_str("connection closed"),
            WireError::TimedOut => f.write_str("timed out"),
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Invalid(w) => f.write_str(w),
        }
    }
}

fn io_err(e: std::io::Error) -> WireError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => WireError::Closed,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => WireError::TimedOut,
        _ => WireError::Io(e),
    }
}

pub fn encode(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + frame.payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&(frame.kind as u16).to_le_bytes());
    out.extend_from_slice(&frame.job);
    out.extend_from_slice(&frame.sender.to_le_bytes());
    out.extend_from_slice(&frame.round.to_le_bytes());
    out.extend_from_slice(&(frame.payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&frame.payload);
    out
}

pub fn write_frame(w: &mut impl Write, frame: &Frame) -> Result<(), WireError> {
    w.write_all(&encode(frame)).map_err(io_err)?;
    w.flush().map_err(io_err)
}

/// Reads one frame and checks magic, version, kind, job and length.
pub fn read_frame(r: &mut impl Read, job: &[u8; 16]) -> Result<Frame, WireError> {
    let mut h = [0u8; HEADER_BYTES];
    r.read_exact(&mut h).map_err(io_err)?;
    if h[0..8] != MAGIC {
        return Err(WireError::Invalid("bad magic (not a tp-allreduce rendezvous peer)".into()));
    }
    let version = u16::from_le_bytes([h[8], h[9]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::Invalid(format!("protocol version {version}, expected {PROTOCOL_VERSION}")));
    }
    let kind = Kind::from_u16(u16::from_le_bytes([h[10], h[11]]))
        .ok_or_else(|| WireError::Invalid(format!("unknown frame kind {}", u16::from_le_bytes([h[10], h[11]]))))?;
    let mut frame_job = [0u8; 16];
    frame_job.copy_from_slice(&h[12..28]);
    if &frame_job != job {
        return Err(WireError::Invalid("job id mismatch (a process of another job)".into()));
    }
    let sender = u32::from_le_bytes([h[28], h[29], h[30], h[31]]);
    let round = u32::from_le_bytes([h[32], h[33], h[34], h[35]]);
    let len = u32::from_le_bytes([h[36], h[37], h[38], h[39]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError::Invalid(format!("payload of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit")));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).map_err(io_err)?;
    Ok(Frame { kind, job: frame_job, sender, round, payload })
}

/// A result payload: every contribution, each prefixed by its u32 length.
pub fn encode_contributions(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 4).sum());
    for p in parts {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// Parses exactly `world` length-prefixed contributions.
pub fn decode_contributions(bytes: &[u8], world: usize) -> Result<Vec<Vec<u8>>, WireError> {
    let mut out = Vec::with_capacity(world);
    let mut at = 0usize;
    for r in 0..world {
        let Some(head) = bytes.get(at..at + 4) else {
            return Err(WireError::Invalid(format!("result truncated before rank {r}'s contribution")));
        };
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        at += 4;
        let Some(body) = bytes.get(at..at + len) else {
            return Err(WireError::Invalid(format!("rank {r}'s contribution is truncated")));
        };
        out.push(body.to_vec());
        at += len;
    }
    if at != bytes.len() {
        return Err(WireError::Invalid("trailing bytes after the last contribution".into()));
    }
    Ok(out)
}
