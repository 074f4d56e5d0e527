//! CPU-side paths: per-call selection lookup, the cost model evaluated at
//! init, the registered-buffer lookup, and a rendezvous round trip over
//! loopback TCP and a Unix socket.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tp_allreduce::rendezvous::{connect, Id};
use tp_allreduce::select::cost_model::{CostModel, CostParams};
use tp_allreduce::select::selection::{Constraints, SelectionTable};
use tp_allreduce::{Algorithm, DType, Transport};

fn selection(c: &mut Criterion) {
    let view = tp_allreduce::select::topology::embedded::default_topology();
    let model = CostModel::new(CostParams::default());
    let constraints = Constraints::for_topology(&view);
    c.bench_function("selection_table_build (init, 8x RTX PRO 6000)", |b| {
        b.iter(|| SelectionTable::build(&model, None, black_box(&view), &constraints))
    });
    let table = SelectionTable::build(&model, None, &view, &constraints);
    let mut size = 1usize;
    c.bench_function("selection_lookup (per call)", |b| {
        b.iter(|| {
            size = size.wrapping_mul(2654435761).wrapping_add(1) % (16 << 20);
            black_box(table.lookup(black_box(size), DType::Bf16, true).algorithm)
        })
    });
    let opts = tp_allreduce::select::cost_model::Options::for_topology(&view);
    c.bench_function("cost_model_predict (one algorithm, one size)", |b| {
        b.iter(|| {
            model.predict(&view, black_box(Algorithm::Hierarchical), Transport::PeerToPeer, black_box(43_008), &opts)
        })
    });
}

fn registry_lookup(c: &mut Criterion) {
    // The registered-buffer lookup is a linear scan over registrations (a
    // model has a few dozen): measure the scan at 64 entries.
    let regs: Vec<(u64, usize)> = (0..64).map(|i| (0x7f00_0000_0000 + i * 0x10_0000, 0x10_0000)).collect();
    c.bench_function("registered_buffer_lookup (64 registrations)", |b| {
        b.iter(|| regs.iter().position(|r| r.0 == black_box(0x7f00_0000_0000 + 63 * 0x10_0000)))
    });
}

fn rendezvous_round_trip(c: &mut Criterion) {
    for (name, id) in [
        ("rendezvous_round_trip (2 ranks, loopback TCP)", Id::new_tcp(free_port())),
        ("rendezvous_round_trip (2 ranks, Unix socket)", Id::new_unix().unwrap()),
    ] {
        let peer_id = id.clone();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let r = connect(&peer_id, 1, 2, Duration::from_secs(10)).unwrap();
            while stop_rx.try_recv().is_err() {
                if r.all_gather(b"pong").is_err() {
                    break;
                }
            }
        });
        let root = connect(&id, 0, 2, Duration::from_secs(10)).unwrap();
        c.bench_function(name, |b| b.iter(|| root.all_gather(black_box(b"ping")).unwrap()));
        let _ = stop_tx.send(());
        let _ = root.all_gather(b"last");
        drop(root);
        let _ = peer.join();
        id.remove_files();
    }
}

fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = selection, registry_lookup, rendezvous_round_trip
}
criterion_main!(benches);
