//! Authentication of the socket rendezvous: HMAC-SHA256 keyed by the 128-bit
//! secret of the [`Id`](super::Id), which travels out of band and never on
//! a socket. See the handshake in the module docs; this file holds the
//! MACs, what each one covers, and the per-connection sealing of frames.
//!
//! Every MAC starts with a label of its own, so that no tag made for one
//! purpose passes for another: a member's proof is no challenge, a frame
//! rank 0 sent is no frame from a member (reflection), a HELLO tag is no
//! proof. Tags are compared in constant time (`verify_slice`).

#![forbid(unsafe_code)]

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::Result;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of the secret an `Id` carries.
pub(crate) const SECRET_LEN: usize = 16;
/// Bytes of each side's fresh random nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of every tag (a whole HMAC-SHA256).
pub(crate) const TAG_LEN: usize = 32;

pub(crate) type Secret = [u8; SECRET_LEN];
pub(crate) type Nonce = [u8; NONCE_LEN];
pub(crate) type Tag = [u8; TAG_LEN];

const JOB_LABEL: &[u8] = b"tp-allreduce rendezvous 2: job id";
const HELLO_LABEL: &[u8] = b"tp-allreduce rendezvous 2: HELLO of a member";
const CHALLENGE_LABEL: &[u8] = b"tp-allreduce rendezvous 2: CHALLENGE of rank 0";
const PROOF_LABEL: &[u8] = b"tp-allreduce rendezvous 2: PROOF of a member";
const SESSION_LABEL: &[u8] = b"tp-allreduce rendezvous 2: session key";
const UP_LABEL: &[u8] = b"frames from the member to rank 0";
const DOWN_LABEL: &[u8] = b"frames from rank 0 to the member";

/// HMAC-SHA256 under `key` over `parts`, in order. Keys up to SHA-256's
/// 64-byte block are zero-padded to it, as HMAC does (RFC 2104), which
/// makes the key type fixed and the construction infallible; every key here
/// is a secret (16 bytes) or a session key (32).
fn hmac<const N: usize>(key: &[u8; N], parts: &[&[u8]]) -> HmacSha256 {
    const { assert!(N <= 64) };
    let mut block = [0u8; 64];
    block[..N].copy_from_slice(key);
    let mut m = <HmacSha256 as KeyInit>::new(&block.into());
    for p in parts {
        m.update(p);
    }
    m
}

fn tag<const N: usize>(key: &[u8; N], parts: &[&[u8]]) -> Tag {
    hmac(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the MAC of `parts` under `key`, compared in constant time.
fn verify<const N: usize>(key: &[u8; N], parts: &[&[u8]], tag: &[u8]) -> bool {
    hmac(key, parts).verify_slice(tag).is_ok()
}

/// A new secret or nonce from the OS random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    super::random_bytes::<N>()
}

/// The job id every frame carries, derived from the secret: public (it
/// travels in the clear), and it tells nothing about the secret.
pub(crate) fn job_id(secret: &Secret) -> [u8; 16] {
    let mut job = [0u8; 16];
    job.copy_from_slice(&tag(secret, &[JOB_LABEL])[..16]);
    job
}

/// What a member says in its HELLO, and the MAC over it that shows rank 0,
/// before anything else, that the sender holds the secret (a replay of a
/// recorded HELLO still gets no further than the PROOF).
pub(crate) fn hello_tag(secret: &Secret, job: &[u8; 16], rank: u32, world: u32, nonce: &Nonce) -> Tag {
    tag(secret, &[HELLO_LABEL, job, &rank.to_le_bytes(), &world.to_le_bytes(), nonce])
}

pub(crate) fn hello_tag_ok(secret: &Secret, job: &[u8; 16], rank: u32, world: u32, nonce: &Nonce, t: &[u8]) -> bool {
    verify(secret, &[HELLO_LABEL, job, &rank.to_le_bytes(), &world.to_le_bytes(), nonce], t)
}

/// Everything the two ends of one connection said in the handshake, in
/// order: the member's HELLO (job, rank, world, nonce), then rank 0's
/// CHALLENGE (world, nonce). The CHALLENGE, the PROOF and the session keys
/// all cover it whole, so nothing in it can be changed or spliced in from
/// another connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Transcript {
    pub job: [u8; 16],
    pub rank: u32,
    pub member_world: u32,
    pub member_nonce: Nonce,
    pub root_world: u32,
    pub root_nonce: Nonce,
}

