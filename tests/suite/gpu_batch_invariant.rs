//! `Config::batch_invariant`: an element's result must not depend on how
//! long the message around it is (the batch size), in plain and fused
//! calls. 3 ranks on GPU 0 (with three or more ranks the ring and
//! hierarchical sum in other orders): a fixed head of every rank's input
//! inside messages of many lengths, the head's output bits compared
//! across lengths; the same for the first row of fused calls of 1 to 200
//! rows. Without the option the selection picks size-dependent
//! algorithms on this view (shown by the plan), with it never.

use std::time::Duration;

use half::bf16;
use rand::Rng;
use tp_allreduce::{Algorithm, Comm, Config, FusedOptions};

use crate::common::{self, bits, check_sum};

fn group(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, batch_invariant: bool) -> Vec<Comm> {
    let config = Config {
        timeout: Duration::from_secs(3),
        launch_timeout: Duration::from_secs(3),
        island_size: Some(1),
        batch_invariant,
        ..Config::default()
    };
    Comm::from_streams(common::streams(ctx, 3), config).expect("group init")
}

#[test]
fn results_do_not_depend_on_the_message_length() {
    let _lock = common::gpu_lock();
    let test = "results_do_not_depend_on_the_message_length";
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let comms = group(&ctx, true);
    let head = 4_096;
    let heads: Vec<Vec<bf16>> = (0..3).map(|_| common::random_vec(&mut rng, head)).collect();
    let mut first: Option<Vec<u32>> = None;
    let mut chosen = Vec::new();
    // 8 KB to 32 MB of bf16: every size bucket the selection has.
    for total in [head, 10_000, 65_536, 300_000, 1 << 20, 4 << 20, 16 << 20] {
        let plan = comms[0].plan_call(total * 2, tp_allreduce::DType::Bf16, false, false);
        assert!(!Algorithm::BATCH_VARIANT.contains(&plan.algorithm), "{total}: {plan:?}");
        chosen.push(format!("{} -> {}", total * 2, plan.algorithm));
        let inputs: Vec<Vec<bf16>> = heads
            .iter()
            .map(|h| {
                let mut v = h.clone();
                v.extend(common::random_vec::<bf16>(&mut rng, total - head));
                v
            })
            .collect();
        let bufs: Vec<_> = comms.iter().zip(&inputs).map(|(c, v)| c.stream().clone_htod(v).unwrap()).collect();
        let mut outs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<bf16>(total).unwrap()).collect();
        for ((c, i), o) in comms.iter().zip(&bufs).zip(outs.iter_mut()) {
            c.all_reduce(i, o, &tp_allreduce::ReduceOp::Sum).unwrap();
        }
        for (r, (c, o)) in comms.iter().zip(&outs).enumerate() {
            c.synchronize().unwrap();
            let out = c.stream().clone_dtoh(o).unwrap();
            check_sum(&inputs, &out, 1).unwrap_or_else(|e| panic!("{total} rank {r}: {e}"));
            let b = bits(&out[..head]);
            match &first {
                None => first = Some(b),
                Some(f) => assert_eq!(&b, f, "{total} elements, rank {r}: the head's bits changed with the length"),
            }
        }
    }
    eprintln!("{test}: {}", chosen.join(", "));
}

#[test]
fn fused_rows_do_not_depend_on_the_row_count() {
    let _lock = common::gpu_lock();
    let test = "fused_rows_do_not_depend_on_the_row_count";
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let comms = group(&ctx, true);
    let hidden = 7_168;
    let row: Vec<Vec<bf16>> = (0..3).map(|_| common::random_vec(&mut rng, hidden)).collect();
    let residual_row: Vec<bf16> = common::random_vec(&mut rng, hidden);
    let weight: Vec<bf16> = (0..hidden).map(|_| bf16::from_f32(rng.gen_range(0.5..1.5))).collect();
    let mut first: Option<(Vec<u32>, Vec<u32>)> = None;
    for rows in [1, 2, 3, 7, 64, 200] {
        let plan = comms[0].plan_fused(rows, hidden, tp_allreduce::DType::Bf16, false);
        let mut residual = residual_row.clone();
        residual.extend(common::random_vec::<bf16>(&mut rng, (rows - 1) * hidden));
        let mut per_rank = Vec::new();
        for (c, head) in comms.iter().zip(&row) {
            let mut x = head.clone();
            x.extend(common::random_vec::<bf16>(&mut rng, (rows - 1) * hidden));
            let s = c.stream();
            let x = s.clone_htod(&x).unwrap();
            let res = s.clone_htod(&residual).unwrap();
            let w = s.clone_htod(&weight).unwrap();
            let normed = s.alloc_zeros::<bf16>(rows * hidden).unwrap();
            per_rank.push((x, res, w, normed));
        }
        for (c, (x, res, w, normed)) in comms.iter().zip(per_rank.iter_mut()) {
            c.all_reduce_add_rms_norm(x, res, w, 1e-6, normed, &FusedOptions::default()).unwrap();
        }
        for (r, (c, (_, res, _, normed))) in comms.iter().zip(&per_rank).enumerate() {
            c.synchronize().unwrap();
            let res = c.stream().clone_dtoh(res).unwrap();
            let normed = c.stream().clone_dtoh(normed).unwrap();
            let b = (bits(&res[..hidden]), bits(&normed[..hidden]));
            match &first {
                None => first = Some(b),
                Some(f) => {
                    assert_eq!(&b, f, "{rows} rows ({}), rank {r}: row 0 changed with the row count", plan.reason)
                }
            }
        }
    }
}
