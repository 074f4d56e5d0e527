//! [`DeviceBuffer`]: typed device memory that peers can map.
//!
//! cudarc's `CudaStream::alloc` may hand out memory from a stream-ordered
//! pool, which CUDA IPC cannot export, so pull algorithms could not register
//! it. A `DeviceBuffer` is allocated with `cuMemAlloc` (through
//! [`DeviceMemory`]) and can be registered (`Comm::register_buffer`,
//! `register_graph_buffers`). It implements cudarc's [`DevicePtr`] and
//! [`DevicePtrMut`], so it goes straight into the safe
//! [`Comm::all_reduce`](crate::Comm::all_reduce) and
//! [`Comm::all_reduce_in_place`](crate::Comm::all_reduce_in_place);
//! [`DeviceBuffer::slice`] and [`DeviceBuffer::slice_mut`] give views of a
//! sub-range (an element offset, e.g. to test inputs that are not 16-byte
//! aligned) that implement the same traits.
//!
//! Ordering: a buffer is bound to one stream and records no events
//! (`SyncOnDrop::Record(None)`): work is ordered by the caller's stream, as
//! with cudarc's event tracking disabled. The host copies
//! ([`DeviceBuffer::to_host`], [`DeviceBuffer::copy_from_host`],
//! [`DeviceBuffer::fill_bytes`]) first wait for the buffer's stream and
//! return once the copy is complete, so they are ordered after the work
//! queued before them and before the work queued after them (they cannot be
//! used during graph capture).
#![forbid(unsafe_code)]

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::driver::{self, DeviceMemory};
use crate::error::{Error, Result};

/// `len` elements of `T` in device memory from `cuMemAlloc`, bound to a
/// stream. Freed on drop (wait for, or deregister, every use first).
pub struct DeviceBuffer<T> {
    memory: DeviceMemory,
    len: usize,
    stream: Arc<CudaStream>,
    element: PhantomData<T>,
}

impl<T: Pod> DeviceBuffer<T> {
    /// `len` elements with unspecified contents, on `stream`'s device.
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid(format!("DeviceBuffer: {len} elements overflow the address space")))?;
        let memory = DeviceMemory::alloc(stream.context(), bytes)?;
        Ok(DeviceBuffer { memory, len, stream: stream.clone(), element: PhantomData })
    }

    /// `len` zero bytes' worth of elements.
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let mut buffer = Self::alloc(stream, len)?;
        buffer.fill_bytes(0)?;
        Ok(buffer)
    }

    /// A copy of `values`.
    pub fn from_host(stream: &Arc<CudaStream>, values: &[T]) -> Result<Self> {
        let mut buffer = Self::alloc(stream, values.len())?;
        buffer.copy_from_host(values)?;
        Ok(buffer)
    }

    /// Overwrites the buffer with `values` (same length).
    pub fn copy_from_host(&mut self, values: &[T]) -> Result<()> {
        self.check_host_len(values.len())?;
        self.copy_bytes_from_host(bytemuck::cast_slice(values))
    }

    /// Overwrites the buffer with raw bytes (`num_bytes()` of them): element
    /// bit patterns prepared on the host.
    pub fn copy_bytes_from_host(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.num_bytes() {
            return Err(Error::invalid(format!(
                "DeviceBuffer: {} bytes given for a buffer of {} bytes",
                bytes.len(),
                self.num_bytes()
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        driver::synchronize(&self.stream)?;
        driver::memcpy_htod(self.memory.ptr(), bytes)
    }

    /// The contents, after the work queued on the buffer's stream.
    pub fn to_host(&self) -> Result<Vec<T>> {
        let mut values = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut values)?;
        Ok(values)
    }

    /// Copies the contents into `values` (same length).
    pub fn copy_to_host(&self, values: &mut [T]) -> Result<()> {
        self.check_host_len(values.len())?;
        self.copy_range_to_host(0, bytemuck::cast_slice_mut(values))
    }

    /// The raw bytes, after the work queued on the buffer's stream.
    pub fn to_host_bytes(&self) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; self.num_bytes()];
        self.copy_range_to_host(0, &mut bytes)?;
        Ok(bytes)
    }

    /// Sets every byte to `value` (e.g. 0x7F to poison an output).
    pub fn fill_bytes(&mut self, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        driver::synchronize(&self.stream)?;
        driver::memset_d8(self.memory.ptr(), value, self.num_bytes())
    }

    /// A read-only view of the elements in `range`.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceView<'_, T>> {
        let (offset, len) = sub_range(self.len, range)?;
        Ok(DeviceView { buffer: self, offset, len })
    }

    /// A writable view of the elements in `range`.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceViewMut<'_, T>> {
        let (offset, len) = sub_range(self.len, range)?;
        Ok(DeviceViewMut { buffer: self, offset, len })
    }

    fn check_host_len(&self, host_len: usize) -> Result<()> {
        if host_len == self.len {
            Ok(())
        } else {
            Err(Error::invalid(format!("DeviceBuffer: host slice of {host_len} elements for a buffer of {}", self.len)))
        }
    }

    fn copy_range_to_host(&self, byte_offset: usize, bytes: &mut [u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        driver::synchronize(&self.stream)?;
        driver::memcpy_dtoh(bytes, self.memory.ptr() + byte_offset as u64)
    }
}

