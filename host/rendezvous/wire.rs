//! The frame format of the socket rendezvous, std only. Integers are
//! little-endian. Every frame is a fixed 40-byte header, a payload and,
//! when the header says the frame is sealed, a 32-byte tag:
//!
//! ```text
//! offset size field
//!      0    8 magic     b"TPARDZV\0"
//!      8    2 version   VERSION (2)
//!     10    1 kind      see below
//!     11    1 flags     bit 0: sealed (a tag follows the payload); other bits 0
//!     12   16 job id    derived from the `Id`'s secret; frames of another job are refused
//!     28    4 sender    rank of the sender
//!     32    4 round     0 for the handshake and WELCOME, then 1, 2, ... per all_gather
//!     36    4 length    payload bytes, at most the reader's limit (<= MAX_PAYLOAD)
//!     40      payload
//! 40+len   32 tag       sealed frames only: HMAC-SHA256 under the connection's
//!                       key for this direction of (sequence number, header, payload)
//! ```
//!
//! | kind | code | from | sealed | payload |
//! |------|------|------|--------|---------|
//! | HELLO | 1 | member | no | world (u32), member nonce (32), HELLO tag (32) |
//! | WELCOME | 2 | rank 0 | yes | world (u32) |
//! | GATHER | 3 | member | yes | the member's bytes |
//! | RESULT | 4 | rank 0 | yes | count (u32), then per rank a length (u32) and the bytes |
//! | ABORT | 5 | any | after the handshake | code (u8), time waited (u64 ms), UTF-8 reason |
//! | CHALLENGE | 6 | rank 0 | no | world (u32), rank 0 nonce (32), CHALLENGE tag (32) |
//! | PROOF | 7 | member | no | PROOF tag (32) |
//!
//! What each tag covers is in `auth.rs`. An ABORT is sealed once the
//! connection has a session (both ends authenticated); before that it is
//! plain, and a member treats it as a claim by an unauthenticated peer.
//!
//! [`read_frame`] checks what a frame says about itself (magic, version,
//! kind, flags, length against the caller's limit) before it reads the
//! payload, and it grows the payload buffer as bytes arrive, so a length
//! field alone never makes it allocate. [`Frame::check`] checks the frame
//! against what the receiver expects (job, sender, kind, round); the
//! session's `Opener` checks a sealed frame's tag.

#![forbid(unsafe_code)]

use std::fmt;
use std::io::{self, Read};

use super::auth::{Nonce, Opener, Tag, NONCE_LEN, TAG_LEN};

pub(crate) const MAGIC: [u8; 8] = *b"TPARDZV\0";
pub(crate) const VERSION: u16 = 2;
pub(crate) const JOB_ID_LEN: usize = 16;
pub(crate) const HEADER_LEN: usize = 40;
const _: () = assert!(HEADER_LEN == MAGIC.len() + 2 + 1 + 1 + JOB_ID_LEN + 4 + 4 + 4);
/// Flag bit of a sealed frame (a tag follows the payload).
pub(crate) const FLAG_SEALED: u8 = 1;

/// Largest payload of any frame, and so the largest RESULT of one round.
pub(crate) const MAX_PAYLOAD: usize = 16 << 20;
const _: () = assert!(MAX_PAYLOAD <= u32::MAX as usize);

/// Payload of WELCOME: the world size.
pub(crate) const WORLD_PAYLOAD: usize = 4;
/// Payload of HELLO and of CHALLENGE: a world size, a nonce and a tag.
pub(crate) const HELLO_PAYLOAD: usize = 4 + NONCE_LEN + TAG_LEN;
/// Payload of PROOF: a tag.
pub(crate) const PROOF_PAYLOAD: usize = TAG_LEN;
/// The limit on a frame rank 0 reads during a handshake.
pub(crate) const HANDSHAKE_PAYLOAD: usize = HELLO_PAYLOAD;
const _: () = assert!(PROOF_PAYLOAD <= HANDSHAKE_PAYLOAD);

/// Longest ABORT reason sent or shown (longer ones are cut).
pub(crate) const MAX_REASON: usize = 4096;

