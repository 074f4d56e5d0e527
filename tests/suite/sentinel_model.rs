//! Exhaustive model check of the sentinel protocol (OneShotPush), on the
//! CPU: 2 and 3 ranks, 4 launches each, every interleaving of word stores,
//! polls, resets and kernel ends (a depth-first search over all reachable
//! states). Checks that no poll accepts a value of another launch or a torn
//! mix, that no reset erases a value a peer wrote for a later launch, and
//! that every run completes (no deadlock).
//!
//! One pack per slot, two 32-bit words per pack (each word store is its own
//! event, in any order, as a 16-byte store may land word by word). Memory is
//! sequentially consistent and a launch's events all happen before the
//! rank's next launch starts: the model checks the protocol (slots, halves,
//! reset on consume, generation parity), under the kernel-boundary ordering
//! ARCHITECTURE.md states as the one assumption. Within a launch, a rank's
//! pushes precede its polls (the generation barrier); everything else is
//! free. The halves use the kernels' own `sentinel_half` and slots
//! `one_shot_push_slot`; generations start near the u32 wrap.

use std::collections::HashSet;

use tp_allreduce_kernels::params::{one_shot_push_slot, sentinel_half};

const WORDS: usize = 2;
const LAUNCHES: u32 = 4;
/// A slot word: EMPTY, or (launch << 4 | source).
const EMPTY: u8 = 0xFF;

fn word(launch: u32, source: usize) -> u8 {
    (launch as u8) << 4 | source as u8
}

/// Which receive region a generation uses, and how many there are.
#[derive(Clone, Copy)]
struct Regions {
    of: fn(u32) -> usize,
    count: usize,
    /// Reset a slot after consuming it (the protocol); off only to show the
    /// check catches its absence.
    reset: bool,
}

const PROTOCOL: Regions = Regions { of: |g| sentinel_half(g) as usize, count: 2, reset: true };

/// Where rank `r` is in its program: launch, pushes left (bit per
/// destination and word), sources accepted but not yet reset, sources
/// still to poll.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Rank {
    launch: u32,
    pushes_left: u32,
    to_reset: u32,
    to_poll: u32,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct State {
    ranks: Vec<Rank>,
    /// `mem[receiver][region][slot][word]`.
    mem: Vec<Vec<Vec<[u8; WORDS]>>>,
}

struct Model {
    world: usize,
    seed: u32,
    regions: Regions,
}

impl Model {
    fn start_launch(&self, r: usize, launch: u32) -> Rank {
        let others = ((1u32 << self.world) - 1) & !(1 << r);
        let mut pushes = 0u32;
        for d in 0..self.world {
            if d != r {
                for w in 0..WORDS {
                    pushes |= 1 << (d * WORDS + w);
                }
            }
        }
        Rank { launch, pushes_left: pushes, to_reset: 0, to_poll: others }
    }

    fn initial(&self) -> State {
        State {
            ranks: (0..self.world).map(|r| self.start_launch(r, 0)).collect(),
            mem: vec![vec![vec![[EMPTY; WORDS]; self.world - 1]; self.regions.count]; self.world],
        }
    }

    fn region(&self, launch: u32) -> usize {
        (self.regions.of)(self.seed.wrapping_add(launch))
    }