impl Transcript {
    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + 4 + 4 + NONCE_LEN + 4 + NONCE_LEN);
        b.extend_from_slice(&self.job);
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.member_world.to_le_bytes());
        b.extend_from_slice(&self.member_nonce);
        b.extend_from_slice(&self.root_world.to_le_bytes());
        b.extend_from_slice(&self.root_nonce);
        b
    }

    /// Rank 0's proof that it holds the secret, over the member's fresh
    /// nonce: a process without the secret cannot answer a HELLO.
    pub(crate) fn challenge_tag(&self, secret: &Secret) -> Tag {
        tag(secret, &[CHALLENGE_LABEL, &self.bytes()])
    }

    pub(crate) fn challenge_tag_ok(&self, secret: &Secret, t: &[u8]) -> bool {
        verify(secret, &[CHALLENGE_LABEL, &self.bytes()], t)
    }

    /// The member's proof, over rank 0's fresh nonce: a recorded PROOF
    /// answers no other CHALLENGE.
    pub(crate) fn proof_tag(&self, secret: &Secret) -> Tag {
        tag(secret, &[PROOF_LABEL, &self.bytes()])
    }

    pub(crate) fn proof_tag_ok(&self, secret: &Secret, t: &[u8]) -> bool {
        verify(secret, &[PROOF_LABEL, &self.bytes()], t)
    }

    /// The keys that seal every later frame of this connection, one per
    /// direction: (what `role` sends with, what it receives with).
    pub(crate) fn session(&self, secret: &Secret, role: Role) -> (Sealer, Opener) {
        let session = tag(secret, &[SESSION_LABEL, &self.bytes()]);
        let up = tag(&session, &[UP_LABEL]);
        let down = tag(&session, &[DOWN_LABEL]);
        let (send, recv) = match role {
            Role::Member => (up, down),
            Role::Root => (down, up),
        };
        (Sealer { key: send, seq: 0 }, Opener { key: recv, seq: 0 })
    }
}

/// Which end of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Member,
    Root,
}

/// Seals the frames one end sends on one connection: each tag covers a
/// sequence number (0, 1, 2... per direction, never sent), the header and
/// the payload, under this direction's session key.
pub(crate) struct Sealer {
    key: Tag,
    seq: u64,
}

impl Sealer {
    /// The tag of the next frame, `frame` being its header (flagged sealed)
    /// and payload; the frame goes out as `frame` then the tag.
    pub(crate) fn tag(&mut self, frame: &[u8]) -> Tag {
        let t = tag(&self.key, &[&self.seq.to_le_bytes(), frame]);
        self.seq += 1;
        t
    }

    /// `frame` with its tag appended.
    pub(crate) fn seal(&mut self, mut frame: Vec<u8>) -> Vec<u8> {
        let t = self.tag(&frame);
        frame.extend_from_slice(&t);
        frame
    }
}

/// Checks the frames one end receives on one connection, in order.
pub(crate) struct Opener {
    key: Tag,
    seq: u64,
}

