//! Launch-shape sweeps of sentinel algorithms (one-shot-push), shared by
//! `tp-allreduce tune --shapes full` and measured `auto`'s `full` sweep:
//! the candidates and the rule that picks a winner. Pure.

#![forbid(unsafe_code)]

const SWEEP_BLOCKS: [u32; 10] = [1, 2, 4, 8, 12, 16, 32, 64, 96, 128];
/// Block sizes a sweep tries.
pub const SWEEP_THREADS: [u32; 4] = [128, 256, 512, 1024];

/// Launch-shape candidates for a message of `bytes` (`packs` 16-byte
/// packs): blocks in {1, 2, 4, 8, 12, 16, 32, 64, 96, 128, resident cap} x
/// threads in {128, 256, 512, 1024} (at least 256 from 4 MiB), within the
/// resident cap `cap(threads)`, leaving no whole block without a pack.
pub fn shape_candidates(bytes: usize, packs: u64, cap: impl Fn(u32) -> u32) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for threads in SWEEP_THREADS {
        if bytes >= 4 << 20 && threads < 256 {
            continue;
        }
        let limit = cap(threads);
        for blocks in SWEEP_BLOCKS.into_iter().chain([limit]) {
            let idle_block = (blocks as u64 - 1) * threads as u64 >= packs.max(1);
            if blocks >= 1 && blocks <= limit && !idle_block && !out.contains(&(blocks, threads)) {
                out.push((blocks, threads));
            }
        }
    }
    out
}

/// The winner of a size's sweep: a swept shape ([`pick_shape`]) only if
/// it beats the default rule's launch (`default_us`, measured in the same
/// sweep) by more than 1%; otherwise the default rule (`None`), which then
/// stays in force for that size.
pub fn pick_over_default(default_us: Option<f64>, points: &[((u32, u32), f64)]) -> Option<(Option<(u32, u32)>, f64)> {
    let swept = pick_shape(points);
    match (default_us.filter(|t| t.is_finite()), swept) {
        (Some(d), Some((shape, t))) if t * 1.01 < d => Some((Some(shape), t)),
        (Some(d), _) => Some((None, d)),
        (None, Some((shape, t))) => Some((Some(shape), t)),
        (None, None) => None,
    }
}

/// The winning shape: the fastest, or within 1% of it the one with fewer
/// threads, then fewer blocks.
pub fn pick_shape(points: &[((u32, u32), f64)]) -> Option<((u32, u32), f64)> {
    let best = points.iter().map(|p| p.1).filter(|t| t.is_finite()).fold(f64::INFINITY, f64::min);
    points.iter().filter(|(_, t)| *t <= best * 1.01).min_by_key(|((blocks, threads), _)| (*threads, *blocks)).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200(threads: u32) -> u32 {
        132 * (65_536 / (64 * threads)).min(2048 / threads)
    }

    #[test]
    fn candidates_stay_resident_and_leave_no_block_idle() {
        for bytes in [4usize << 10, 42 << 10, 256 << 10, 1 << 20, 8 << 20] {
            let packs = (bytes / 16) as u64;
            let c = shape_candidates(bytes, packs, h200);
            assert!(!c.is_empty(), "{bytes}");
            for &(blocks, threads) in &c {
                assert!(blocks >= 1 && blocks <= h200(threads), "{bytes}: {blocks}x{threads}");
                assert!(
                    (blocks as u64 - 1) * (threads as u64) < packs,
                    "{bytes}: {blocks}x{threads} leaves a block idle"
                );
                assert!(bytes < 4 << 20 || threads >= 256);
            }
            let mut dedup = c.clone();
            dedup.dedup();
            assert_eq!(dedup.len(), c.len());
        }
        // 4 KB = 256 packs: one block of up to 1024 threads, two of 128 ...
        let small = shape_candidates(4 << 10, 256, h200);
        assert!(small.contains(&(1, 256)) && small.contains(&(2, 128)) && !small.contains(&(2, 256)), "{small:?}");
        // 8 MB reaches the resident cap at 1024 threads (132 on an H200).
        assert!(shape_candidates(8 << 20, 524_288, h200).contains(&(132, 1024)));
    }

    #[test]
    fn a_swept_shape_replaces_the_default_rule_only_when_more_than_1_percent_faster() {
        let pts = [((16, 128), 3.30), ((8, 256), 3.33)];
        // 42 KB on 2 H200: tune's 16x128 against a default measured alike.
        assert_eq!(pick_over_default(Some(3.31), &pts), Some((None, 3.31)));
        assert_eq!(pick_over_default(Some(3.332), &pts), Some((None, 3.332)));
        assert_eq!(pick_over_default(Some(3.40), &pts), Some((Some((16, 128)), 3.30)));
        // No default row (not a sentinel algorithm's sweep): the swept winner.
        assert_eq!(pick_over_default(None, &pts), Some((Some((16, 128)), 3.30)));
        assert_eq!(pick_over_default(Some(2.0), &[]), Some((None, 2.0)));
        assert_eq!(pick_over_default(None, &[]), None);
        assert_eq!(pick_over_default(Some(f64::NAN), &pts), Some((Some((16, 128)), 3.30)));
    }

    #[test]
    fn the_winner_is_the_fastest_or_within_1_percent_the_smaller() {
        // 4.98 is the best; 5.00 is within 1% with half the threads; 5.04 is not.
        let pts = [((16, 512), 5.00), ((32, 256), 5.04), ((64, 1024), 4.98), ((8, 128), 6.0)];
        assert_eq!(pick_shape(&pts), Some(((16, 512), 5.00)));
        let pts = [((16, 512), 5.00), ((32, 256), 5.2)];
        assert_eq!(pick_shape(&pts), Some(((16, 512), 5.00)));
        let pts = [((4, 256), 3.0), ((2, 256), 3.0)];
        assert_eq!(pick_shape(&pts).unwrap().0, (2, 256));
        assert_eq!(pick_shape(&[]), None);
    }
}