/// Largest CHALLENGE, WELCOME or ABORT payload, the limit while joining.
pub(crate) const MAX_CONTROL_PAYLOAD: usize = 9 + MAX_REASON;
const _: () = assert!(HELLO_PAYLOAD <= MAX_CONTROL_PAYLOAD);

/// Bytes a RESULT spends on framing: the count, and a length per rank.
pub(crate) fn result_overhead(world: usize) -> usize {
    4 + 4 * world
}

/// Payload bytes are read in steps of this size, so memory follows the bytes
/// that actually arrive rather than the length the sender claimed.
const READ_STEP: usize = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Hello,
    Welcome,
    Gather,
    Result,
    Abort,
    Challenge,
    Proof,
}

impl Kind {
    pub(crate) fn code(self) -> u8 {
        match self {
            Kind::Hello => 1,
            Kind::Welcome => 2,
            Kind::Gather => 3,
            Kind::Result => 4,
            Kind::Abort => 5,
            Kind::Challenge => 6,
            Kind::Proof => 7,
        }
    }

    fn from_code(code: u8) -> Option<Kind> {
        Some(match code {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Gather,
            4 => Kind::Result,
            5 => Kind::Abort,
            6 => Kind::Challenge,
            7 => Kind::Proof,
            _ => return None,
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Hello => "HELLO",
            Kind::Welcome => "WELCOME",
            Kind::Gather => "GATHER",
            Kind::Result => "RESULT",
            Kind::Abort => "ABORT",
            Kind::Challenge => "CHALLENGE",
            Kind::Proof => "PROOF",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub sealed: bool,
    pub job: [u8; JOB_ID_LEN],
    pub sender: u32,
    pub round: u32,
    pub len: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    pub header: Header,
    /// The header as received: what a sealed frame's tag covers.
    pub raw_header: [u8; HEADER_LEN],
    pub payload: Vec<u8>,
    /// The tag of a sealed frame.
    pub tag: Option<Tag>,
}

/// Why a frame could not be read. The caller names the peer.
#[derive(Debug)]
pub(crate) enum WireError {
    /// End of stream before the first byte of a frame.
    Closed,
    /// End of stream inside a frame.
    Truncated {
        got: usize,
        want: usize,
    },
    /// The read deadline passed.
    TimedOut,
    Io(io::Error),
    BadMagic([u8; 8]),
    BadVersion(u16),
    BadKind(u8),
    BadFlags(u8),
    TooLong {
        len: usize,
        max: usize,
    },
    /// A frame that would take what rank 0 holds of one round's frames past
    /// the round limit.
    RoundTooLong {
        len: usize,
        held: usize,
        max: usize,
    },
    /// A plain frame where the session expects a sealed one.
    NotSealed(Kind),
    /// A sealed frame whose tag is not the next of this connection.
    BadTag(Kind),
}

impl WireError {
    /// The peer went away (rather than sent something wrong).
    pub(crate) fn is_disconnect(&self) -> bool {
        match self {
            WireError::Closed | WireError::Truncated { .. } => true,
            WireError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Closed => write!(f, "connection closed"),
            WireError::Truncated { got, want } => {
                write!(f, "connection closed inside a frame ({got} of {want} bytes)")
            }
            WireError::TimedOut => write!(f, "timed out"),
            WireError::Io(e) => write!(f, "{e}"),
            WireError::BadMagic(m) => write!(f, "not a rendezvous frame (magic {m:02x?})"),
            WireError::BadVersion(v) => {
                write!(f, "protocol version {v}, this build speaks {VERSION} (mixed tp-allreduce versions?)")
            }
            WireError::BadKind(k) => write!(f, "unknown frame kind {k}"),
            WireError::BadFlags(b) => write!(f, "unknown frame flags {b:#04x}"),
            WireError::TooLong { len, max } => write!(f, "frame length {len} exceeds the limit of {max} bytes"),
            WireError::RoundTooLong { len, held, max } => write!(
                f,
                "a frame of {len} bytes on top of the {held} bytes held of this round is over the rendezvous limit \
                 of {max} bytes per round"
            ),
            WireError::NotSealed(k) => write!(
                f,
                "{} frame without a tag, where every frame after the handshake is sealed (written by a process \
                 other than the authenticated peer?)",
                k.name()
            ),
            WireError::BadTag(k) => write!(
                f,
                "{} frame failed authentication: its tag is not this connection's next (altered in flight, \
                 replayed, or taken from another connection)",
                k.name()
            ),
        }
    }
}

/// One plain frame, header and payload, ready for a single `write_all` (one
/// buffer: `write_vectored` on a socket may raise SIGPIPE, `write` does not).
pub(crate) fn encode(
    kind: Kind,
    job: &[u8; JOB_ID_LEN],
    sender: u32,
    round: u32,
    payload: &[u8],
) -> Result<Vec<u8>, WireError> {
    encode_with(kind, 0, job, sender, round, payload)
}

/// A frame to be sealed: header (flagged sealed) and payload, with room
/// for the tag that `Sealer::seal` appends.
pub(crate) fn encode_unsealed_body(
    kind: Kind,
    job: &[u8; JOB_ID_LEN],
    sender: u32,
    round: u32,
    payload: &[u8],
) -> Result<Vec<u8>, WireError> {
    encode_with(kind, FLAG_SEALED, job, sender, round, payload)
}

fn encode_with(
    kind: Kind,
    flags: u8,
    job: &[u8; JOB_ID_LEN],
    sender: u32,
    round: u32,
    payload: &[u8],
) -> Result<Vec<u8>, WireError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(WireError::TooLong { len: payload.len(), max: MAX_PAYLOAD });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(kind.code());
    out.push(flags);
    out.extend_from_slice(job);
    out.extend_from_slice(&sender.to_le_bytes());
    out.extend_from_slice(&round.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Decodes and checks a header; `max_payload` is the reader's limit.
pub(crate) fn decode_header(b: &[u8; HEADER_LEN], max_payload: usize) -> Result<Header, WireError> {
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&b[0..8]);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16_at(b, 8);
    if version != VERSION {
        return Err(WireError::BadVersion(version));
    }
    let kind = Kind::from_code(b[10]).ok_or(WireError::BadKind(b[10]))?;
    if b[11] & !FLAG_SEALED != 0 {
        return Err(WireError::BadFlags(b[11]));
    }
    let sealed = b[11] & FLAG_SEALED != 0;
    let mut job = [0u8; JOB_ID_LEN];
    job.copy_from_slice(&b[12..28]);
    let len = u32_at(b, 36);
    let max = max_payload.min(MAX_PAYLOAD);
    if len as usize > max {
        return Err(WireError::TooLong { len: len as usize, max });
    }
    Ok(Header { kind, sealed, job, sender: u32_at(b, 28), round: u32_at(b, 32), len })
}

/// Reads into `buf` until it is full or the stream ends; returns the count.
fn fill(r: &mut impl Read, buf: &mut [u8]) -> Result<usize, WireError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(WireError::TimedOut)
            }
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(got)
}

/// Reads one frame whose payload is at most `max_payload` bytes (and its
/// tag, if sealed; the tag is checked by the receiver's session).
pub(crate) fn read_frame(r: &mut impl Read, max_payload: usize) -> Result<Frame, WireError> {
    read_frame_reserving(r, max_payload, |_| Ok(()))
}

/// [`read_frame`], where `reserve(len)` is asked, once the header is read
/// and before any of the payload is, whether `len` payload bytes may be
/// held; its error is the frame's.
pub(crate) fn read_frame_reserving(
    r: &mut impl Read,
    max_payload: usize,
    reserve: impl FnOnce(usize) -> Result<(), WireError>,
) -> Result<Frame, WireError> {
    let mut head = [0u8; HEADER_LEN];
    match fill(r, &mut head)? {
        0 => return Err(WireError::Closed),
        HEADER_LEN => {}
        got => return Err(WireError::Truncated { got, want: HEADER_LEN }),
    }
    let header = decode_header(&head, max_payload)?;
    let want = header.len as usize;
    reserve(want)?;
    let mut payload = Vec::with_capacity(want.min(READ_STEP));
    while payload.len() < want {
        let start = payload.len();
        let step = (want - start).min(READ_STEP);
        payload.resize(start + step, 0);
        let got = fill(r, &mut payload[start..])?;
        if got < step {
            return Err(WireError::Truncated { got: HEADER_LEN + start + got, want: HEADER_LEN + want });
        }
    }
    let tag = if header.sealed {
        let mut tag = [0u8; TAG_LEN];
        let got = fill(r, &mut tag)?;
        if got < TAG_LEN {
            return Err(WireError::Truncated { got: HEADER_LEN + want + got, want: HEADER_LEN + want + TAG_LEN });
        }
        Some(tag)
    } else {
        None
    };
    Ok(Frame { header, raw_header: head, payload, tag })
}

/// What a checked frame turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Checked {
    /// The expected kind, with its payload.
    Expected(Vec<u8>),
    /// The sender gave up; accepted in place of any expected kind.
    Aborted(Abort),
}

