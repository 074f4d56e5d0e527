//! Registered buffers and graph slots: how pull algorithms find every rank's
//! input (the vLLM protocol, with its failure modes closed).
//!
//! The device table holds one [`PeerPointers`] entry per registered buffer:
//! entry 0 is every rank's staging buffer; `register_buffer` adds entries for
//! user buffers (exact pointer match); a call on a capturing stream reserves
//! a fresh entry, records its input pointer and launches the kernel with the
//! entry's device address — the entry is still zero. After capture,
//! `register_graph_buffers` (collective) resolves each recorded pointer to
//! its allocation base + offset, exchanges them, maps the peers' allocations
//! and fills the entries. A replay before that finds a zero entry: the kernel
//! records `UnregisteredBuffer`, every rank fails fast, nothing is read from
//! a bad address.
//!
//! An input that cannot be exported (stream-ordered pool memory; when a peer
//! runs in another process also cuMem memory without a POSIX
//! file-descriptor handle type, or anything not device memory) is detected
//! at capture time and goes through the staging copy instead (captured as a
//! memcpy node, with a note in [`Comm::registration_notes`]), so capture
//! never produces an unregistrable graph. cuMem (VMM) inputs — PyTorch's
//! expandable segments — cross processes as file descriptors of their
//! physical chunks (`ipc.rs`, `vmm_buffers.rs`).
//!
//! Every public call here restores the caller's current CUDA context.

#![forbid(unsafe_code)]

use cudarc::driver::sys;
use tp_allreduce_kernels::layout::{PeerPointers, MAX_RANKS};

use serde::{de::DeserializeOwned, Serialize};

use super::fd_passing::{Deadline, Serving};
use super::ipc::{self, PeerMapping, StepOffer};
use super::vmm_buffers;
use super::Comm;
use crate::driver::vmm::{self, Backing, ChunkHandle};
use crate::driver::{self, CurrentContext};
use crate::error::{Error, Result};
use crate::rendezvous::all_gather_json;

/// Where a pull kernel reads this rank's input from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum InputSource {
    /// Copied into the staging buffer (table entry 0) first.
    Staging,
    /// Table entry with every rank's address of this input.
    Table(usize),
}

/// A buffer registered with `register_buffer`.
#[derive(Clone, Debug)]
struct Registered {
    ptr: u64,
    bytes: usize,
    entry: usize,
    backing: Backing,
    /// The driver's id of the allocation (`CU_POINTER_ATTRIBUTE_BUFFER_ID`,
    /// or the physical allocation's id for cuMem memory; never reused in a
    /// process): tells a freed-and-reallocated address from the buffer that
    /// was registered.
    allocation_id: u64,
}

/// A buffer to register in one step: its address, table entry and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PendingInput {
    ptr: u64,
    entry: usize,
    /// The longest call on it (what a cuMem buffer's peers map).
    bytes: usize,
}

/// Table bookkeeping of one rank. Entries are handed out once and never
/// reused (not even after [`Comm::deregister_buffers`]), so a graph captured
/// earlier can only ever find its own entry, filled or zeroed.
#[derive(Default)]
pub(crate) struct Registry {
    next_entry: usize,
    registered: Vec<Registered>,
    /// Inputs captured since the last `register_graph_buffers`, one per
    /// distinct pointer.
    pending_graph: Vec<PendingInput>,
    /// For each pull call captured since the last registration, where its
    /// input comes from: [`STAGED_CALL`], [`REGISTERED_CALL`] | index in
    /// `registered` (the same on every rank: registration is collective), or
    /// the index of its input in `pending_graph`. Ranks must agree on this
    /// pattern, because call k on every rank reads the entry its own rank
    /// chose for call k.
    pending_calls: Vec<u32>,
    /// Entries below this were zeroed by `deregister_buffers`.
    first_live_entry: usize,
    /// Why captured calls were staged (distinct reasons, at most
    /// [`MAX_NOTES`]).
    notes: Vec<String>,
}

const MAX_NOTES: usize = 32;