impl Opener {
    /// Whether `tag` seals `header` + `payload` as the next frame of this
    /// connection; moves on to the next frame only if so (after a bad tag
    /// the connection is dropped anyway).
    pub(crate) fn open(&mut self, header: &[u8], payload: &[u8], tag: &[u8]) -> bool {
        let ok = verify(&self.key, &[&self.seq.to_le_bytes(), header, payload], tag);
        if ok {
            self.seq += 1;
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: Secret = [9; SECRET_LEN];

    fn transcript() -> Transcript {
        Transcript {
            job: job_id(&SECRET),
            rank: 2,
            member_world: 4,
            member_nonce: [1; NONCE_LEN],
            root_world: 4,
            root_nonce: [2; NONCE_LEN],
        }
    }

    /// HMAC-SHA256 itself, against RFC 4231 test case 2.
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let t = tag(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(super::super::hex(&t), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // Test case 1: a 20-byte key.
        let t = tag(&[0x0b; 20], &[b"Hi There"]);
        let want = "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7";
        assert_eq!(super::super::hex(&t), want);
        let t = tag(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        assert_eq!(super::super::hex(&t), want);
    }

    #[test]
    fn job_id_depends_on_the_secret_only() {
        assert_eq!(job_id(&SECRET), job_id(&SECRET));
        assert_ne!(job_id(&SECRET), job_id(&[8; SECRET_LEN]));
        assert_ne!(&job_id(&SECRET)[..], &SECRET[..]);
    }

    /// Each tag verifies only for its own purpose, secret and transcript.
    #[test]
    fn tags_do_not_pass_for_one_another() {
        let t = transcript();
        let (c, p) = (t.challenge_tag(&SECRET), t.proof_tag(&SECRET));
        assert!(t.challenge_tag_ok(&SECRET, &c) && t.proof_tag_ok(&SECRET, &p));
        assert!(!t.challenge_tag_ok(&SECRET, &p), "a proof passed for a challenge");
        assert!(!t.proof_tag_ok(&SECRET, &c), "a challenge passed for a proof");
        assert!(!t.challenge_tag_ok(&[8; SECRET_LEN], &c), "another secret");
        let changes: [fn(&mut Transcript); 6] = [
            |t| t.job[0] ^= 1,
            |t| t.rank += 1,
            |t| t.member_world += 1,
            |t| t.member_nonce[31] ^= 1,
            |t| t.root_world += 1,
            |t| t.root_nonce[0] ^= 1,
        ];
        for change in changes {
            let mut other = t;
            change(&mut other);
            assert!(!other.challenge_tag_ok(&SECRET, &c) && !other.proof_tag_ok(&SECRET, &p), "{other:?}");
        }
        let h = hello_tag(&SECRET, &t.job, 2, 4, &t.member_nonce);
        assert!(hello_tag_ok(&SECRET, &t.job, 2, 4, &t.member_nonce, &h));
        assert!(!hello_tag_ok(&SECRET, &t.job, 3, 4, &t.member_nonce, &h));
        assert!(!t.proof_tag_ok(&SECRET, &h));
        assert!(!hello_tag_ok(&SECRET, &t.job, 2, 4, &t.member_nonce, &h[..31]), "a cut tag");
    }

    /// Sealed frames open only in order, in their direction, on their own
    /// connection, unaltered.
    #[test]
    fn sealed_frames_open_once_in_order_in_their_direction() {
        let t = transcript();
        let (mut m_send, mut m_recv) = t.session(&SECRET, Role::Member);
        let (mut r_send, mut r_recv) = t.session(&SECRET, Role::Root);
        let (a, b) = (b"header-a payload-a".to_vec(), b"header-b payload-b".to_vec());
        let (ta, tb) = (m_send.tag(&a), m_send.tag(&b));
        assert!(!r_recv.open(&b[..7], &b[7..], &tb), "second frame first");
        assert!(!m_recv.open(&a[..7], &a[7..], &ta), "reflected to its sender");
        let mut altered = a.clone();
        altered[9] ^= 1;
        assert!(!r_recv.open(&altered[..7], &altered[7..], &ta), "altered");
        assert!(r_recv.open(&a[..7], &a[7..], &ta));
        assert!(!r_recv.open(&a[..7], &a[7..], &ta), "replayed");
        assert!(r_recv.open(&b[..7], &b[7..], &tb));
        let down = r_send.seal(a.clone());
        assert!(m_recv.open(&down[..7], &down[7..a.len()], &down[a.len()..]));
        let mut other = t;
        other.root_nonce[5] ^= 1;
        let (_, mut elsewhere) = other.session(&SECRET, Role::Root);
        let mut fresh = t.session(&SECRET, Role::Member).0;
        assert!(!elsewhere.open(&a[..7], &a[7..], &fresh.tag(&a)), "another connection's frame");
    }
}
