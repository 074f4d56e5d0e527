//! Parsing and validation of `bench`'s command line (no GPU needed).
#![forbid(unsafe_code)]

use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn parse(args: &[&str]) -> Result<BenchArgs, String> {
    let argv = std::iter::once("bench").chain(args.iter().copied());
    Cli::try_parse_from(argv).map(|c| c.bench).map_err(|e| e.to_string())
}

#[test]
fn sizes_with_units() {
    assert_eq!(parse_size("4K"), Ok(4096));
    assert_eq!(parse_size("42kb"), Ok(43_008));
    assert_eq!(parse_size("8M"), Ok(8 << 20));
    assert_eq!(parse_size(" 1000 "), Ok(1000));
    assert_eq!(parse_size("1.5K"), Ok(1536));
    assert_eq!(parse_size("16B"), Ok(16));
    for bad in ["12Q", "", "K", "-4K", "0", "0.1", "nan", "inf", "2000000M"] {
        let e = parse_size(bad).unwrap_err();
        assert!(e.contains("bad size"), "{bad}: {e}");
    }
    assert_eq!(parse_sizes("default").unwrap().0, default_sizes());
    assert_eq!(parse_sizes("1K,42K").unwrap().0, [1024, 43_008]);
    assert!(parse_sizes("1K,,2K").is_err());
}

#[test]
fn algorithms_and_nccl() {
    let l = parse_algorithms("auto,nccl").unwrap();
    assert_eq!((l.selections, l.include_nccl), (vec![Selection::Auto], true));
    let l = parse_algorithms("one-shot-push, ring").unwrap();
    assert_eq!(l.selections, [Selection::Forced(Algorithm::OneShotPush), Selection::Forced(Algorithm::Ring)]);
    assert!(!l.include_nccl);
    let all = parse_algorithms("all").unwrap();
    assert_eq!(all.selections.len(), 1 + Algorithm::allreduce_algorithms().count());
    assert!(all.include_nccl);
    assert!(parse_algorithms("frobnicate").is_err());
}

#[test]
fn the_command_line_is_validated_before_anything_runs() {
    for (args, needle) in [
        (&["--sizes", "12Q"][..], "bad size"),
        (&["--ranks-per-gpu", "0"], "at least 1"),
        (&["--algorithms", "frobnicate"], "frobnicate"),
        (&["--mode", "lazy"], "lazy"),
        (&["--dtype", "f64"], "bad dtype"),
        (&["--iterations", "0"], "at least 1"),
        (&["--repeats", "0"], "at least 1"),
        (&["--island-size", "0"], "at least 1"),
    ] {
        let e = parse(args).unwrap_err();
        assert!(e.contains(needle), "{args:?}: {e}");
    }
}

#[test]
fn defaults_and_options() {
    let a = parse(&[]).unwrap();
    assert_eq!(a.sizes.0, default_sizes());
    assert_eq!((a.dtype, a.mode, a.ranks_per_gpu), (DType::Bf16, Mode::Graph, 1));
    let (opts, scenarios) = a.options(2, Config::default()).unwrap();
    assert_eq!(opts.gpus, [0, 1]);
    assert!(opts.include_nccl);
    assert_eq!(scenarios, Scenarios { verify_pass: true, efficiency: false, launch_floor: true, fused: None });

    let a =
        parse(&["--sizes", "42K", "--dtype", "f16", "--mode", "eager", "--gpus", "1", "--ranks-per-gpu", "4"]).unwrap();
    let (opts, _) = a.options(2, Config::default()).unwrap();
    assert_eq!((opts.sizes, opts.dtype, opts.mode), (vec![43_008], DType::F16, Mode::Eager));
    assert_eq!((opts.gpus, opts.ranks_per_gpu), (vec![1], 4));

    let a = parse(&["--processes", "--efficiency", "--no-verify-pass", "--island-size", "2"]).unwrap();
    let (opts, scenarios) = a.options(1, Config::default()).unwrap();
    assert_eq!(scenarios, Scenarios::default());
    assert_eq!(opts.config.island_size, Some(2));

    let a = parse(&["--fused"]).unwrap();
    assert_eq!(a.options(1, Config::default()).unwrap().1.fused, Some((3, 7168)));
    let a = parse(&["--fused", "--fused-shape", "7x5120"]).unwrap();
    assert_eq!(a.options(1, Config::default()).unwrap().1.fused, Some((7, 5120)));
    for bad in ["7", "0x5120", "3x0", "ax2", "3x7168x2"] {
        assert!(parse(&["--fused-shape", bad]).is_err(), "{bad}");
    }
}

#[test]
fn gpus_must_exist_and_be_distinct() {
    assert!(check_gpus(&[0, 1], 2).is_ok());
    assert!(check_gpus(&[2], 2).unwrap_err().contains("GPU 2 does not exist"));
    assert!(check_gpus(&[0, 0], 2).unwrap_err().contains("--ranks-per-gpu"));
    assert!(check_gpus(&[], 0).is_err());
    let a = parse(&["--gpus", "3"]).unwrap();
    assert!(a.options(2, Config::default()).is_err());
}

#[test]
fn the_collective_picks_its_own_algorithms() {
    assert_eq!(parse_collective("all-gather"), Ok(Collective::AllGather));
    assert_eq!(parse_collective(" Reduce-Scatter "), Ok(Collective::ReduceScatter));
    assert_eq!(parse_collective("all-reduce"), Ok(Collective::AllReduce));
    assert!(parse_collective("broadcast").unwrap_err().contains("bad collective"));

    let (opts, scenarios) = parse(&["--collective", "all-gather"]).unwrap().options(1, Config::default()).unwrap();
    assert_eq!((opts.collective, opts.selections), (Collective::AllGather, vec![Selection::Auto]));
    assert_eq!(scenarios, Scenarios::default(), "the allreduce's scenarios do not run");

    let a = parse(&["--collective", "reduce-scatter", "--algorithms", "all"]).unwrap();
    let (opts, _) = a.options(1, Config::default()).unwrap();
    assert_eq!(opts.selections, [Selection::Auto, Selection::Forced(Algorithm::ReduceScatterPush)]);
    assert!(opts.include_nccl);

    let a = parse(&["--collective", "all-gather", "--algorithms", "one-shot-push"]).unwrap();
    let e = a.options(1, Config::default()).unwrap_err();
    assert!(e.contains("one-shot-push is not an algorithm of the all-gather"), "{e}");
    let a = parse(&["--algorithms", "all-gather-push"]).unwrap();
    assert!(a.options(1, Config::default()).unwrap_err().contains("not an algorithm of the allreduce"));
    for extra in ["--processes", "--fused", "--efficiency", "--trace"] {
        let e = parse(&["--collective", "all-gather", extra]).unwrap().options(1, Config::default()).unwrap_err();
        assert!(e.contains("runs in one process"), "{extra}: {e}");
    }
}