impl<T> DeviceBuffer<T> {
    /// The device address of the first element: what `Comm::register_buffer`
    /// takes, and how tests see whether the allocator reused an address.
    pub fn device_address(&self) -> sys::CUdeviceptr {
        self.memory.ptr()
    }

    /// The stream the buffer is bound to.
    pub fn bound_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn address_of(&self, offset: usize) -> sys::CUdeviceptr {
        self.memory.ptr() + (offset * std::mem::size_of::<T>()) as u64
    }
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("address", &format_args!("{:#x}", self.memory.ptr()))
            .field("len", &self.len)
            .field("element", &std::any::type_name::<T>())
            .finish()
    }
}

/// `(offset, len)` of `range` inside `0..len`, or why not.
fn sub_range(len: usize, range: impl RangeBounds<usize>) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::invalid(format!("DeviceBuffer: range {start}..{end} is outside 0..{len}")));
    }
    Ok((start, end - start))
}

/// A read-only sub-range of a [`DeviceBuffer`].
pub struct DeviceView<'a, T> {
    buffer: &'a DeviceBuffer<T>,
    offset: usize,
    len: usize,
}

/// A writable sub-range of a [`DeviceBuffer`].
pub struct DeviceViewMut<'a, T> {
    buffer: &'a mut DeviceBuffer<T>,
    offset: usize,
    len: usize,
}

impl<T> DeviceView<'_, T> {
    /// Element offset of the view in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl<T> DeviceViewMut<'_, T> {
    /// Element offset of the view in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        // No events: the caller's stream orders every use (module docs).
        (self.address_of(0), SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.address_of(0), SyncOnDrop::Record(None))
    }
}

impl<T> DeviceSlice<T> for DeviceView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.buffer.stream
    }
}

impl<T> DevicePtr<T> for DeviceView<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.buffer.address_of(self.offset), SyncOnDrop::Record(None))
    }
}

impl<T> DeviceSlice<T> for DeviceViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.buffer.stream
    }
}

impl<T> DevicePtr<T> for DeviceViewMut<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.buffer.address_of(self.offset), SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for DeviceViewMut<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.buffer.address_of(self.offset), SyncOnDrop::Record(None))
    }
}

#[cfg(test)]
mod tests {
    use super::sub_range;

    #[test]
    fn sub_ranges_inside_and_outside() {
        assert_eq!(sub_range(10, ..).unwrap(), (0, 10));
        assert_eq!(sub_range(10, 3..).unwrap(), (3, 7));
        assert_eq!(sub_range(10, 3..=4).unwrap(), (3, 2));
        assert_eq!(sub_range(10, ..0).unwrap(), (0, 0));
        assert_eq!(sub_range(10, 10..).unwrap(), (10, 0));
        assert!(sub_range(10, 3..11).is_err());
        assert!(sub_range(10, 11..).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = sub_range(10, 5..4);
        assert!(reversed.unwrap_err().to_string().contains("5..4"));
        assert!(sub_range(10, ..=usize::MAX).is_err());
    }
}