/// Pattern tag of a captured call that reads the staging copy.
const STAGED_CALL: u32 = u32::MAX;
/// Pattern tag bit of a captured call on a `register_buffer` buffer.
const REGISTERED_CALL: u32 = 1 << 31;

impl Registry {
    fn alloc_entry(&mut self, capacity: usize) -> Result<usize> {
        if self.next_entry == 0 {
            self.next_entry = 1; // entry 0 is the staging buffer
        }
        if self.next_entry >= capacity {
            return Err(Error::invalid(format!(
                "more than {capacity} registered buffers / captured pull inputs over this communicator's life; \
                 raise Config::max_registered_buffers"
            )));
        }
        let e = self.next_entry;
        self.next_entry += 1;
        Ok(e)
    }

    /// Where a pull call of `bytes` captured on `ptr` reads its input:
    /// calls on the same input within one capture share an entry (one
    /// registration each). When the table is full the call reads a staged
    /// copy instead (with a note): capture never fails for it. Entries are
    /// not reused, since a graph captured earlier may still read its own;
    /// every rank fills its table in the same order (registration and
    /// capture are collective), so all ranks reach the end at the same call.
    fn capture_entry(&mut self, ptr: u64, bytes: usize, capacity: usize) -> InputSource {
        if let Some(index) = self.pending_graph.iter().position(|p| p.ptr == ptr) {
            self.pending_calls.push(index as u32);
            let input = &mut self.pending_graph[index];
            input.bytes = input.bytes.max(bytes);
            return InputSource::Table(input.entry);
        }
        let Ok(entry) = self.alloc_entry(capacity) else {
            self.capture_staged(format!(
                "the registration table is full ({capacity} entries over this communicator's life; an entry is \
                 never reused, since a graph captured earlier may still read it): further captured pull calls read \
                 a staged copy; raise Config::max_registered_buffers to keep them zero-copy"
            ));
            return InputSource::Staging;
        };
        self.pending_calls.push(self.pending_graph.len() as u32);
        self.pending_graph.push(PendingInput { ptr, entry, bytes });
        InputSource::Table(entry)
    }

    /// A captured call that reads the staging copy, and why.
    fn capture_staged(&mut self, why: String) {
        self.pending_calls.push(STAGED_CALL);
        if self.notes.len() < MAX_NOTES && !self.notes.contains(&why) {
            log::warn!("{why} (one extra device copy per replay; reported once per reason)");
            self.notes.push(why);
        }
    }

    /// Forgets every registration; returns the entries to zero (handed out
    /// since the last release).
    fn release_all(&mut self) -> std::ops::Range<usize> {
        self.registered.clear();
        self.pending_graph.clear();
        self.pending_calls.clear();
        let live = self.first_live_entry.max(1)..self.next_entry.max(1);
        self.first_live_entry = live.end;
        live
    }
}

impl Comm {
    pub(super) fn input_source(
        &self,
        send: u64,
        bytes: usize,
        capturing: bool,
        must_stage: bool,
    ) -> Result<InputSource> {
        if must_stage && !capturing {
            return Ok(InputSource::Staging);
        }
        let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
        if must_stage {
            reg.pending_calls.push(STAGED_CALL); // by the algorithm's rule, no note
            return Ok(InputSource::Staging);
        }
        if let Some(index) = reg.registered.iter().position(|r| r.ptr == send) {
            let r = &reg.registered[index];
            if bytes > r.bytes {
                return Err(Error::invalid(format!(
                    "all_reduce: the input at registered buffer {send:#x} covers {bytes} bytes, but only {} were registered",
                    r.bytes
                )));
            }
            if vmm::allocation_id(send, r.backing)? != r.allocation_id {
                return Err(Error::invalid(format!(
                    "all_reduce: the buffer registered at {send:#x} was freed and the address now belongs to \
                     another allocation; peers would read the freed one. Call deregister_buffers() (collective) \
                     before freeing registered buffers, then register the new one"
                )));
            }
            let entry = r.entry;
            if capturing {
                reg.pending_calls.push(REGISTERED_CALL | index as u32);
            }
            return Ok(InputSource::Table(entry));
        }
        if !capturing {
            return Ok(InputSource::Staging);
        }
        if let Some(why) = self.capture_obstacle(send, bytes) {
            reg.capture_staged(format!("captured pull calls on such inputs read a staged copy: {why}"));
            return Ok(InputSource::Staging);
        }
        Ok(reg.capture_entry(send, bytes, self.setup.table_capacity))
    }

