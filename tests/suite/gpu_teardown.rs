//! Teardown of in-process groups (issue 13 item 9). A peer's late write —
//! a ring receiver's last credit, a peer still calling after a rank left —
//! must never land in memory its owner already freed: a group keeps every
//! rank's peer-visible memory until its last communicator goes.
//!
//! Two ranks: on GPUs 0 and 1 when two are visible, else both on GPU 0.
//! Afterwards a fresh group must pass a checked call of every algorithm: a
//! write into freed memory shows there as a sticky CUDA error (illegal
//! address), or as a changed canary allocation.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice};
use rand::rngs::StdRng;
use tp_allreduce::driver::DeviceMemory;
use tp_allreduce::{Algorithm, Comm, Config, DType, Error};

use crate::common::{self, check_sum, random_vec, Case, POISON};

const N: usize = 65_536; // 256 KiB of f32: several ring chunks, within one-shot push's limit.
const REPEATS: usize = 5;

fn config() -> Config {
    Config {
        timeout: Duration::from_secs(2),
        launch_timeout: Duration::from_secs(2),
        rendezvous_timeout: Duration::from_secs(30),
        // Many groups are created: skip NCCL's slow init (not under test).
        nccl_fallback: false,
        ..Config::default()
    }
}

/// Rank 0's and rank 1's contexts.
fn contexts(test: &str) -> Option<[Arc<CudaContext>; 2]> {
    let ctx0 = common::gpu(test)?;
    let ctx1 = if tp_allreduce::driver::device_count() >= 2 {
        crate::common::second_gpu(test).expect("second GPU")
    } else {
        ctx0.clone()
    };
    eprintln!("{test}: ranks on GPUs {} and {}", ctx0.ordinal(), ctx1.ordinal());
    Some([ctx0, ctx1])
}

fn group(ctxs: &[Arc<CudaContext>; 2]) -> Vec<Comm> {
    let streams = ctxs.iter().map(|c| c.new_stream().expect("new_stream")).collect();
    Comm::from_streams(streams, config()).expect("group init")
}

/// The algorithms this group runs, in an order that ends with `last`.
fn available(comms: &mut [Comm], last: Algorithm) -> Vec<Algorithm> {
    Algorithm::allreduce_algorithms()
        .filter(|&a| a != last)
        .chain([last])
        .filter(|&a| comms.iter_mut().all(|c| c.set_algorithm(Some(a)).is_ok()))
        .collect()
}

/// One call per algorithm on every rank, none waited for; returns every
/// rank's inputs and outputs per call (checked after the group is gone).
type Calls = Vec<(Algorithm, Vec<Vec<f32>>, Vec<(CudaSlice<f32>, CudaSlice<f32>)>)>;

fn calls_in_flight(comms: &mut [Comm], algorithms: &[Algorithm], rng: &mut StdRng) -> Calls {
    let mut calls = Vec::new();
    for &algorithm in algorithms {
        let inputs: Vec<Vec<f32>> = comms.iter().map(|_| random_vec(rng, N)).collect();
        let mut buffers = Vec::new();
        for (r, c) in comms.iter_mut().enumerate() {
            c.set_algorithm(Some(algorithm)).expect("available");
            let s = c.stream();
            let input = s.clone_htod(&inputs[r]).expect("htod");
            let output = s.clone_htod(&vec![f32::from_bits(u32::from_ne_bytes([POISON; 4])); N]).expect("htod");
            let (src, dst) = (common::ptr_of(&s, &input, 0), common::ptr_of(&s, &output, 0));
            // SAFETY: live buffers of N f32 on this rank's stream; they are
            // dropped only after the communicators (whose drop waits).
            unsafe { c.all_reduce_raw(src, dst, N, DType::F32, s.cu_stream()) }
                .unwrap_or_else(|e| panic!("{algorithm} rank {r}: {e}"));
            buffers.push((input, output));
        }
        calls.push((algorithm, inputs, buffers));
    }
    calls
}

/// A fresh group on the same GPUs passes a checked call of every algorithm
/// and every context synchronises without error.
fn devices_are_healthy(test: &str, ctxs: &[Arc<CudaContext>; 2], rng: &mut StdRng) {
    let mut comms = group(ctxs);
    let mut checked = 0;
    for algorithm in available(&mut comms, Algorithm::Ring) {
        comms.iter_mut().for_each(|c| c.set_algorithm(Some(algorithm)).unwrap());
        let case = Case { algorithm, count: N, offset: 0, in_place: false };
        common::run_case::<f32>(&comms, rng, case).unwrap_or_else(|e| panic!("{test}: afterwards, {algorithm}: {e}"));
        checked += 1;
    }
    drop(comms);
    for ctx in ctxs {
        ctx.bind_to_thread().unwrap();
        tp_allreduce::driver::context_synchronize()
            .unwrap_or_else(|e| panic!("{test}: GPU {} reports an error afterwards: {e}", ctx.ordinal()));
    }
    eprintln!("{test}: afterwards a fresh group passed {checked} algorithms");
}

