//! The all-gather's escape of the "not arrived" word (shared by the host's
//! tests and the device's `device/all_gather_push.rs`).
//!
//! A receive slot word equal to [`SENTINEL_EMPTY_WORD`] means "not arrived",
//! so a payload word with that value cannot travel as itself. An allreduce
//! canonicalises it (an all-ones element is a NaN; its sum is a NaN anyway).
//! An all-gather is a copy, so instead every EMPTY and
//! [`ALL_GATHER_ESCAPE_WORD`] word of a pack travels as ESCAPE, and the
//! pack's escape word, the mask of which of its words were EMPTY, tells them
//! apart at the receiver. The mask is at most 15: never EMPTY itself, so it
//! travels in a slot word with the same EMPTY-until-written protocol.

use crate::layout::{ALL_GATHER_ESCAPE_WORD, SENTINEL_EMPTY_WORD};

/// Four 32-bit words: one 16-byte pack.
pub type Words = [u32; 4];

/// The pack as it travels, and its escape word (the mask of its EMPTY
/// words), or `None` when no word was escaped (no escape word is sent).
#[inline(always)]
pub fn escape(pack: Words) -> (Words, Option<u32>) {
    let mut out = pack;
    let mut escaped = false;
    let mut mask = 0u32;
    let mut k = 0;
    while k < 4 {
        let word = out[k];
        if word == SENTINEL_EMPTY_WORD || word == ALL_GATHER_ESCAPE_WORD {
            escaped = true;
            mask |= ((word == SENTINEL_EMPTY_WORD) as u32) << k;
            out[k] = ALL_GATHER_ESCAPE_WORD;
        }
        k += 1;
    }
    (out, if escaped { Some(mask) } else { None })
}

/// Whether a pack as it arrived has escaped words (an escape word follows).
#[inline(always)]
pub fn any_escaped(pack: &Words) -> bool {
    pack[0] == ALL_GATHER_ESCAPE_WORD
        || pack[1] == ALL_GATHER_ESCAPE_WORD
        || pack[2] == ALL_GATHER_ESCAPE_WORD
        || pack[3] == ALL_GATHER_ESCAPE_WORD
}

/// The words of an arrived pack as they were sent: the ESCAPE words whose
/// bit in the escape word's `mask` is set were EMPTY.
#[inline(always)]
pub fn unescape(pack: Words, mask: u32) -> Words {
    let mut out = pack;
    let mut k = 0;
    while k < 4 {
        if out[k] == ALL_GATHER_ESCAPE_WORD && mask & (1 << k) != 0 {
            out[k] = SENTINEL_EMPTY_WORD;
        }
        k += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every combination of the word classes that matter (EMPTY, ESCAPE,
    /// a half of all ones, an ordinary word) in the four positions: the
    /// pack travels without an EMPTY word, the escape word is sent exactly
    /// when needed and is never EMPTY, and the receiver gets every bit back.
    #[test]
    fn every_pack_travels_without_empty_words_and_arrives_unchanged() {
        let classes =
            [SENTINEL_EMPTY_WORD, ALL_GATHER_ESCAPE_WORD, 0x0000_FFFF, 0xFFFF_0000, 0x7FC0_0000, 0, 0x1234_5678];
        let n = classes.len();
        let mut checked = 0;
        for code in 0..n.pow(4) {
            let mut pack = [0u32; 4];
            let mut c = code;
            for w in pack.iter_mut() {
                *w = classes[c % n];
                c /= n;
            }
            let (sent, mask) = escape(pack);
            assert!(!sent.contains(&SENTINEL_EMPTY_WORD), "{pack:x?} sent as {sent:x?}");
            let needs = pack.iter().any(|&w| w == SENTINEL_EMPTY_WORD || w == ALL_GATHER_ESCAPE_WORD);
            assert_eq!(mask.is_some(), needs, "{pack:x?}");
            assert_eq!(any_escaped(&sent), needs, "{pack:x?}");
            let mask = mask.unwrap_or(0);
            assert!(mask <= 15 && mask != SENTINEL_EMPTY_WORD);
            assert_eq!(unescape(sent, mask), pack, "{pack:x?} -> {sent:x?} / {mask:#x}");
            checked += 1;
        }
        assert_eq!(checked, 7usize.pow(4));
    }
}
