//! Several communicators with calls in flight on one GPU at once (issue 35
//! item 2): two groups of 4 ranks (islands 2+2) and three groups (4+2+2),
//! all ranks on GPU 0 as streams of one process, one thread per rank, no
//! synchronisation between the groups; every allreduce algorithm that runs
//! there, at 32 KB and 4 MB f32 (before the device turns, 4 MB timed out
//! for two-shot-push, hierarchical, pipelined-hierarchical and one-shot-pull).
//! Also: the same while a kernel holds every SM for a while, and graphs
//! that capture one rank of each group on one stream, replayed together.
//! Every output is checked against the f64 sum and bit for bit across the
//! ranks of its group.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tp_allreduce::{Algorithm, Comm, Config, ReduceOp};

use crate::common::{self, bits, check_sum, random_vec};

fn config(island_size: Option<usize>) -> Config {
    Config {
        timeout: Duration::from_secs(10),
        launch_timeout: Duration::from_secs(20),
        island_size,
        ..Config::default()
    }
}

/// Groups of `sizes` ranks on GPU 0 (islands of 2 where a group has 4).
fn groups(ctx: &Arc<CudaContext>, sizes: &[usize]) -> Vec<Vec<Comm>> {
    // Created one after the other, as an engine does.
    sizes
        .iter()
        .map(|&n| {
            let islands = (n == 4).then_some(2);
            Comm::from_streams(common::streams(ctx, n), config(islands)).expect("group init")
        })
        .collect()
}

/// What one rank's thread checks: `calls` allreduces of fresh inputs
/// (seeded per group and call, so every rank of a group knows the others'),
/// each output against the f64 sum and returned for the cross-rank check.
fn rank_calls(comm: &Comm, seed: u64, count: usize, calls: usize, start: &Barrier) -> Result<Vec<Vec<u32>>, String> {
    let world = comm.world_size();
    let s = comm.stream();
    let mut outputs = Vec::new();
    let mut pending = Vec::new();
    start.wait();
    for call in 0..calls {
        // Every rank of the group derives every rank's input.
        let mut rng = StdRng::seed_from_u64(seed ^ (call as u64) << 20);
        let inputs: Vec<Vec<f32>> = (0..world).map(|_| random_vec::<f32>(&mut rng, count)).collect();
        let send = s.clone_htod(&inputs[comm.rank()]).map_err(|e| e.to_string())?;
        let mut recv: CudaSlice<f32> = s.alloc_zeros(count).map_err(|e| e.to_string())?;
        comm.all_reduce(&send, &mut recv, &ReduceOp::Sum).map_err(|e| format!("call {call}: {e}"))?;
        pending.push((inputs, send, recv));
    }
    comm.synchronize().map_err(|e| format!("rank {}: {e}", comm.rank()))?;
    for (call, (inputs, _send, recv)) in pending.into_iter().enumerate() {
        let out = s.clone_dtoh(&recv).map_err(|e| e.to_string())?;
        let roundings =
            comm.plan_call(count * 4, tp_allreduce::DType::F32, false, false).algorithm.max_roundings(world);
        check_sum(&inputs, &out, roundings).map_err(|e| format!("rank {} call {call}: {e}", comm.rank()))?;
        outputs.push(bits(&out));
    }
    Ok(outputs)
}

