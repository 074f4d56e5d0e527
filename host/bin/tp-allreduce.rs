//! `tp-allreduce`: benchmark against NCCL, inspect the PTX, plan and tune
//! algorithm selection, launch ranks.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tp_allreduce::bench::{self, report, Mode, Options, Scenarios, Selection};
use tp_allreduce::{Algorithm, Config, DType};

#[derive(Parser)]
#[command(name = "tp-allreduce", version, about = "Fast CUDA-graph-capturable allreduce for tensor-parallel inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time allreduce against NCCL on the visible GPUs (in-process ranks).
    Bench(BenchArgs),
}

#[derive(Args)]
struct BenchArgs {
    /// Message sizes, e.g. `1K,42K,8M` (`default`: 1 KB .. 64 MB doubling + 42 KB).
    #[arg(long, default_value = "default")]
    sizes: String,
    /// Element type: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Comma-separated: `auto`, algorithm names, `nccl`, or `all`.
    #[arg(long, default_value = "auto,nccl")]
    algorithms: String,
    /// Allreduces per timed sample (graph replay or eager loop).
    #[arg(long, default_value_t = 100)]
    iterations: usize,
    /// Timed samples per configuration.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// `graph` (replay of captured allreduces) or `eager`.
    #[arg(long, default_value = "graph")]
    mode: String,
    /// GPUs to use (default: all visible).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Ranks per GPU (the only option for several ranks on one GPU).
    #[arg(long, default_value_t = 1)]
    ranks_per_gpu: usize,
    /// Results directory (CSV, JSON, SVG).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the ratio against an earlier results.json.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Skip the verify-pass scenario (122 x 42 KB bf16 in one graph).
    #[arg(long)]
    no_verify_pass: bool,
    /// Also measure the single-GPU large-message efficiency (2 ranks, 64 MB).
    #[arg(long)]
    efficiency: bool,
    /// Islands for the hierarchical algorithm (ranks per island).
    #[arg(long)]
    island_size: Option<usize>,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("MB").or_else(|| t.strip_suffix('M')) {
        (n, 1usize << 20)
    } else if let Some(n) = t.strip_suffix("KB").or_else(|| t.strip_suffix('K')) {
        (n, 1 << 10)
    } else if let Some(n) = t.strip_suffix('B') {
        (n, 1)
    } else {
        (t.as_str(), 1)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("bad size `{s}` (examples: 4K, 42K, 8M, 1000)"))?;
    Ok((v * mult as f64) as usize)
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == s.trim().to_ascii_lowercase())
        .ok_or_else(|| format!("bad dtype `{s}`: f32, f16 or bf16"))
}

fn bench(args: BenchArgs) -> Result<(), String> {
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    if tp_allreduce::driver::device_count() == 0 {
        println!("no CUDA device: nothing to benchmark here (run on a GPU machine).");
        return Ok(());
    }
    let sizes = if args.sizes == "default" {
        bench::default_sizes()
    } else {
        args.sizes.split(',').map(parse_size).collect::<Result<Vec<_>, _>>()?
    };
    let dtype = parse_dtype(&args.dtype)?;
    let mut selections = Vec::new();
    let mut include_nccl = false;
    for a in args.algorithms.split(',').map(|s| s.trim()) {
        match a {
            "all" => {
                selections.push(Selection::Auto);
                selections.extend(Algorithm::OURS.iter().map(|a| Selection::Forced(*a)));
                include_nccl = true;
            }
            "nccl" => include_nccl = true,
            other => selections.push(other.parse::<Selection>().map_err(|e| e.to_string())?),
        }
    }
    let mode = match args.mode.as_str() {
        "graph" => Mode::Graph,
        "eager" => Mode::Eager,
        m => return Err(format!("bad mode `{m}`: graph or eager")),
    };
    let gpus =
        if args.gpus.is_empty() { (0..tp_allreduce::driver::device_count()).collect() } else { args.gpus.clone() };
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
    if args.island_size.is_some() {
        config.island_size = args.island_size;
    }
    let opts = Options {
        sizes,
        dtype,
        selections,
        include_nccl,
        mode,
        iterations: args.iterations.max(1),
        repeats: args.repeats.max(1),
        warmup: args.warmup,
        gpus,
        ranks_per_gpu: args.ranks_per_gpu.max(1),
        config,
    };
    let scenarios = Scenarios { verify_pass: !args.no_verify_pass, efficiency: args.efficiency, launch_floor: true };
    let rep = bench::run(&opts, &scenarios, &command_line).map_err(|e| e.to_string())?;
    print!("{}", report::render_table(&rep));
    let out =
        args.out.unwrap_or_else(|| PathBuf::from("results").join(format!("bench-{}", rep.date_utc.replace(':', ""))));
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    report::write_csv(&rep, &out.join("results.csv")).map_err(|e| e.to_string())?;
    report::write_json(&rep, &out.join("results.json")).map_err(|e| e.to_string())?;
    std::fs::write(out.join("latency.svg"), report::render_svg(&rep)).map_err(|e| e.to_string())?;
    println!("results: {}/results.{{csv,json}}, {}/latency.svg", out.display(), out.display());
    if let Some(old) = args.compare {
        let old = report::read_json(&old).map_err(|e| e.to_string())?;
        print!("{}", report::render_compare(&old, &rep));
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(a) => bench(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
