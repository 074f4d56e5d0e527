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
//! An input that cannot be exported (stream-ordered pool memory) is detected
//! at capture time and goes through the staging copy instead (captured as a
//! memcpy node), so capture never produces an unregistrable graph.

use cudarc::driver::sys;
use tp_allreduce_kernels::layout::{PeerPointers, MAX_RANKS};

use super::setup::{gather_json, import, BufferDescriptor};
use super::Comm;
use crate::driver;
use crate::error::{Error, Result};

/// Where a pull kernel reads this rank's input from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum InputSource {
    /// Copied into the staging buffer (table entry 0) first.
    Staging,
    /// Table entry with every rank's address of this input.
    Table(usize),
}

#[derive(Clone, Debug)]
struct Registered {
    ptr: u64,
    bytes: usize,
    entry: usize,
}

#[derive(Default)]
pub(crate) struct Registry {
    next_entry: usize,
    registered: Vec<Registered>,
    pending_graph: Vec<(u64, usize)>,
}

impl Registry {
    fn alloc_entry(&mut self, capacity: usize) -> Result<usize> {
        if self.next_entry == 0 {
            self.next_entry = 1; // entry 0 is the staging buffer
        }
        if self.next_entry >= capacity {
            return Err(Error::invalid(format!(
                "more than {capacity} registered buffers / captured pull calls; raise Config::max_registered_buffers"
            )));
        }
        let e = self.next_entry;
        self.next_entry += 1;
        Ok(e)
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
        if must_stage {
            return Ok(InputSource::Staging);
        }
        let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
        if let Some(r) = reg.registered.iter().find(|r| r.ptr == send) {
            if bytes > r.bytes {
                return Err(Error::invalid(format!(
                    "all_reduce: the input at registered buffer {send:#x} covers {bytes} bytes, but only {} were registered",
                    r.bytes
                )));
            }
            return Ok(InputSource::Table(r.entry));
        }
        if !capturing {
            return Ok(InputSource::Staging);
        }
        if driver::is_pool_memory(send) {
            return Ok(InputSource::Staging);
        }
        let entry = reg.alloc_entry(self.setup.table_capacity)?;
        reg.pending_graph.push((send, entry));
        Ok(InputSource::Table(entry))
    }

    /// Number of graph-captured pull calls whose inputs await
    /// [`register_graph_buffers`](Self::register_graph_buffers).
    pub fn pending_graph_buffers(&self) -> usize {
        self.registry.lock().map(|r| r.pending_graph.len()).unwrap_or(0)
    }

    /// Collective (every rank, same order): makes the device buffer
    /// `ptr..ptr+bytes` readable by peers, so pull algorithms read it in
    /// place instead of staging it. Calls must pass exactly `ptr`.
    pub fn register_buffer(&self, ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        self.check()?;
        if ptr == 0 || bytes == 0 {
            return Err(Error::invalid("register_buffer: null pointer or empty range"));
        }
        let entry = {
            let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
            reg.alloc_entry(self.setup.table_capacity)?
        };
        self.fill_entries(&[(ptr, entry)])?;
        let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
        reg.registered.push(Registered { ptr, bytes, entry });
        Ok(())
    }

    /// Collective (every rank, after capturing the same graph): registers the
    /// inputs of every pull call captured since the last registration.
    /// Returns how many were registered. Replaying the graph before this
    /// fails with a clear error (no wrong data is read).
    pub fn register_graph_buffers(&self) -> Result<usize> {
        self.check()?;
        let pending = {
            let mut reg = self.registry.lock().map_err(|_| Error::Broken("registry lock poisoned".into()))?;
            std::mem::take(&mut reg.pending_graph)
        };
        let counts: Vec<usize> = gather_json(&*self.rendezvous, &pending.len())?;
        if counts.iter().any(|&c| c != pending.len()) {
            return Err(Error::invalid(format!(
                "register_graph_buffers: ranks captured different numbers of pull calls: {counts:?}; \
                 every rank must capture the same sequence of allreduces"
            )));
        }
        self.fill_entries(&pending)?;
        Ok(pending.len())
    }

    /// Exchanges this rank's buffers (in order) and writes, for each, the
    /// table entry holding every rank's address of its i-th buffer.
    fn fill_entries(&self, buffers: &[(u64, usize)]) -> Result<()> {
        // Registration may run on any thread (group helpers spawn one per rank).
        driver::bind(&self.ctx)?;
        let needs_ipc = self.setup.same_process.iter().any(|s| !s);
        let mut descs = Vec::with_capacity(buffers.len());
        for &(ptr, _) in buffers {
            let desc = if needs_ipc {
                let (base, _) = driver::allocation_range(ptr)?;
                // Exported afresh every time, never cached by address: a
                // freed buffer's address is reused by later allocations, and
                // a cached handle would make peers read the freed one.
                let handle = driver::ipc_export(&self.ctx, base)?;
                BufferDescriptor::Ipc { handle: handle.to_vec(), offset: ptr - base }
            } else {
                BufferDescriptor::Local { addr: ptr }
            };
            descs.push((desc, ptr));
        }
        let all: Vec<Vec<(BufferDescriptor, u64)>> = gather_json(&*self.rendezvous, &descs)?;
        let mut entries = vec![PeerPointers::default(); buffers.len()];
        let mut mappings = Vec::new();
        for (p, list) in all.iter().enumerate() {
            if list.len() != buffers.len() {
                return Err(Error::invalid(format!(
                    "rank {p} registered {} buffers in this step, rank {} registered {}",
                    list.len(),
                    self.rank,
                    buffers.len()
                )));
            }
            for (i, (desc, addr)) in list.iter().enumerate() {
                let address = if p == self.rank {
                    *addr
                } else {
                    let (a, mapping) = import(&self.ctx, desc, *addr, self.setup.same_process[p], 0)?;
                    mappings.push(mapping);
                    a
                };
                debug_assert!(p < MAX_RANKS);
                entries[i].ptrs[p] = address;
            }
        }
        for (entry, &(_, index)) in entries.iter().zip(buffers.iter()) {
            driver::write_struct(self.setup.table_entry(index), entry)?;
        }
        self.setup
            .registered_mappings
            .lock()
            .map_err(|_| Error::Broken("registry lock poisoned".into()))?
            .extend(mappings);
        Ok(())
    }
}