    /// Why a captured input cannot be registered, if it cannot: pool memory
    /// never (as a rule, also within one process), and, when a peer runs in
    /// another process, whatever cannot be exported to it. Decided from
    /// pointer queries, which are legal during capture.
    fn capture_obstacle(&self, send: u64, bytes: usize) -> Option<String> {
        if driver::is_pool_memory(send) {
            return Some(format!(
                "the input at {send:#x} is stream-ordered pool memory (cuMemAllocAsync), which cannot be exported"
            ));
        }
        if !ipc::cross_process_needed(&self.setup.same_process) {
            return None;
        }
        vmm_buffers::cross_process_obstacle(send, bytes)
    }

    /// Why captured pull calls since this communicator's creation read a
    /// staged copy instead of their input in place (distinct reasons): the
    /// input could not be exported to a peer in another process (pool
    /// memory, cuMem memory allocated without a POSIX file-descriptor
    /// handle type, ...). Such graphs are correct, one device copy slower.
    pub fn registration_notes(&self) -> Vec<String> {
        self.registry.lock().map(|r| r.notes.clone()).unwrap_or_default()
    }

    /// Number of distinct graph-captured pull inputs awaiting
    /// [`register_graph_buffers`](Self::register_graph_buffers).
    pub fn pending_graph_buffers(&self) -> usize {
        self.registry.lock().map(|r| r.pending_graph.len()).unwrap_or(0)
    }

    /// Collective (every rank, same order): makes the device buffer
    /// `ptr..ptr+bytes` readable by peers, so pull algorithms read it in
    /// place instead of staging it. Calls must pass exactly `ptr`.
    ///
    /// Every rank must then pass its registered buffer at the same calls
    /// (a call is not checked against the other ranks).
    ///
    /// The buffer must stay allocated until [`deregister_buffers`](Self::deregister_buffers)
    /// returns, or until every rank's communicator is dropped: peers keep it
    /// mapped, and CUDA leaves freeing exported memory that peers still map
    /// undefined. A call on a registered address whose buffer was freed and
    /// reallocated is refused on that rank (its peers then fail with a
    /// timeout).
    pub fn register_buffer(&self, ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        let context = CurrentContext::bind(&self.ctx);
        let local = (|| {
            bound(&context)?;
            self.check()?;
            if ptr == 0 || bytes == 0 {
                return Err(Error::invalid("register_buffer: null pointer or empty range"));
            }
            if ipc::cross_process_needed(&self.setup.same_process) {
                if let Some(why) = vmm_buffers::cross_process_obstacle(ptr, bytes) {
                    return Err(Error::Unsupported(format!(
                        "register_buffer: {why}; unregistered, calls on it are staged (one extra device copy)"
                    )));
                }
            }
            let backing = vmm::backing(ptr);
            let allocation_id = vmm::allocation_id(ptr, backing)?;
            let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
            if reg.registered.iter().any(|r| r.ptr == ptr) {
                return Err(Error::invalid(format!(
                    "register_buffer: {ptr:#x} is already registered (deregister_buffers() releases registrations)"
                )));
            }
            Ok((backing, allocation_id, reg.alloc_entry(self.setup.table_capacity)?))
        })();
        let backing = local.as_ref().map_or(Backing::Other, |l| l.0);
        let outcomes = self.gather_outcomes("register_buffer", local.map(|(_, id, entry)| (id, entry)))?;
        let (allocation_id, entry) = *outcomes
            .get(self.rank)
            .ok_or_else(|| Error::Broken("register_buffer: the rendezvous returned too few ranks".into()))?;
        self.fill_entries(&[PendingInput { ptr, entry, bytes }])?;
        let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
        reg.registered.push(Registered { ptr, bytes, entry, backing, allocation_id });
        Ok(())
    }

