//! A communicator's islands: which ranks reduce together before anything
//! crosses the weak boundary (Hierarchical), as every layer sees them
//! (availability, cost recipes, templates). Islands of any shape: unequal
//! sizes allowed, members need not be consecutive. Where they come from:
//! `Config::islands` (explicit), `Config::island_size` (consecutive
//! override), else the topology (`select::topology::islands`).

#![forbid(unsafe_code)]

use std::fmt;

use tp_allreduce_kernels::layout::MAX_RANKS;
use tp_allreduce_kernels::shares::{shape_supported, MAX_ISLANDS};

/// A partition of ranks `0..world` into `count` islands, members of each in
/// rank order, islands ordered by their smallest member. `Copy` so that the
/// selection and cost-model inputs stay plain values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IslandSplit {
    /// `island[r]`: island of rank r.
    island: [u8; MAX_RANKS],
    world: u8,
}

impl IslandSplit {
    /// The split with these groups; `Err(why)` unless they cover `0..world`
    /// exactly once with 1..=MAX_ISLANDS non-empty islands whose shape the
    /// kernel runs (no member owning more than `MAX_OWNED` shares).
    pub fn from_groups(groups: &[Vec<usize>], world: usize) -> Result<IslandSplit, String> {
        if world == 0 || world > MAX_RANKS {
            return Err(format!("islands for {world} ranks: the world size must be in 1..={MAX_RANKS}"));
        }
        let mut island = [u8::MAX; MAX_RANKS];
        let mut groups: Vec<Vec<usize>> = groups.iter().filter(|g| !g.is_empty()).cloned().collect();
        for g in groups.iter_mut() {
            g.sort_unstable();
        }
        groups.sort();
        if groups.is_empty() || groups.len() > MAX_ISLANDS {
            return Err(format!("{} islands: between 1 and {MAX_ISLANDS} are supported", groups.len()));
        }
        for (g, members) in groups.iter().enumerate() {
            for &r in members {
                if r >= world || island[r] != u8::MAX {
                    return Err(format!("island member {r} is out of range 0..{world} or listed twice"));
                }
                island[r] = g as u8;
            }
        }
        if let Some(r) = (0..world).find(|&r| island[r] == u8::MAX) {
            return Err(format!("rank {r} is in no island"));
        }
        let split = IslandSplit { island, world: world as u8 };
        let mut sizes = [0u32; MAX_RANKS];
        for (g, size) in sizes.iter_mut().enumerate().take(split.count()) {
            *size = split.size(g) as u32;
        }
        if !shape_supported(&sizes, split.count()) {
            return Err(format!(
                "islands {groups:?} are too unequal: a member of the smallest island would own more than {} shares",
                tp_allreduce_kernels::shares::MAX_OWNED
            ));
        }
        Ok(split)
    }

    /// Consecutive islands of `size` ranks (`Config::island_size`): `size`
    /// must divide `world` into two or more islands of two or more.
    pub fn consecutive(size: usize, world: usize) -> Result<IslandSplit, String> {
        if size < 2 || size >= world || world % size != 0 {
            return Err(format!(
                "island_size {size} must divide the world size {world} into at least two islands of at least two ranks"
            ));
        }
        let groups: Vec<Vec<usize>> = (0..world / size).map(|g| (g * size..(g + 1) * size).collect()).collect();
        IslandSplit::from_groups(&groups, world)
    }

    /// One island of every rank (TwoShotPush's shape).
    pub fn whole(world: usize) -> IslandSplit {
        let mut island = [u8::MAX; MAX_RANKS];
        island[..world.min(MAX_RANKS)].fill(0);
        IslandSplit { island, world: world as u8 }
    }

    pub fn world(&self) -> usize {
        self.world as usize
    }

    pub fn count(&self) -> usize {
        self.island[..self.world()].iter().max().map_or(0, |&m| m as usize + 1)
    }

    /// Two or more islands: a hierarchy to run.
    pub fn splits(&self) -> bool {
        self.count() >= 2
    }

    pub fn island_of(&self, rank: usize) -> usize {
        self.island[rank] as usize
    }