    /// Every state one event away from `s`; `Err` on a violation.
    fn successors(&self, s: &State) -> Result<Vec<State>, String> {
        let mut out = Vec::new();
        for r in 0..self.world {
            let me = &s.ranks[r];
            if me.launch == LAUNCHES {
                continue;
            }
            let region = self.region(me.launch);
            // A word of a push.
            for bit in 0..32 {
                if me.pushes_left & (1 << bit) != 0 {
                    let (d, w) = (bit as usize / WORDS, bit as usize % WORDS);
                    let mut n = s.clone();
                    n.mem[d][region][one_shot_push_slot(r as u32, d as u32) as usize][w] = word(me.launch, r);
                    n.ranks[r].pushes_left &= !(1 << bit);
                    out.push(n);
                }
            }
            if me.pushes_left != 0 {
                continue; // polls come after the pushes (generation barrier)
            }
            // A poll that succeeds (a failing poll changes nothing).
            for src in 0..self.world {
                if me.to_poll & (1 << src) == 0 {
                    continue;
                }
                let slot = one_shot_push_slot(src as u32, r as u32) as usize;
                let seen = s.mem[r][region][slot];
                if seen.contains(&EMPTY) {
                    continue;
                }
                let want = word(me.launch, src);
                if seen.iter().any(|&v| v != want) {
                    return Err(format!(
                        "rank {r} launch {} accepted {seen:02x?} from rank {src}, expected {want:02x} (stale or torn)",
                        me.launch
                    ));
                }
                let mut n = s.clone();
                n.ranks[r].to_poll &= !(1 << src);
                if self.regions.reset {
                    n.ranks[r].to_reset |= 1 << src;
                }
                out.push(n);
            }
            // A reset of a consumed slot.
            for src in 0..self.world {
                if me.to_reset & (1 << src) == 0 {
                    continue;
                }
                let slot = one_shot_push_slot(src as u32, r as u32) as usize;
                let here = s.mem[r][region][slot];
                if here.iter().any(|&v| v != word(me.launch, src)) {
                    return Err(format!(
                        "rank {r} launch {} resets slot of rank {src} holding {here:02x?}: a live value is erased",
                        me.launch
                    ));
                }
                let mut n = s.clone();
                n.mem[r][region][slot] = [EMPTY; WORDS];
                n.ranks[r].to_reset &= !(1 << src);
                out.push(n);
            }
            // Kernel end: every poll and reset done; the next launch starts.
            if me.to_poll == 0 && me.to_reset == 0 {
                let mut n = s.clone();
                n.ranks[r] = if me.launch + 1 == LAUNCHES {
                    Rank { launch: LAUNCHES, pushes_left: 0, to_reset: 0, to_poll: 0 }
                } else {
                    self.start_launch(r, me.launch + 1)
                };
                out.push(n);
            }
        }
        Ok(out)
    }

    /// Explores every reachable state; `Ok(states)` or the first violation
    /// (a stale/torn accept, an erased live value, or a deadlock).
    fn check(&self) -> Result<usize, String> {
        let mut seen: HashSet<State> = HashSet::new();
        let mut stack = vec![self.initial()];
        while let Some(s) = stack.pop() {
            if !seen.insert(s.clone()) {
                continue;
            }
            let next = self.successors(&s)?;
            if next.is_empty() && s.ranks.iter().any(|r| r.launch < LAUNCHES) {
                return Err("deadlock: no event possible before every launch ended".into());
            }
            stack.extend(next.into_iter().filter(|n| !seen.contains(n)));
        }
        Ok(seen.len())
    }
}

#[test]
fn sentinel_protocol_is_safe_for_every_interleaving_across_the_wrap() {
    for world in [2, 3] {
        for seed in [0u32, 0xFFFF_FFFE, 0xFFFF_FFFF] {
            let states = Model { world, seed, regions: PROTOCOL }
                .check()
                .unwrap_or_else(|e| panic!("{world} ranks, generations from {seed:#x}: {e}"));
            eprintln!("{world} ranks, generations from {seed:#x}: {states} states, no violation");
            assert!(states > 100, "the model explored too little: {states}");
        }
    }
}

#[test]
fn the_model_check_catches_broken_variants() {
    // One half: a fast peer's next launch overwrites a slot being read.
    let one_half = Regions { of: |_| 0, count: 1, reset: true };
    assert!(Model { world: 2, seed: 0, regions: one_half }.check().is_err());
    // No reset on consume: launch n+2 finds launch n's value.
    let no_reset = Regions { reset: false, ..PROTOCOL };
    let e = Model { world: 2, seed: 0, regions: no_reset }.check().unwrap_err();
    assert!(e.contains("stale"), "{e}");
    // The old generation index `e % 3` across the wrap: 0xFFFFFFFF and 0
    // land in the same region (2^32 is not a multiple of 3).
    let mod3 = Regions { of: |g| (g % 3) as usize, count: 3, reset: true };
    assert!(Model { world: 2, seed: 1, regions: mod3 }.check().is_ok(), "away from the wrap, % 3 works");
    let e = Model { world: 2, seed: 0xFFFF_FFFE, regions: mod3 }.check().unwrap_err();
    assert!(e.contains("erased") || e.contains("stale"), "{e}");
}

