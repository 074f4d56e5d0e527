//! Basic blocks of one PTX function and its natural loops (a block that
//! some block it dominates branches back to).
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

/// How a basic block ends.
#[derive(Clone, Debug)]
pub(super) enum BlockEnd {
    /// Falls through to the next block (the next one starts at a label).
    Fall,
    Branch {
        target: String,
        guarded: bool,
    },
    /// `ret`, `exit`, `trap`.
    Exit {
        guarded: bool,
    },
}

/// Basic blocks of one function, built one statement at a time, for loop
/// detection.
#[derive(Default)]
pub(super) struct CfgBuilder {
    /// How each block ends; block 0 is the entry.
    ends: Vec<BlockEnd>,
    labels: BTreeMap<String, usize>,
    /// The last block has no instruction yet (a label may share it).
    last_empty: bool,
    /// The last block ended with a branch or exit: the next statement opens one.
    last_closed: bool,
}

impl CfgBuilder {
    fn open(&mut self) {
        self.ends.push(BlockEnd::Fall);
        self.last_empty = true;
        self.last_closed = false;
    }

    pub(super) fn label(&mut self, name: &str) {
        if self.ends.is_empty() || self.last_closed || !self.last_empty {
            self.open();
        }
        self.labels.insert(name.to_string(), self.ends.len() - 1);
    }

    pub(super) fn instruction(&mut self, end: Option<BlockEnd>) {
        if self.ends.is_empty() || self.last_closed {
            self.open();
        }
        self.last_empty = false;
        if let Some(end) = end {
            *self.ends.last_mut().expect("a block is open") = end;
            self.last_closed = true;
        }
    }

    fn successors(&self) -> Vec<Vec<usize>> {
        let n = self.ends.len();
        let next = |i: usize| if i + 1 < n { vec![i + 1] } else { vec![] };
        self.ends
            .iter()
            .enumerate()
            .map(|(i, end)| match end {
                BlockEnd::Fall => next(i),
                BlockEnd::Exit { guarded } => {
                    if *guarded {
                        next(i)
                    } else {
                        vec![]
                    }
                }
                BlockEnd::Branch { target, guarded } => {
                    let mut succ: Vec<usize> = self.labels.get(target).copied().into_iter().collect();
                    if *guarded {
                        succ.extend(next(i));
                    }
                    succ
                }
            })
            .collect()
    }

    /// (number of natural loops, deepest nesting). A natural loop is a block
    /// `h` with a branch back to it from a block it dominates; its body is
    /// every block that reaches such a latch without passing through `h`.
    /// Loops sharing a header count once; irreducible cycles (a jump back to
    /// a block that does not dominate the jump) are not loops.
    pub(super) fn natural_loops(&self) -> (u32, u32) {
        let succ = self.successors();
        if succ.is_empty() {
            return (0, 0);
        }
        let order = reverse_postorder(&succ);
        let mut preds = vec![Vec::new(); succ.len()];
        for &b in &order {
            for &s in &succ[b] {
                preds[s].push(b);
            }
        }
        let idom = immediate_dominators(&order, &preds, succ.len());
        let dominates = |h: usize, mut b: usize| loop {
            if b == h {
                return true;
            }
            match idom[b] {
                Some(d) if d != b => b = d,
                _ => return false,
            }
        };
        // Loop bodies, by header.
        let mut bodies: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        for &u in &order {
            for &h in succ[u].iter().filter(|&&h| dominates(h, u)) {
                let body = bodies.entry(h).or_insert_with(|| BTreeSet::from([h]));
                let mut todo = vec![u];
                while let Some(b) = todo.pop() {
                    if body.insert(b) {
                        todo.extend(preds[b].iter().copied());
                    }
                }
            }
        }
        let depth =
            bodies.keys().map(|h| bodies.values().filter(|body| body.contains(h)).count() as u32).max().unwrap_or(0);
        (bodies.len() as u32, depth)
    }
}

/// The blocks reachable from block 0, in reverse postorder.
fn reverse_postorder(succ: &[Vec<usize>]) -> Vec<usize> {
    let mut order = Vec::with_capacity(succ.len());
    let mut visited = vec![false; succ.len()];
    let mut stack = vec![(0usize, 0usize)];
    visited[0] = true;
    while let Some((b, i)) = stack.pop() {
        if i < succ[b].len() {
            stack.push((b, i + 1));
            let s = succ[b][i];
            if !visited[s] {
                visited[s] = true;
                stack.push((s, 0));
            }
        } else {
            order.push(b);
        }
    }
    order.reverse();
    order
}

/// Immediate dominators (Cooper, Harvey & Kennedy's iterative method) of
/// the blocks in `order` (reverse postorder from block 0); `None` for
/// unreachable blocks.
fn immediate_dominators(order: &[usize], preds: &[Vec<usize>], n: usize) -> Vec<Option<usize>> {
    let mut rank = vec![usize::MAX; n];
    for (r, &b) in order.iter().enumerate() {
        rank[b] = r;
    }
    let mut idom: Vec<Option<usize>> = vec![None; n];
    idom[0] = Some(0);
    let mut changed = true;
    while changed {
        changed = false;
        for &b in &order[1..] {
            let mut new: Option<usize> = None;
            for &p in preds[b].iter().filter(|&&p| idom[p].is_some()) {
                new = Some(match new {
                    None => p,
                    Some(mut a) => {
                        let mut c = p;
                        while a != c {
                            while rank[a] > rank[c] {
                                a = idom[a].expect("processed");
                            }
                            while rank[c] > rank[a] {
                                c = idom[c].expect("processed");
                            }
                        }
                        a
                    }
                });
            }
            if new.is_some() && idom[b] != new {
                idom[b] = new;
                changed = true;
            }
        }
    }
    idom
}