    /// Collective (every rank, after capturing the same graph): registers the
    /// inputs of every pull call captured since the last registration.
    /// Returns how many distinct inputs were registered. Replaying the graph
    /// before this fails with a clear error (no wrong data is read).
    ///
    /// The inputs must stay allocated until [`deregister_buffers`](Self::deregister_buffers)
    /// returns, or until every rank's communicator is dropped (as for
    /// [`register_buffer`](Self::register_buffer)).
    ///
    /// # Replaying graphs
    /// A rank's calls must run one after the other, also across graphs:
    /// the kernels of one communicator share the rank's per-region
    /// generation counters and receive regions. Replay graphs that hold
    /// calls of one communicator in an order the stream sees (one stream,
    /// or events between them), and do not replay one while an eager call
    /// of the communicator runs on another stream. The library orders what
    /// it can see (eager calls on any stream; it refuses two calls of one
    /// capture on different streams), not replays, which the driver runs
    /// without it. Two replays that overlap anyway do not give wrong sums
    /// silently: a call then waits for data its peers put in the other
    /// half of the receive region and fails with `Error::Timeout`, or a
    /// peer's does (tested: `gpu_streams::concurrent_replays_of_two_graphs_never_fail_silently`).
    pub fn register_graph_buffers(&self) -> Result<usize> {
        let context = CurrentContext::bind(&self.ctx);
        let (pending, calls) = {
            let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
            (std::mem::take(&mut reg.pending_graph), std::mem::take(&mut reg.pending_calls))
        };
        let local = bound(&context).and_then(|()| self.check()).map(|()| calls);
        let patterns = self.gather_outcomes("register_graph_buffers", local)?;
        if let Some(why) = pattern_mismatch(&patterns) {
            return Err(Error::invalid(format!(
                "register_graph_buffers: {why}; every rank must capture the same sequence of allreduces, \
                 reusing an input exactly where the other ranks reuse theirs, from memory of the same kind (an \
                 input that cannot be exported to other processes is staged: see registration_notes())"
            )));
        }
        self.fill_entries(&pending)?;
        Ok(pending.len())
    }

    /// Collective (every rank): releases every registration — buffers from
    /// [`register_buffer`](Self::register_buffer) and inputs of captured
    /// graphs. Waits for all work on this rank's context, zeroes the table
    /// entries, closes the peers' buffers this rank mapped and returns once
    /// every rank has done the same; afterwards this rank may free the
    /// buffers it had registered. Replaying a graph captured before fails
    /// with "unregistered buffer" on every rank. Returns how many table
    /// entries were released.
    ///
    /// Entries are never handed out again, so the table
    /// ([`Config::max_registered_buffers`](super::Config::max_registered_buffers),
    /// 8192 by default) bounds the distinct registered buffers and captured
    /// inputs over the communicator's life.
    ///
    /// It waits for every stream of this rank's context (`cuCtxSynchronize`):
    /// call it when the collectives already issued there, on any
    /// communicator, can complete, and not while a stream of the context is
    /// capturing.
    pub fn deregister_buffers(&self) -> Result<usize> {
        // No kernel may still read a peer's buffer, nor a peer ours.
        let context = CurrentContext::bind(&self.ctx);
        let idle = (|| {
            bound(&context)?;
            self.check()?;
            driver::context_synchronize()?;
            self.check()
        })();
        self.gather_outcomes("deregister_buffers", idle)?;
        let released = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?.release_all();
        // Zero the entries before closing the mappings they point into: a
        // kernel launched in between fails cleanly instead of faulting.
        let zeroed = if released.is_empty() {
            Ok(())
        } else {
            let bytes = released.len() * std::mem::size_of::<PeerPointers>();
            driver::memset_d8(self.setup.table_entry(released.start), 0, bytes)
        };
        // Closes the IPC handles this rank opened for registrations.
        self.setup.registered_mappings.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?.clear();
        // Every rank has closed its mappings of our buffers once this returns.
        self.gather_outcomes("deregister_buffers", zeroed)?;
        Ok(released.len())
    }