/// Every rank of every group calls `calls` times from its own thread, all
/// groups at once; checks the sums and that the ranks of a group agree.
fn run_groups_concurrently(groups: &[Vec<Comm>], count: usize, calls: usize, what: &str) {
    let ranks: usize = groups.iter().map(Vec::len).sum();
    let start = Barrier::new(ranks);
    let results: Vec<Vec<Result<Vec<Vec<u32>>, String>>> = std::thread::scope(|scope| {
        let handles: Vec<Vec<_>> = groups
            .iter()
            .enumerate()
            .map(|(g, comms)| {
                comms
                    .iter()
                    .map(|c| {
                        let start = &start;
                        scope.spawn(move || rank_calls(c, 0x5eed_0000 + g as u64, count, calls, start))
                    })
                    .collect()
            })
            .collect();
        handles.into_iter().map(|hs| hs.into_iter().map(|h| h.join().expect("rank thread")).collect()).collect()
    });
    for (g, group) in results.into_iter().enumerate() {
        let outs: Vec<Vec<Vec<u32>>> =
            group.into_iter().map(|r| r.unwrap_or_else(|e| panic!("{what}, group {g}: {e}"))).collect();
        for (r, o) in outs.iter().enumerate() {
            assert_eq!(o, &outs[0], "{what}, group {g}: rank {r}'s bits differ from rank 0's");
        }
    }
}

/// The algorithms every group here can run (forced on every rank).
fn force(groups: &mut [Vec<Comm>], algorithm: Option<Algorithm>) -> bool {
    for comms in groups.iter_mut() {
        for c in comms.iter_mut() {
            if c.set_algorithm(algorithm).is_err() {
                return false;
            }
        }
    }
    true
}

#[test]
fn two_and_three_communicators_in_flight_on_one_gpu() {
    let _gpu = common::gpu_lock();
    let Some(ctx) = common::gpu("two_and_three_communicators_in_flight_on_one_gpu") else { return };
    let mut checked = 0;
    for sizes in [&[4, 4][..], &[4, 2, 2]] {
        let mut gs = groups(&ctx, sizes);
        let algorithms: Vec<Option<Algorithm>> =
            std::iter::once(None).chain(Algorithm::allreduce_algorithms().map(Some)).collect();
        for algorithm in algorithms {
            if !force(&mut gs, algorithm) {
                eprintln!("groups {sizes:?}: {algorithm:?} does not run here (forced on every group)");
                continue;
            }
            for count in [8 * 1024, 1 << 20] {
                let what = format!("groups {sizes:?}, {algorithm:?}, {} KB", count * 4 / 1024);
                run_groups_concurrently(&gs, count, 6, &what);
                checked += 1;
                eprintln!("{what}: ok");
            }
        }
    }
    eprintln!("concurrent communicators: {checked} configurations checked");
    assert!(checked >= 12, "too few configurations ran ({checked})");
}

/// A kernel that spins for `ns` nanoseconds (globaltimer) in every thread:
/// launched over every SM, it holds them while the collectives are issued.
const HOLD_SMS_PTX: &str = r#"
.version 7.8
.target sm_80
.address_size 64
.visible .entry hold_sms(.param .u64 ns)
{
    .reg .u64 %t0, %t1, %d, %lim;
    .reg .pred %p;
    ld.param.u64 %lim, [ns];
    mov.u64 %t0, %globaltimer;
LOOP:
    mov.u64 %t1, %globaltimer;
    sub.u64 %d, %t1, %t0;
    setp.lt.u64 %p, %d, %lim;
    @%p bra LOOP;
    ret;
}
"#;