    /// Members of island `g`, in rank order.
    pub fn members(&self, g: usize) -> Vec<usize> {
        (0..self.world()).filter(|&r| self.island[r] as usize == g).collect()
    }

    pub fn size(&self, g: usize) -> usize {
        self.island[..self.world()].iter().filter(|&&i| i as usize == g).count()
    }

    /// Index of `rank` among the members of its island.
    pub fn index_of(&self, rank: usize) -> usize {
        self.island[..rank].iter().filter(|&&i| i == self.island[rank]).count()
    }

    /// Member `index` of island `g`.
    pub fn member(&self, g: usize, index: usize) -> usize {
        self.members(g)[index]
    }

    /// Shares a launch is cut into: the largest island.
    pub fn shares(&self) -> usize {
        (0..self.count()).map(|g| self.size(g)).max().unwrap_or(0)
    }

    /// Island sizes in the kernels' form.
    pub fn sizes(&self) -> [u32; MAX_RANKS] {
        let mut sizes = [0u32; MAX_RANKS];
        for (g, s) in sizes.iter_mut().enumerate().take(self.count()) {
            *s = self.size(g) as u32;
        }
        sizes
    }

    pub fn groups(&self) -> Vec<Vec<usize>> {
        (0..self.count()).map(|g| self.members(g)).collect()
    }

    /// `Some(m)` when the islands are consecutive blocks of `m` ranks.
    pub fn consecutive_size(&self) -> Option<usize> {
        let m = self.size(0);
        (0..self.world()).all(|r| self.island_of(r) == r / m.max(1)).then_some(m)
    }

    /// Whether ranks `a` and `b` are in one island.
    pub fn together(&self, a: usize, b: usize) -> bool {
        self.island[a] == self.island[b]
    }
}

impl fmt::Display for IslandSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let groups: Vec<String> =
            self.groups().iter().map(|g| g.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")).collect();
        write!(f, "[{}]", groups.join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_normalised_and_validated() {
        let s = IslandSplit::from_groups(&[vec![5, 4, 6, 7], vec![3, 1, 2, 0]], 8).unwrap();
        assert_eq!(s.groups(), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!((s.count(), s.shares(), s.island_of(6), s.index_of(6), s.member(1, 2)), (2, 4, 1, 2, 6));
        assert_eq!(s.consecutive_size(), Some(4));
        assert_eq!(s.to_string(), "[0,1,2,3 | 4,5,6,7]");
        let interleaved = IslandSplit::from_groups(&[vec![0, 2, 4], vec![1, 3]], 5).unwrap();
        assert_eq!((interleaved.size(0), interleaved.size(1), interleaved.index_of(3)), (3, 2, 1));
        assert_eq!(interleaved.consecutive_size(), None);
        for (bad, world) in [
            (vec![vec![0, 1], vec![1, 2]], 3),
            (vec![vec![0, 1]], 3),
            (vec![vec![0, 9]], 2),
            (vec![vec![0], vec![1], vec![2], vec![3], vec![4]], 5),
            // 7+1: the lone rank would own 7 shares.
            (vec![(0..7).collect(), vec![7]], 8),
        ] {
            assert!(IslandSplit::from_groups(&bad, world).is_err(), "{bad:?}");
        }
        // 2+1 (three ranks) and 4+1 are fine: the lone rank owns 2 and 4 shares.
        assert!(IslandSplit::from_groups(&[vec![0, 1], vec![2]], 3).is_ok());
        assert!(IslandSplit::from_groups(&[vec![0, 1, 2, 3], vec![4]], 5).is_ok());
    }

    #[test]
    fn consecutive_override_needs_an_exact_split() {
        assert_eq!(IslandSplit::consecutive(2, 8).unwrap().count(), 4);
        assert!(IslandSplit::consecutive(4, 6).is_err());
        assert!(IslandSplit::consecutive(1, 4).is_err());
        assert!(IslandSplit::consecutive(4, 4).is_err());
        let whole = IslandSplit::whole(5);
        assert_eq!((whole.count(), whole.shares(), whole.splits()), (1, 5, false));
    }
}