impl Frame {
    /// Checks a frame of an authenticated session: it must be sealed, and
    /// its tag the next one `opener` expects.
    pub(crate) fn open(&self, opener: &mut Opener) -> Result<(), WireError> {
        let tag = self.tag.ok_or(WireError::NotSealed(self.header.kind))?;
        match opener.open(&self.raw_header, &self.payload, &tag) {
            true => Ok(()),
            false => Err(WireError::BadTag(self.header.kind)),
        }
    }

    /// Checks the frame against what the receiver expects: this job, the
    /// rank the connection belongs to, the kind and the round. An ABORT from
    /// the right job and sender is accepted whatever the kind and round.
    pub(crate) fn check(
        self,
        job: &[u8; JOB_ID_LEN],
        sender: usize,
        kind: Kind,
        round: u32,
    ) -> Result<Checked, String> {
        let h = &self.header;
        if h.job != *job {
            return Err(format!("{} frame with a wrong job id (it belongs to another job)", h.kind.name()));
        }
        if h.sender as usize != sender {
            return Err(format!(
                "{} frame claims sender rank {} on the connection of rank {sender}",
                h.kind.name(),
                h.sender
            ));
        }
        if h.kind == Kind::Abort {
            return decode_abort(&self.payload).map(Checked::Aborted);
        }
        if h.kind != kind {
            return Err(format!("expected a {} frame, got {}", kind.name(), h.kind.name()));
        }
        if h.round != round {
            return Err(format!("{} frame for round {}, expected round {round}", kind.name(), h.round));
        }
        Ok(Checked::Expected(self.payload))
    }
}