#[test]
fn communicators_in_flight_while_a_kernel_holds_every_sm() {
    let _gpu = common::gpu_lock();
    let Some(ctx) = common::gpu("communicators_in_flight_while_a_kernel_holds_every_sm") else { return };
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(HOLD_SMS_PTX)).expect("load hold_sms");
    let hold = module.load_function("hold_sms").expect("hold_sms");
    let sms = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .expect("SM count") as u32;
    let busy: Arc<CudaStream> = ctx.new_stream().expect("stream");
    let mut gs = groups(&ctx, &[4, 4]);
    for algorithm in [Some(Algorithm::TwoShotPush), Some(Algorithm::Hierarchical), None] {
        assert!(force(&mut gs, algorithm), "{algorithm:?} runs on 2+2 islands");
        let ns: u64 = 300_000_000;
        let cfg = LaunchConfig { grid_dim: (4 * sms, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: hold_sms takes one u64 and touches no memory.
        unsafe { busy.launch_builder(&hold).arg(&ns).launch(cfg) }.expect("launch hold_sms");
        run_groups_concurrently(&gs, 1 << 20, 4, &format!("{algorithm:?} beside a kernel holding every SM"));
        busy.synchronize().expect("hold_sms");
        eprintln!("{algorithm:?} beside a kernel holding every SM: ok");
    }
}

/// Graphs: stream j captures rank j of group A's call, then rank j of group
/// B's (a graph orders the calls captured on one stream: the documented way
/// to replay several communicators' graphs at once); the 4 graphs are
/// replayed together 50 times with fresh inputs between replays.
#[test]
fn graphs_of_two_communicators_replayed_together() {
    let _gpu = common::gpu_lock();
    let Some(ctx) = common::gpu("graphs_of_two_communicators_replayed_together") else { return };
    let gs = groups(&ctx, &[4, 4]);
    let count = 1 << 20;
    let streams = common::streams(&ctx, 4);
    let mut rng = common::rng("graphs_of_two_communicators_replayed_together");
    let mut bufs: Vec<Vec<(CudaSlice<f32>, CudaSlice<f32>)>> = gs
        .iter()
        .map(|_| {
            (0..4)
                .map(|j| {
                    let s = &streams[j];
                    (s.alloc_zeros::<f32>(count).expect("alloc"), s.alloc_zeros::<f32>(count).expect("alloc"))
                })
                .collect()
        })
        .collect();
    let mut graphs = Vec::new();
    for (j, s) in streams.iter().enumerate() {
        s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .expect("begin capture");
        for (g, comms) in gs.iter().enumerate() {
            let (send, recv) = &bufs[g][j];
            let (src, _a) = send.device_ptr(s);
            let (dst, _b) = recv.device_ptr(s);
            // SAFETY: live buffers of `count` f32 on the communicator's
            // context, alive until the graphs are dropped below; a live stream.
            unsafe { comms[j].all_reduce_raw(src, dst, count, tp_allreduce::DType::F32, s.cu_stream()) }
                .expect("captured call");
        }
        graphs.push(
            s.end_capture(
                cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .expect("end capture")
            .expect("a graph"),
        );
    }
    for comms in &gs {
        Comm::register_graph_buffers_group(comms).expect("register");
    }
    for replay in 0..50 {
        let inputs: Vec<Vec<Vec<f32>>> =
            (0..2).map(|_| (0..4).map(|_| random_vec::<f32>(&mut rng, count)).collect()).collect();
        for (g, per_rank) in bufs.iter_mut().enumerate() {
            for (j, (send, _)) in per_rank.iter_mut().enumerate() {
                streams[j].memcpy_htod(&inputs[g][j], send).expect("htod");
            }
        }
        for g in &graphs {
            g.launch().expect("replay");
        }
        for s in &streams {
            s.synchronize().expect("replay sync");
        }
        for (g, per_rank) in bufs.iter().enumerate() {
            let mut first = None;
            for (j, (_, recv)) in per_rank.iter().enumerate() {
                let out = streams[j].clone_dtoh(recv).expect("dtoh");
                let algorithm = gs[g][j].plan_call(count * 4, tp_allreduce::DType::F32, true, false).algorithm;
                check_sum(&inputs[g], &out, algorithm.max_roundings(4))
                    .unwrap_or_else(|e| panic!("replay {replay} group {g} rank {j}: {e}"));
                let b = bits(&out);
                assert!(first.get_or_insert_with(|| b.clone()) == &b, "replay {replay} group {g}: ranks differ");
            }
        }
    }
    for comms in &gs {
        comms.iter().try_for_each(|c| c.check()).expect("no device error");
    }
    eprintln!("graphs of two communicators: 50 replays x 2 groups x 4 ranks checked");
}