#[test]
fn dropping_a_group_right_after_unsynchronised_calls_in_either_order() {
    let test = "dropping_a_group_right_after_unsynchronised_calls_in_either_order";
    let _lock = common::gpu_lock();
    let Some(ctxs) = contexts(test) else { return };
    let mut rng = common::rng(test);
    let mut groups = 0;
    for repeat in 0..REPEATS {
        for last in [Algorithm::Ring, Algorithm::OneShotPush, Algorithm::TwoShotPush, Algorithm::OneShotPull] {
            for (order, close) in [([0, 1], false), ([1, 0], false), ([1, 0], true), ([0, 1], true)] {
                let mut comms = group(&ctxs);
                let algorithms = available(&mut comms, last);
                let calls = calls_in_flight(&mut comms, &algorithms, &mut rng);
                // Right after the calls, in this order, on this thread.
                let mut slots: Vec<Option<Comm>> = comms.into_iter().map(Some).collect();
                for r in order {
                    let comm = slots[r].take().unwrap();
                    if close {
                        comm.close().unwrap_or_else(|e| panic!("{test}: close of rank {r}: {e}"));
                    } else {
                        drop(comm);
                    }
                }
                groups += 1;
                // Every call completed before its communicator went.
                for (algorithm, inputs, buffers) in calls {
                    for (r, (_, output)) in buffers.iter().enumerate() {
                        let out = output.stream().clone_dtoh(output).expect("dtoh");
                        check_sum(&inputs, &out, algorithm.max_roundings(2)).unwrap_or_else(|e| {
                            panic!("{test}: repeat {repeat}, order {order:?}, {algorithm} rank {r}: {e}")
                        });
                    }
                }
            }
        }
    }
    eprintln!("{test}: {groups} groups dropped or closed right after their calls");
    devices_are_healthy(test, &ctxs, &mut rng);
}

/// Old code: rank 0's drop freed its region at once; rank 1's one-shot
/// push then wrote its payload into freed memory (illegal address, or a
/// canary that reused the range changes).
#[test]
fn a_rank_calling_after_its_peer_left_writes_only_into_live_memory() {
    let test = "a_rank_calling_after_its_peer_left_writes_only_into_live_memory";
    let _lock = common::gpu_lock();
    let Some(ctxs) = contexts(test) else { return };
    let mut rng = common::rng(test);
    for repeat in 0..REPEATS {
        let mut comms = group(&ctxs);
        comms.iter_mut().for_each(|c| c.set_algorithm(Some(Algorithm::OneShotPush)).unwrap());
        let case = Case { algorithm: Algorithm::OneShotPush, count: N, offset: 0, in_place: false };
        common::run_case::<f32>(&comms, &mut rng, case).expect("a call with both ranks");
        let survivor = comms.pop().unwrap();
        drop(comms); // rank 0 leaves
                     // Allocations made now would reuse memory rank 0 freed.
        let canaries: Vec<DeviceMemory> = [2usize, 2, 2, 2, 4, 8, 16, 32]
            .iter()
            .map(|mib| {
                let m = DeviceMemory::alloc(&ctxs[0], mib << 20).expect("canary");
                ctxs[0].bind_to_thread().unwrap();
                tp_allreduce::driver::memset_d8(m.ptr(), 0x5A, mib << 20).expect("memset");
                m
            })
            .collect();
        let s = survivor.stream();
        let input = s.clone_htod(&random_vec::<f32>(&mut rng, N)).unwrap();
        let output = s.alloc_zeros::<f32>(N).unwrap();
        let (src, dst) = (common::ptr_of(&s, &input, 0), common::ptr_of(&s, &output, 0));
        // SAFETY: live buffers of N f32 on the survivor's stream.
        unsafe { survivor.all_reduce_raw(src, dst, N, DType::F32, s.cu_stream()) }.expect("launch");
        match survivor.synchronize() {
            Err(Error::Timeout(_) | Error::PeerAborted(_)) => {}
            other => panic!("{test}: repeat {repeat}: a call without its peer gave {other:?}, want a timeout"),
        }
        for c in &canaries {
            let mut host = vec![0u8; c.bytes()];
            ctxs[0].bind_to_thread().unwrap();
            tp_allreduce::driver::memcpy_dtoh(&mut host, c.ptr()).expect("dtoh");
            let changed = host.iter().filter(|&&b| b != 0x5A).count();
            assert_eq!(changed, 0, "{test}: repeat {repeat}: a peer wrote {changed} bytes into freed memory");
        }
        drop(survivor);
        drop((input, output));
    }
    eprintln!("{test}: {REPEATS} times a rank called after its peer left: timeout, no write into freed memory");
    devices_are_healthy(test, &ctxs, &mut rng);
}