#[test]
fn halves_alternate_across_the_u32_wrap() {
    let mut g = 0xFFFF_FFF0u32;
    for _ in 0..64 {
        assert_ne!(sentinel_half(g), sentinel_half(g.wrapping_add(1)), "generation {g:#x}");
        g = g.wrapping_add(1);
    }
    // The old index repeats a region at the wrap (consecutive generations).
    let old_index = |g: u32| g % 3;
    assert_eq!(old_index(u32::MAX), old_index(u32::MAX.wrapping_add(1)));
}

/// The same exhaustive check for the island push's phase structure
/// (TwoShotPush: reduce-scatter slots, then all-gather slots, both in the
/// launch's half), 2 and 3 ranks, one pack per share, one word per slot
/// (torn packs are the one-shot model's business: the slot logic is the
/// same). Within a launch a rank's reduce-scatter pushes precede its polls
/// (the generation barrier); an owner pushes its all-gather value only
/// after reading every reduce-scatter slot of its share; all-gather polls,
/// resets and the other ranks' events are otherwise free. Every poll must
/// accept exactly its source's value of this launch; every reset must find
/// it; every run must complete.
mod island_push {
    use std::collections::HashSet;

    use tp_allreduce_kernels::params::sentinel_half;
    use tp_allreduce_kernels::shares::slot_of;

    const EMPTY: u8 = 0xFF;
    const RS: usize = 0;
    const AG: usize = 1;

    fn word(launch: u32, source: usize) -> u8 {
        (launch as u8) << 4 | source as u8
    }

    /// Bit masks over ranks: pushes left, polls left, polls to reset.
    #[derive(Clone, PartialEq, Eq, Hash)]
    struct Rank {
        launch: u32,
        rs_push: u8,
        rs_poll: u8,
        rs_reset: u8,
        ag_push: u8,
        ag_poll: u8,
        ag_reset: u8,
    }

    #[derive(Clone, PartialEq, Eq, Hash)]
    struct State {
        ranks: Vec<Rank>,
        /// `mem[receiver][half][kind][slot]`.
        mem: Vec<[[[u8; 2]; 2]; 2]>,
    }

    struct Model {
        world: usize,
        seed: u32,
        reset: bool,
        /// Launches per rank (3 already reuse a half: launch 0 and 2).
        launches: u32,
    }

    impl Model {
        fn start(&self, r: usize, launch: u32) -> Rank {
            let others = ((1u8 << self.world) - 1) & !(1 << r);
            Rank {
                launch,
                rs_push: others,
                rs_poll: others,
                rs_reset: 0,
                ag_push: others,
                ag_poll: others,
                ag_reset: 0,
            }
        }

        fn half(&self, launch: u32) -> usize {
            sentinel_half(self.seed.wrapping_add(launch)) as usize
        }

        /// Rank `r`'s successful polls and its resets of the slots of `p`
        /// (reduce-scatter and all-gather) in half `h`.
        fn polls_and_resets(
            &self,
            s: &State,
            (r, p, h): (usize, usize, usize),
            out: &mut Vec<State>,
        ) -> Result<(), String> {
            let me = &s.ranks[r];
            let bit = 1u8 << p;
            let polls = [(RS, me.rs_poll, me.rs_reset), (AG, me.ag_poll, me.ag_reset)];
            for (kind, poll, reset) in polls {
                let slot = slot_of(p as u32, r as u32) as usize;
                let here = s.mem[r][h][kind][slot];
                if poll & bit != 0 && here != EMPTY {
                    if here != word(me.launch, p) {
                        return Err(format!(
                            "rank {r} launch {} accepted {here:02x} in slot kind {kind} from rank {p} (stale)",
                            me.launch
                        ));
                    }
                    let mut n = s.clone();
                    let rank = &mut n.ranks[r];
                    let (poll, to_reset) = if kind == RS {
                        (&mut rank.rs_poll, &mut rank.rs_reset)
                    } else {
                        (&mut rank.ag_poll, &mut rank.ag_reset)
                    };
                    *poll &= !bit;
                    *to_reset |= bit * u8::from(self.reset);
                    out.push(n);
                }
                if reset & bit != 0 {
                    if here != word(me.launch, p) {
                        return Err(format!("rank {r} resets kind {kind} slot of {p} holding {here:02x}"));
                    }
                    let mut n = s.clone();
                    n.mem[r][h][kind][slot] = EMPTY;
                    let rank = &mut n.ranks[r];
                    *(if kind == RS { &mut rank.rs_reset } else { &mut rank.ag_reset }) &= !bit;
                    out.push(n);
                }
            }
            Ok(())
        }