    /// All-gathers each rank's outcome of a collective step's local part,
    /// so that all ranks fail together (none is left waiting in the next
    /// exchange). Returns every rank's value (indexed by rank), this rank's
    /// own error, or an error naming the first rank that failed.
    fn gather_outcomes<T: Serialize + DeserializeOwned>(&self, step: &str, local: Result<T>) -> Result<Vec<T>> {
        let (shared, own_error) = match local {
            Ok(value) => (Ok(value), None),
            Err(e) => (Err(e.to_string()), Some(e)),
        };
        let all: Vec<std::result::Result<T, String>> = all_gather_json(&*self.rendezvous, &shared)?;
        if let Some(e) = own_error {
            return Err(e);
        }
        all.into_iter()
            .enumerate()
            .map(|(rank, outcome)| outcome.map_err(|e| Error::invalid(format!("{step}: rank {rank} failed: {e}"))))
            .collect()
    }

    /// Exchanges this rank's buffers (in order) and writes, for each, the
    /// table entry holding every rank's address of its i-th buffer. Each peer
    /// maps the form of a buffer that fits it (see `ipc.rs`): the address when
    /// it shares the owner's process, the IPC handle or the cuMem chunks'
    /// descriptors otherwise. The caller binds the communicator's context.
    fn fill_entries(&self, buffers: &[PendingInput]) -> Result<()> {
        let same_process = &self.setup.same_process;
        let list: Vec<(u64, usize)> = buffers.iter().map(|b| (b.ptr, b.bytes)).collect();
        let (offer, exports) = match ipc::offer_step(&self.ctx, &list, same_process) {
            Ok((offer, exports)) => (Ok(offer), exports),
            Err(e) => (Err(e), None),
        };
        let all: Vec<StepOffer> = self.gather_outcomes("registering buffers", offer)?;
        // The ranks in other processes fetch this rank's cuMem chunks (on a
        // thread of its own) while it fetches theirs; all bounded by the
        // rendezvous timeout.
        let deadline = Deadline::after(self.config.rendezvous_timeout);
        let others: Vec<usize> = (0..self.world).filter(|&p| !same_process[p]).collect();
        let (serving, filled) = match exports.map(|x| x.serve(&others, deadline)).transpose() {
            Ok(serving) => (serving, self.map_step(&all, buffers, deadline)),
            Err(e) => (None, Err(e)),
        };
        let served = serving.map_or(Ok(()), Serving::finish);
        // A rank whose imports failed (its mappings are closed again on the
        // way out) takes the others down with it: no rank replays alone.
        self.gather_outcomes("registering buffers", filled.and(served))?;
        Ok(())
    }

    /// Maps every rank's buffers of one step and writes the table entries.
    fn map_step(&self, all: &[StepOffer], buffers: &[PendingInput], deadline: Deadline) -> Result<()> {
        let same_process = &self.setup.same_process;
        // Every peer's cuMem chunks first, all of them even after a failure,
        // so that every rank's server completes instead of waiting.
        let fetched: Vec<Option<Result<Vec<ChunkHandle>>>> = all
            .iter()
            .enumerate()
            .map(|(p, step)| match &step.vmm {
                Some(export) if !same_process[p] => Some(vmm_buffers::fetch_chunks(export, self.rank, deadline)),
                _ => None,
            })
            .collect();
        let mut entries = vec![PeerPointers::default(); buffers.len()];
        let mut mappings = Vec::new();
        for (p, (step, chunks)) in all.iter().zip(fetched).enumerate() {
            if step.buffers.len() != buffers.len() {
                return Err(Error::invalid(format!(
                    "rank {p} registered {} buffers in this step, rank {} registered {}",
                    step.buffers.len(),
                    self.rank,
                    buffers.len()
                )));
            }
            // Where this rank mapped each run of the peer's cuMem chunks.
            let runs: Vec<(u64, u64)> = match (chunks, &step.vmm) {
                (Some(chunks), Some(export)) => {
                    let mapped = vmm_buffers::map_runs(&self.ctx, &export.runs, chunks?)?;
                    let length = |sizes: &Vec<u64>| sizes.iter().fold(0u64, |a, &b| a.saturating_add(b));
                    let starts = mapped.iter().zip(&export.runs).map(|(m, sizes)| (m.ptr(), length(sizes))).collect();
                    mappings.extend(mapped.into_iter().map(PeerMapping::Vmm));
                    starts
                }
                _ => Vec::new(),
            };
            for (i, offer) in step.buffers.iter().enumerate() {
                let address = if p == self.rank {
                    offer.addr
                } else {
                    let desc = ipc::descriptor_for_peer(offer, same_process[p])?;
                    let (a, mapping) = ipc::import_registered(&self.ctx, &desc, &runs, offer.bytes)?;
                    mappings.push(mapping);
                    a
                };
                debug_assert!(p < MAX_RANKS);
                entries[i].ptrs[p] = address;
            }
        }
        for (entry, input) in entries.iter().zip(buffers.iter()) {
            driver::write_struct(self.setup.table_entry(input.entry), entry)?;
        }
        self.setup
            .registered_mappings
            .lock()
            .map_err(|_| Error::Broken("registry lock poisoned".into()))?
            .extend(mappings);
        Ok(())
    }
}