pub(crate) fn encode_world(world: usize) -> [u8; WORLD_PAYLOAD] {
    (world as u32).to_le_bytes()
}

pub(crate) fn decode_world(p: &[u8]) -> Result<usize, String> {
    match p {
        [a, b, c, d] => Ok(u32::from_le_bytes([*a, *b, *c, *d]) as usize),
        _ => Err(format!("world-size payload of {} bytes, expected {WORLD_PAYLOAD}", p.len())),
    }
}

/// What HELLO and CHALLENGE carry: the sender's world size, its fresh
/// nonce, and its tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Greeting {
    pub world: u32,
    pub nonce: Nonce,
    pub tag: Tag,
}

pub(crate) fn encode_greeting(g: &Greeting) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_PAYLOAD);
    out.extend_from_slice(&g.world.to_le_bytes());
    out.extend_from_slice(&g.nonce);
    out.extend_from_slice(&g.tag);
    out
}

/// `kind` names the frame in the error.
pub(crate) fn decode_greeting(p: &[u8], kind: Kind) -> Result<Greeting, String> {
    if p.len() != HELLO_PAYLOAD {
        return Err(format!("{} payload of {} bytes, expected {HELLO_PAYLOAD}", kind.name(), p.len()));
    }
    let (mut nonce, mut tag) = ([0u8; NONCE_LEN], [0u8; TAG_LEN]);
    nonce.copy_from_slice(&p[4..4 + NONCE_LEN]);
    tag.copy_from_slice(&p[4 + NONCE_LEN..]);
    Ok(Greeting { world: u32_at(p, 0), nonce, tag })
}