        /// Every state one event away from `s`; `Err` on a violation.
        fn successors(&self, s: &State) -> Result<Vec<State>, String> {
            let mut out = Vec::new();
            for r in 0..self.world {
                let me = &s.ranks[r];
                if me.launch == self.launches {
                    continue;
                }
                let h = self.half(me.launch);
                for p in (0..self.world).filter(|p| *p != r) {
                    let bit = 1u8 << p;
                    // A: my contribution to share p at its owner p.
                    if me.rs_push & bit != 0 {
                        let mut n = s.clone();
                        n.mem[p][h][RS][slot_of(r as u32, p as u32) as usize] = word(me.launch, r);
                        n.ranks[r].rs_push &= !bit;
                        out.push(n);
                    }
                    // B and D wait for the generation barrier (every push of A).
                    if me.rs_push != 0 {
                        continue;
                    }
                    self.polls_and_resets(s, (r, p, h), &mut out)?;
                    // B: my share's final value to p, once every slot of it was read.
                    if me.rs_poll == 0 && me.ag_push & bit != 0 {
                        let mut n = s.clone();
                        n.mem[p][h][AG][slot_of(r as u32, p as u32) as usize] = word(me.launch, r);
                        n.ranks[r].ag_push &= !bit;
                        out.push(n);
                    }
                }
                let idle = me.rs_push | me.rs_poll | me.rs_reset | me.ag_push | me.ag_poll | me.ag_reset == 0;
                if idle {
                    let mut n = s.clone();
                    n.ranks[r] = if me.launch + 1 == self.launches {
                        Rank {
                            launch: self.launches,
                            rs_push: 0,
                            rs_poll: 0,
                            rs_reset: 0,
                            ag_push: 0,
                            ag_poll: 0,
                            ag_reset: 0,
                        }
                    } else {
                        self.start(r, me.launch + 1)
                    };
                    out.push(n);
                }
            }
            Ok(out)
        }

        fn check(&self) -> Result<usize, String> {
            let initial = State {
                ranks: (0..self.world).map(|r| self.start(r, 0)).collect(),
                mem: vec![[[[EMPTY; 2]; 2]; 2]; self.world],
            };
            let mut seen: HashSet<State> = HashSet::new();
            let mut stack = vec![initial];
            while let Some(s) = stack.pop() {
                if !seen.insert(s.clone()) {
                    continue;
                }
                let next = self.successors(&s)?;
                if next.is_empty() && s.ranks.iter().any(|r| r.launch < self.launches) {
                    return Err("deadlock: no event possible before every launch ended".into());
                }
                stack.extend(next.into_iter().filter(|n| !seen.contains(n)));
            }
            Ok(seen.len())
        }
    }

    #[test]
    fn island_push_phases_are_safe_for_every_interleaving_across_the_wrap() {
        // (3 ranks x 4 launches is 1.4 million states: minutes in a debug
        // build; 3 launches across the wrap keep the reuse of a half.)
        for (world, launches, seeds) in [(2, 4, &[0u32, 0xFFFF_FFFE][..]), (3, 3, &[0xFFFF_FFFF][..])] {
            for &seed in seeds {
                let states = Model { world, seed, reset: true, launches }
                    .check()
                    .unwrap_or_else(|e| panic!("{world} ranks, generations from {seed:#x}: {e}"));
                eprintln!(
                    "two-shot push, {world} ranks, {launches} launches from {seed:#x}: {states} states, no violation"
                );
                assert!(states > 100, "the model explored too little: {states}");
            }
        }
        // Without reset on consume, launch n+2 finds launch n's value.
        let e = Model { world: 2, seed: 0, reset: false, launches: 4 }.check().unwrap_err();
        assert!(e.contains("stale"), "{e}");
    }
}