/// `Ok` when the communicator's context is bound (the binding's own error
/// becomes this rank's outcome of a collective step, so peers fail with it).
fn bound(context: &Result<CurrentContext>) -> Result<()> {
    match context {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::Broken(format!("binding the communicator's CUDA context failed: {e}"))),
    }
}

/// Why the ranks' captured-call patterns differ, if they do (see
/// `Registry::pending_calls`).
fn pattern_mismatch(patterns: &[Vec<u32>]) -> Option<String> {
    let first = patterns.first()?;
    let describe = |pattern: &[u32], k: usize| match pattern[k] {
        STAGED_CALL => "a staged copy".to_string(),
        tag if tag & REGISTERED_CALL != 0 => format!("registered buffer #{}", tag & !REGISTERED_CALL),
        tag => format!("the input of call {}", pattern.iter().position(|&t| t == tag).unwrap_or(k)),
    };
    for (rank, p) in patterns.iter().enumerate().skip(1) {
        if p.len() != first.len() {
            return Some(format!("rank 0 captured {} pull calls, rank {rank} captured {}", first.len(), p.len()));
        }
        if let Some(k) = (0..p.len()).find(|&k| describe(p, k) != describe(first, k)) {
            return Some(format!(
                "captured pull call {k} reads {} on rank 0 but {} on rank {rank}",
                describe(first, k),
                describe(p, k)
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_calls_on_one_input_share_an_entry() {
        let mut reg = Registry::default();
        let a = reg.capture_entry(0x1000, 64, 16);
        let b = reg.capture_entry(0x2000, 64, 16);
        assert_eq!((a, b), (InputSource::Table(1), InputSource::Table(2)), "entry 0 is the staging buffer");
        assert_eq!(reg.capture_entry(0x1000, 64, 16), a);
        assert_eq!(reg.pending_graph.len(), 2);
    }

    #[test]
    fn a_captured_input_records_its_longest_call() {
        // Peers map what the calls read of a cuMem input: the longest one.
        let mut reg = Registry::default();
        reg.capture_entry(0x1000, 64, 16);
        reg.capture_entry(0x1000, 4096, 16);
        reg.capture_entry(0x1000, 128, 16);
        assert_eq!(reg.pending_graph, [PendingInput { ptr: 0x1000, entry: 1, bytes: 4096 }]);
    }

    #[test]
    fn staged_captures_count_as_calls_and_leave_one_note_per_reason() {
        let mut reg = Registry::default();
        reg.capture_staged("cuMem without a POSIX fd handle type".into());
        reg.capture_entry(0x1000, 64, 16);
        reg.capture_staged("cuMem without a POSIX fd handle type".into());
        reg.capture_staged("pool memory".into());
        assert_eq!(reg.pending_calls, [STAGED_CALL, 0, STAGED_CALL, STAGED_CALL]);
        assert_eq!(reg.notes, ["cuMem without a POSIX fd handle type", "pool memory"]);
        for i in 0..2 * MAX_NOTES {
            reg.capture_staged(format!("reason {i}"));
        }
        assert_eq!(reg.notes.len(), MAX_NOTES, "notes are bounded");
    }

    #[test]
    fn released_entries_are_never_handed_out_again() {
        let mut reg = Registry::default();
        assert_eq!(reg.release_all(), 1..1, "nothing to release yet");
        reg.capture_entry(0x1000, 64, 16);
        reg.alloc_entry(16).unwrap();
        assert_eq!(reg.release_all(), 1..3);
        assert!(reg.pending_graph.is_empty() && reg.registered.is_empty());
        assert_eq!(reg.release_all(), 3..3, "a second release zeroes nothing");
        // The same pointer captured again gets a new entry: a graph captured
        // before the release keeps finding its zeroed one.
        assert_eq!(reg.capture_entry(0x1000, 64, 16), InputSource::Table(3));
        assert_eq!(reg.release_all(), 3..4);
    }

    #[test]
    fn ranks_must_reuse_inputs_in_the_same_pattern() {
        let mut a = Registry::default();
        let mut b = Registry::default();
        for p in [0x10, 0x10, 0x20] {
            a.capture_entry(p, 64, 16);
        }
        for p in [0x30, 0x40, 0x40] {
            b.capture_entry(p, 64, 16);
        }
        assert_eq!(a.pending_calls, [0, 0, 1]);
        let why = pattern_mismatch(&[a.pending_calls.clone(), b.pending_calls.clone()]).unwrap();
        assert!(why.contains("call 1 reads the input of call 0 on rank 0 but the input of call 1 on rank 1"), "{why}");
        assert!(pattern_mismatch(&[a.pending_calls.clone(), a.pending_calls.clone()]).is_none());
        let why = pattern_mismatch(&[vec![0, 1], vec![0]]).unwrap();
        assert!(why.contains("rank 0 captured 2 pull calls, rank 1 captured 1"), "{why}");
        // Registered and staged calls count too: the same distinct-input
        // pattern with a registered buffer at another call must not pass.
        let why = pattern_mismatch(&[vec![REGISTERED_CALL, 0], vec![0, REGISTERED_CALL]]).unwrap();
        assert!(why.contains("call 0 reads registered buffer #0 on rank 0 but the input of call 0 on rank 1"), "{why}");
        let why = pattern_mismatch(&[vec![STAGED_CALL], vec![REGISTERED_CALL | 1]]).unwrap();
        assert!(why.contains("a staged copy on rank 0 but registered buffer #1 on rank 1"), "{why}");
        // Distinct-input indices compare by first use, so equal patterns agree.
        assert!(pattern_mismatch(&[vec![0, STAGED_CALL, 1, 0], vec![0, STAGED_CALL, 1, 0]]).is_none());
    }

    #[test]
    fn the_table_capacity_is_enforced_for_registration_and_capture_stages_past_it() {
        let mut reg = Registry::default();
        for expected in 1..4 {
            assert_eq!(reg.alloc_entry(4).unwrap(), expected);
        }
        // An explicit registration past the end is refused ...
        let e = reg.alloc_entry(4).unwrap_err().to_string();
        assert!(e.contains("max_registered_buffers"), "{e}");
        // ... a captured call reads a staged copy, with a note, however many
        // more are captured.
        for p in 0..10_000u64 {
            assert_eq!(reg.capture_entry(0x1000 + 16 * p, 64, 4), InputSource::Staging);
        }
        assert_eq!(reg.pending_calls.len(), 10_000);
        assert!(reg.pending_calls.iter().all(|&c| c == STAGED_CALL));
        assert_eq!(reg.notes.len(), 1, "one note for the reason: {:?}", reg.notes);
        assert!(reg.notes[0].contains("registration table is full"), "{:?}", reg.notes);
        assert!(reg.pending_graph.is_empty(), "nothing to register");
    }
}
