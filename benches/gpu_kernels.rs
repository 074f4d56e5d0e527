//! Single-GPU kernel timings with CUDA events (criterion `iter_custom`):
//! the allreduce kernels of a 2-rank in-process group on GPU 0 at 42 KB
//! bf16, and the elementwise sum. Without a GPU every benchmark is skipped
//! with a visible line.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tp_allreduce::{Algorithm, Comm, Config, DType};
use tp_allreduce_cli::bench::{Buffers, OurGroup, Ranks};

fn gpu(c: &mut Criterion) {
    if tp_allreduce::driver::device_count() == 0 {
        eprintln!("skipped: no CUDA device (gpu_kernels benchmarks)");
        return;
    }
    std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    let ranks = Ranks::new(&[0], 2).expect("ranks");
    let mut comms = Comm::from_streams(ranks.streams.clone(), Config::default()).expect("group");
    let mut bufs = Buffers::new(&ranks, 43_008, DType::Bf16, 42).expect("buffers");
    for a in Algorithm::OURS {
        if comms.iter_mut().try_for_each(|c| c.set_algorithm(Some(a))).is_err() {
            eprintln!("skipped: {a} not available on this group");
            continue;
        }
        let group = OurGroup { comms: &comms };
        c.bench_function(&format!("allreduce 2 ranks 42 KB bf16 {a} (eager, CUDA events)"), |b| {
            b.iter_custom(|iters| {
                let opts = tp_allreduce_cli::bench::Options {
                    iterations: iters as usize,
                    repeats: 1,
                    warmup: 0,
                    mode: tp_allreduce_cli::bench::Mode::Eager,
                    ..tp_allreduce_cli::bench::Options::default()
                };
                let samples =
                    tp_allreduce_cli::bench::time_collective(&group, &ranks, &mut bufs, &opts).expect("timed");
                Duration::from_secs_f64(samples[0] * 1e-6 * iters as f64)
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300)).sample_size(10);
    targets = gpu
}
criterion_main!(benches);