pub(crate) fn decode_proof(p: &[u8]) -> Result<Tag, String> {
    p.try_into().map_err(|_| format!("PROOF payload of {} bytes, expected {PROOF_PAYLOAD}", p.len()))
}

/// Payload of a RESULT frame; the caller has checked the size against
/// [`MAX_PAYLOAD`] (see [`result_overhead`]).
pub(crate) fn encode_result(parts: &[Vec<u8>]) -> Vec<u8> {
    let total = result_overhead(parts.len()) + parts.iter().map(Vec::len).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for p in parts {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

pub(crate) fn decode_result(p: &[u8], world: usize) -> Result<Vec<Vec<u8>>, String> {
    let take_u32 = |p: &[u8], at: usize| -> Result<usize, String> {
        p.get(at..at + 4).map(|b| u32_at(b, 0) as usize).ok_or_else(|| format!("RESULT payload cut at byte {at}"))
    };
    let count = take_u32(p, 0)?;
    if count != world {
        return Err(format!("RESULT holds {count} contributions, expected {world}"));
    }
    let mut at = 4;
    let mut parts = Vec::with_capacity(world);
    for rank in 0..world {
        let len = take_u32(p, at)?;
        at += 4;
        let part = at
            .checked_add(len)
            .and_then(|end| p.get(at..end))
            .ok_or_else(|| format!("RESULT entry of rank {rank} ({len} bytes) runs past the payload"))?;
        parts.push(part.to_vec());
        at += len;
    }
    if at != p.len() {
        return Err(format!("RESULT payload has {} trailing bytes", p.len() - at));
    }
    Ok(parts)
}

/// Why a rank gave up, as carried by an ABORT frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AbortCode {
    /// A rank did not arrive in time (shown as a timeout on the receiver).
    Timeout,
    /// Rank 0 refused this connection at join (duplicate rank, wrong job...).
    Rejected,
    /// Any other failure (a peer left, a protocol violation, bad usage).
    Failed,
}

impl AbortCode {
    fn code(self) -> u8 {
        match self {
            AbortCode::Timeout => 1,
            AbortCode::Rejected => 2,
            AbortCode::Failed => 3,
        }
    }

    fn from_code(c: u8) -> AbortCode {
        match c {
            1 => AbortCode::Timeout,
            2 => AbortCode::Rejected,
            // Unknown codes from a newer peer are still an abort.
            _ => AbortCode::Failed,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Abort {
    pub code: AbortCode,
    pub waited_ms: u64,
    pub reason: String,
}

/// Cuts `s` to at most [`MAX_REASON`] bytes (on a char boundary) and
/// replaces control characters, so a peer's text is safe to print.
fn clean_reason(s: &str) -> String {
    let mut end = s.len().min(MAX_REASON);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

pub(crate) fn encode_abort(a: &Abort) -> Vec<u8> {
    let reason = clean_reason(&a.reason);
    let mut out = Vec::with_capacity(9 + reason.len());
    out.push(a.code.code());
    out.extend_from_slice(&a.waited_ms.to_le_bytes());
    out.extend_from_slice(reason.as_bytes());
    out
}

pub(crate) fn decode_abort(p: &[u8]) -> Result<Abort, String> {
    if p.len() < 9 {
        return Err(format!("ABORT payload of {} bytes, expected at least 9", p.len()));
    }
    let mut ms = [0u8; 8];
    ms.copy_from_slice(&p[1..9]);
    Ok(Abort {
        code: AbortCode::from_code(p[0]),
        waited_ms: u64::from_le_bytes(ms),
        reason: clean_reason(&String::from_utf8_lossy(&p[9..])),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOB: [u8; JOB_ID_LEN] = [7; JOB_ID_LEN];

    fn frame(kind: Kind, sender: u32, round: u32, payload: &[u8]) -> Vec<u8> {
        encode(kind, &JOB, sender, round, payload).unwrap()
    }

    #[test]
    fn frame_round_trip() {
        let bytes = frame(Kind::Gather, 3, 9, b"hello");
        assert_eq!(bytes.len(), HEADER_LEN + 5);
        let f = read_frame(&mut &bytes[..], 100).unwrap();
        assert_eq!(f.header, Header { kind: Kind::Gather, sealed: false, job: JOB, sender: 3, round: 9, len: 5 });
        assert_eq!((f.payload.as_slice(), f.tag), (&b"hello"[..], None));
        assert_eq!(&f.raw_header[..], &bytes[..HEADER_LEN]);
        // Pinned byte layout: little-endian fields at their offsets.
        assert_eq!(&bytes[0..8], b"TPARDZV\0");
        assert_eq!(&bytes[8..12], &[2, 0, 3, 0]);
        assert_eq!(&bytes[28..40], &[3, 0, 0, 0, 9, 0, 0, 0, 5, 0, 0, 0]);
        // A sealed frame: flag bit 0, and the 32-byte tag after the payload.
        let mut sealed = encode_unsealed_body(Kind::Result, &JOB, 0, 1, b"abc").unwrap();
        assert_eq!(sealed[11], FLAG_SEALED);
        sealed.extend_from_slice(&[0xCD; TAG_LEN]);
        let f = read_frame(&mut &sealed[..], 100).unwrap();
        assert!(f.header.sealed);
        assert_eq!((f.payload.as_slice(), f.tag), (&b"abc"[..], Some([0xCD; TAG_LEN])));
        assert!(matches!(
            read_frame(&mut &sealed[..sealed.len() - 1], 100),
            Err(WireError::Truncated { got: 74, want: 75 })
        ));
    }

    #[test]
    fn greetings_and_proofs_round_trip_and_are_checked() {
        let g = Greeting { world: 8, nonce: [3; NONCE_LEN], tag: [4; TAG_LEN] };
        let p = encode_greeting(&g);
        assert_eq!(p.len(), HELLO_PAYLOAD);
        assert_eq!(decode_greeting(&p, Kind::Hello), Ok(g));
        assert!(decode_greeting(&p[1..], Kind::Challenge).unwrap_err().contains("CHALLENGE payload of 67 bytes"));
        assert_eq!(decode_proof(&[5; TAG_LEN]), Ok([5; TAG_LEN]));
        assert!(decode_proof(&[5; 31]).unwrap_err().contains("PROOF payload of 31 bytes"));
    }

    #[test]
    fn two_frames_back_to_back_and_then_closed() {
        let mut bytes = frame(Kind::Welcome, 0, 0, &encode_world(4));
        bytes.extend(frame(Kind::Gather, 1, 1, &[]));
        let mut r = &bytes[..];
        assert_eq!(read_frame(&mut r, 64).unwrap().header.kind, Kind::Welcome);
        assert_eq!(read_frame(&mut r, 64).unwrap().payload, Vec::<u8>::new());
        assert!(matches!(read_frame(&mut r, 64), Err(WireError::Closed)));
    }

    #[test]
    fn malformed_frames_are_refused() {
        let good = frame(Kind::Gather, 1, 1, b"abc");
        let with = |at: usize, bytes: &[u8]| {
            let mut v = good.clone();
            v[at..at + bytes.len()].copy_from_slice(bytes);
            v
        };
        type Case = (&'static str, Vec<u8>, fn(&WireError) -> bool);
        let cases: Vec<Case> = vec![
            ("truncated header", good[..17].to_vec(), |e| matches!(e, WireError::Truncated { got: 17, want: 40 })),
            ("truncated payload", good[..41].to_vec(), |e| matches!(e, WireError::Truncated { got: 41, want: 43 })),
            ("bad magic", with(0, b"GARBAGE!"), |e| matches!(e, WireError::BadMagic(_))),
            ("old version", with(8, &1u16.to_le_bytes()), |e| matches!(e, WireError::BadVersion(1))),
            ("bad version", with(8, &3u16.to_le_bytes()), |e| matches!(e, WireError::BadVersion(3))),
            ("bad kind", with(10, &[99]), |e| matches!(e, WireError::BadKind(99))),
            ("kind zero", with(10, &[0]), |e| matches!(e, WireError::BadKind(0))),
            ("unknown flag", with(11, &[2]), |e| matches!(e, WireError::BadFlags(2))),
            ("over the reader's limit", with(36, &4u32.to_le_bytes()), |e| {
                matches!(e, WireError::TooLong { len: 4, max: 3 })
            }),
            ("huge length", with(36, &u32::MAX.to_le_bytes()), |e| matches!(e, WireError::TooLong { .. })),
            ("empty", Vec::new(), |e| matches!(e, WireError::Closed)),
        ];
        for (name, bytes, ok) in cases {
            let err = read_frame(&mut &bytes[..], 3).expect_err(name);
            assert!(ok(&err), "{name}: got {err:?}");
            assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn encode_refuses_oversized_payload() {
        let big = vec![0u8; MAX_PAYLOAD + 1];
        assert!(matches!(encode(Kind::Gather, &JOB, 0, 0, &big), Err(WireError::TooLong { .. })));
    }

    #[test]
    fn check_accepts_expected_and_refuses_the_rest() {
        let get = |bytes: Vec<u8>| read_frame(&mut &bytes[..], MAX_PAYLOAD).unwrap();
        let ok = get(frame(Kind::Gather, 2, 5, b"x")).check(&JOB, 2, Kind::Gather, 5);
        assert_eq!(ok, Ok(Checked::Expected(b"x".to_vec())));

        let err = |f: Frame| f.check(&JOB, 2, Kind::Gather, 5).unwrap_err();
        assert!(err(get(frame(Kind::Gather, 3, 5, b""))).contains("sender rank 3"));
        assert!(err(get(frame(Kind::Gather, 2, 6, b""))).contains("round 6"));
        assert!(err(get(frame(Kind::Result, 2, 5, b""))).contains("expected a GATHER"));
        let foreign = encode(Kind::Gather, &[1; 16], 2, 5, b"").unwrap();
        assert!(err(get(foreign)).contains("wrong job id"));

        let abort = Abort { code: AbortCode::Timeout, waited_ms: 1500, reason: "ranks [2] late".into() };
        let f = get(frame(Kind::Abort, 2, 77, &encode_abort(&abort)));
        assert_eq!(f.check(&JOB, 2, Kind::Gather, 5), Ok(Checked::Aborted(abort)));
        assert!(err(get(frame(Kind::Abort, 2, 5, b"short"))).contains("ABORT payload"));
    }

    #[test]
    fn result_payload_round_trip_and_validation() {
        let parts = vec![b"zero".to_vec(), Vec::new(), vec![9; 1000]];
        let p = encode_result(&parts);
        assert_eq!(p.len(), result_overhead(3) + 1004);
        assert_eq!(decode_result(&p, 3).unwrap(), parts);
        assert!(decode_result(&p, 4).unwrap_err().contains("expected 4"));
        assert!(decode_result(&p[..p.len() - 1], 3).unwrap_err().contains("runs past"));
        let mut trailing = p.clone();
        trailing.push(0);
        assert!(decode_result(&trailing, 3).unwrap_err().contains("trailing"));
        assert!(decode_result(&[1, 0], 1).unwrap_err().contains("cut"));
        let mut lying = encode_result(&[b"ab".to_vec()]);
        lying[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_result(&lying, 1).is_err());
    }

    #[test]
    fn abort_reason_is_cut_and_cleaned() {
        let a =
            Abort { code: AbortCode::Rejected, waited_ms: 0, reason: format!("bad\n\x1b[31m{}", "é".repeat(5000)) };
        let back = decode_abort(&encode_abort(&a)).unwrap();
        assert_eq!(back.code, AbortCode::Rejected);
        assert!(back.reason.len() <= MAX_REASON);
        assert!(back.reason.starts_with("bad??[31mé"));
        assert!(!back.reason.chars().any(char::is_control));
        assert_eq!(decode_abort(&[200, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap().code, AbortCode::Failed);
    }

    #[test]
    fn world_payload() {
        assert_eq!(decode_world(&encode_world(8)), Ok(8));
        assert!(decode_world(&[1, 2, 3]).is_err());
    }
}
