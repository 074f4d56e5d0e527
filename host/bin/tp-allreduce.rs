//! `tp-allreduce`: benchmark against NCCL, inspect the PTX, plan and tune
//! algorithm selection, launch ranks.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tp_allreduce::tools::bench::{self, report, Mode, Options, Scenarios, Selection};
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
    /// Per-kernel registers, spills, memory operations and syncs from the
    /// embedded PTX (default sm_120); writes PTX and SASS to a folder.
    Inspect(InspectArgs),
    /// Start N processes, one per rank, with the rank environment set.
    Launch(LaunchArgs),
    /// Correctness check of a launched rank (run under `launch`).
    Selftest(SelftestArgs),
    /// Predicted algorithm and time per message size for a topology (no GPU
    /// needed; default: the 8x RTX PRO 6000 PCIe machine).
    Plan(PlanArgs),
    /// Discover and print this machine's GPU topology.
    Topo {
        /// Print the topology as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Measure every algorithm (and NCCL) per size bucket on this machine
    /// and write the tuning table communicators load.
    Tune(TuneArgs),
    /// Print a saved results.json as a table, write its plot, or compare two runs.
    Report {
        /// A results.json written by `bench`.
        results: PathBuf,
        /// Write the latency plot (SVG) here.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Print the speedup of `results` over this earlier results.json.
        #[arg(long)]
        compare: Option<PathBuf>,
    },
    /// One rank of `bench --processes` (started by the launcher).
    #[command(hide = true)]
    BenchRank(BenchArgs),
    /// Cross-process rendezvous check of a launched rank (no GPU needed).
    #[command(hide = true)]
    ProbeRendezvous {
        #[arg(long, default_value_t = 20)]
        rounds: usize,
    },
}

#[derive(Args)]
struct PlanArgs {
    /// Embedded topology name (see `--list`).
    #[arg(long)]
    topology: Option<String>,
    /// Ranks (default: every GPU of the topology).
    #[arg(long)]
    world: Option<usize>,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// List the embedded topologies.
    #[arg(long)]
    list: bool,
}

#[derive(Args)]
struct TuneArgs {
    /// GPUs to use (default: all visible).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Ranks per GPU.
    #[arg(long, default_value_t = 1)]
    ranks_per_gpu: usize,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Where to write the table (default: the path communicators look at).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Islands for the hierarchical algorithm (ranks per island).
    #[arg(long)]
    island_size: Option<usize>,
}

#[derive(Args)]
struct InspectArgs {
    /// Architecture: sm_120, sm_90, sm_89 or sm_80.
    #[arg(long, default_value = "sm_120")]
    arch: String,
    /// Where to write the PTX, cubin, ptxas log and SASS.
    #[arg(long, default_value = "results/inspect")]
    out: PathBuf,
}

#[derive(Args)]
struct LaunchArgs {
    /// Number of ranks (processes).
    #[arg(short = 'n', long)]
    ranks: usize,
    /// GPUs to place ranks on, round-robin (default: all on GPU 0).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Seconds the other ranks get after one fails, before they are killed.
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// Bound of the whole launch in seconds (0: none).
    #[arg(long, default_value_t = 0)]
    timeout: u64,
    /// The command each rank runs.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Args)]
struct SelftestArgs {
    /// A short run (fewer sizes and replays).
    #[arg(long)]
    quick: bool,
    /// Comma-separated algorithms (default: all of ours).
    #[arg(long)]
    algorithms: Option<String>,
    /// `R:K`: rank R SIGKILLs itself after K calls (fault test).
    #[arg(long)]
    fault: Option<String>,
    /// Seed shared by all ranks (default: from TP_ALLREDUCE_TEST_SEED or the job).
    #[arg(long)]
    seed: Option<u64>,
    /// Islands for the hierarchical algorithm (ranks per island).
    #[arg(long)]
    island_size: Option<usize>,
}

#[derive(Args, Clone)]
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
    /// One process per rank through the launcher (the deployment shape;
    /// NCCL rows are then graph-captured too). Ranks sharing a GPU need MPS.
    #[arg(long)]
    processes: bool,
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

fn plan(args: PlanArgs) -> Result<(), String> {
    if args.list {
        for name in tp_allreduce::select::topology::embedded::names() {
            println!("{name}");
        }
        return Ok(());
    }
    let topology = match &args.topology {
        Some(name) => tp_allreduce::select::topology::embedded::by_name(name).map_err(|e| e.to_string())?,
        None => tp_allreduce::select::topology::embedded::default_topology(),
    };
    let dtype = parse_dtype(&args.dtype)?;
    print!("{}", tp_allreduce::tools::plan::plan_report(&topology, args.world, dtype));
    Ok(())
}

fn topo(json: bool) -> Result<(), String> {
    let t = tp_allreduce::select::topology::discover::discover().map_err(|e| e.to_string())?;
    if json {
        println!("{}", t.to_json().map_err(|e| e.to_string())?);
    } else {
        print!("{}", t.summary());
        println!("fingerprint: {}", t.fingerprint());
    }
    Ok(())
}

fn tune(args: TuneArgs) -> Result<(), String> {
    if tp_allreduce::driver::device_count() == 0 {
        return Err("no CUDA device: tuning measures this machine's GPUs".into());
    }
    let gpus =
        if args.gpus.is_empty() { (0..tp_allreduce::driver::device_count()).collect() } else { args.gpus.clone() };
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
    if args.island_size.is_some() {
        config.island_size = args.island_size;
    }
    config.algorithm = None;
    let opts = Options {
        sizes: tp_allreduce::select::tuning::default_buckets(),
        dtype: parse_dtype(&args.dtype)?,
        selections: Vec::new(),
        include_nccl: true,
        mode: Mode::Graph,
        iterations: 20,
        repeats: 5,
        warmup: 2,
        gpus: gpus.clone(),
        ranks_per_gpu: args.ranks_per_gpu.max(1),
        config: config.clone(),
    };
    let outcome = bench::tune(&opts, args.out).map_err(|e| e.to_string())?;
    println!(
        "tuned {} measurements in {:.1} s; table written to {}",
        outcome.measured,
        outcome.seconds,
        outcome.path.display()
    );
    print!(
        "{}",
        outcome
            .table
            .to_toml_string()
            .map_err(|e| e.to_string())?
            .lines()
            .filter(|l| l.starts_with("bytes") || l.starts_with("winner =") || l.starts_with("dtype"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!();
    // A new communicator on the same ranks must load and use it.
    let ranks = bench::Ranks::new(&gpus, opts.ranks_per_gpu).map_err(|e| e.to_string())?;
    let mut check_config = config;
    check_config.algorithm = None;
    std::env::set_var(tp_allreduce::env::TUNING_FILE, &outcome.path);
    let comms = bench::our_group(&ranks, &check_config).map_err(|e| e.to_string())?;
    for n in comms[0].notes() {
        println!("communicator: {n}");
    }
    println!("communicator selects (graph): {}", comms[0].selection().describe(opts.dtype, true));
    Ok(())
}

fn bench_options(args: &BenchArgs) -> Result<(Options, Scenarios), String> {
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
    // The launch floor and the efficiency scenario are in-process only.
    let scenarios = Scenarios {
        verify_pass: !args.no_verify_pass,
        efficiency: args.efficiency && !args.processes,
        launch_floor: !args.processes,
    };
    Ok((opts, scenarios))
}

fn write_outputs(rep: &report::Report, out: Option<PathBuf>, compare: Option<PathBuf>) -> Result<(), String> {
    print!("{}", report::render_table(rep));
    let out = out.unwrap_or_else(|| PathBuf::from("results").join(format!("bench-{}", rep.date_utc.replace(':', ""))));
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    report::write_csv(rep, &out.join("results.csv")).map_err(|e| e.to_string())?;
    report::write_json(rep, &out.join("results.json")).map_err(|e| e.to_string())?;
    std::fs::write(out.join("latency.svg"), report::render_svg(rep)).map_err(|e| e.to_string())?;
    println!("results: {}/results.{{csv,json}}, {}/latency.svg", out.display(), out.display());
    if let Some(old) = compare {
        let old = report::read_json(&old).map_err(|e| e.to_string())?;
        print!("{}", report::render_compare(&old, rep));
    }
    Ok(())
}

fn bench(args: BenchArgs) -> Result<(), String> {
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    if tp_allreduce::driver::device_count() == 0 {
        println!("no CUDA device: nothing to measure here; the plan for the default topology instead (`tp-allreduce plan`):\n");
        return plan(PlanArgs { topology: None, world: None, dtype: args.dtype.clone(), list: false });
    }
    let (opts, scenarios) = bench_options(&args)?;
    if args.processes {
        // One process per rank: this command again as `bench-rank` workers.
        let exe = std::env::current_exe().map_err(|e| format!("locating this executable: {e}"))?;
        let mut worker: Vec<String> = vec![exe.display().to_string(), "bench-rank".into()];
        worker.extend(std::env::args().skip(2).filter(|a| a != "--processes"));
        let gpus: Vec<usize> = opts.gpus.iter().flat_map(|&g| std::iter::repeat_n(g, opts.ranks_per_gpu)).collect();
        let launch = tp_allreduce::tools::launcher::LaunchOptions {
            world_size: gpus.len(),
            gpus,
            grace: std::time::Duration::from_secs(30),
            timeout: None,
        };
        let outcomes = tp_allreduce::tools::launcher::launch(&launch, &worker).map_err(|e| e.to_string())?;
        return match outcomes.iter().find(|o| !o.success) {
            None => Ok(()),
            Some(o) => Err(format!("bench rank {} failed: {}", o.rank, o.status)),
        };
    }
    let rep = bench::run(&opts, &scenarios, &command_line).map_err(|e| e.to_string())?;
    write_outputs(&rep, args.out, args.compare)
}

fn bench_rank(args: BenchArgs) -> Result<(), String> {
    let env = rank_env()?;
    let command_line =
        format!("tp-allreduce bench --processes {}", std::env::args().skip(2).collect::<Vec<_>>().join(" "));
    let (opts, scenarios) = bench_options(&BenchArgs { processes: true, ..args.clone() })?;
    match bench::processes::run_rank(&env, &opts, &scenarios, &command_line)
        .map_err(|e| format!("rank {}: {e}", env.rank))?
    {
        Some(rep) => write_outputs(&rep, args.out, args.compare),
        None => Ok(()),
    }
}

fn inspect(args: InspectArgs) -> Result<(), String> {
    let report = tp_allreduce::tools::inspect::inspect(&args.arch, &args.out).map_err(|e| e.to_string())?;
    print!("{}", tp_allreduce::tools::inspect::render(&report));
    println!("files: {}", args.out.display());
    Ok(())
}

fn launch(args: LaunchArgs) -> Result<(), String> {
    let opts = tp_allreduce::tools::launcher::LaunchOptions {
        world_size: args.ranks,
        gpus: args.gpus,
        grace: std::time::Duration::from_secs(args.grace),
        timeout: (args.timeout > 0).then(|| std::time::Duration::from_secs(args.timeout)),
    };
    let outcomes = tp_allreduce::tools::launcher::launch(&opts, &args.command).map_err(|e| e.to_string())?;
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.success).collect();
    for o in &outcomes {
        eprintln!("launch: rank {}: {}", o.rank, o.status);
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} of {} ranks failed", failed.len(), outcomes.len()))
    }
}

fn rank_env() -> Result<tp_allreduce::RankEnv, String> {
    tp_allreduce::RankEnv::from_env()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "not started by `tp-allreduce launch` (TP_ALLREDUCE_RANK is not set)".to_string())
}

fn selftest(args: SelftestArgs) -> Result<(), String> {
    let env = rank_env()?;
    let algorithms = match &args.algorithms {
        None => Algorithm::OURS.to_vec(),
        Some(list) => {
            list.split(',').map(|a| a.parse::<Algorithm>().map_err(|e| e.to_string())).collect::<Result<_, _>>()?
        }
    };
    let fault = match &args.fault {
        None => None,
        Some(f) => {
            let (r, k) = f.split_once(':').ok_or("--fault takes RANK:CALLS")?;
            Some((r.parse().map_err(|_| "bad fault rank")?, k.parse().map_err(|_| "bad fault call count")?))
        }
    };
    let seed = args
        .seed
        .or_else(tp_allreduce::env::test_seed)
        .unwrap_or_else(|| u64::from_le_bytes(env.id.job_id()[..8].try_into().unwrap()));
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
    if args.island_size.is_some() {
        config.island_size = args.island_size;
    }
    let sizes: Vec<usize> = if args.quick {
        vec![2, 18, 4_096, 43_008, 262_142]
    } else {
        vec![2, 6, 18, 34, 1_000, 4_096, 16_386, 43_008, 65_538, 262_142, 1_048_578, 8_388_608]
    };
    let opts = tp_allreduce::tools::selftest::SelftestOptions {
        sizes,
        dtypes: DType::ALL.to_vec(),
        algorithms,
        graph_allreduces: if args.quick { 50 } else { 60 },
        graph_replays: if args.quick { 200 } else { 300 },
        seed,
        fault,
        config,
    };
    println!("rank {}: seed {seed}", env.rank);
    let summary = tp_allreduce::tools::selftest::run(&env, &opts).map_err(|e| format!("rank {}: {e}", env.rank))?;
    println!(
        "rank {}: selftest passed: {} eager cases, {} graph replays, {} registration rounds \
         ({} reused the previous round's addresses) ({:.1} s)",
        env.rank,
        summary.eager_cases,
        summary.graph_replays,
        summary.registration_rounds,
        summary.reused_addresses,
        summary.elapsed.as_secs_f64()
    );
    Ok(())
}

fn probe_rendezvous(rounds: usize) -> Result<(), String> {
    let env = rank_env()?;
    let rdv = tp_allreduce::rendezvous::connect(&env.id, env.rank, env.world_size, std::time::Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    for round in 0..rounds {
        let mine = format!("rank {} round {round} pid {}", env.rank, std::process::id()).into_bytes();
        let all = rdv.all_gather(&mine).map_err(|e| e.to_string())?;
        for (r, got) in all.iter().enumerate() {
            let text = String::from_utf8_lossy(got);
            if !text.starts_with(&format!("rank {r} round {round} pid ")) {
                return Err(format!("round {round}: rank {r} sent {text:?}"));
            }
        }
    }
    println!("rank {}: {rounds} rendezvous rounds across {} processes ok", env.rank, env.world_size);
    Ok(())
}

fn report_cmd(results: &std::path::Path, svg: Option<PathBuf>, compare: Option<PathBuf>) -> Result<(), String> {
    let rep = report::read_json(results).map_err(|e| e.to_string())?;
    print!("{}", report::render_table(&rep));
    if let Some(path) = svg {
        std::fs::write(&path, report::render_svg(&rep)).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("plot: {}", path.display());
    }
    if let Some(old) = compare {
        let old = report::read_json(&old).map_err(|e| e.to_string())?;
        print!("{}", report::render_compare(&old, &rep));
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(a) => bench(a),
        Command::BenchRank(a) => bench_rank(a),
        Command::Inspect(a) => inspect(a),
        Command::Launch(a) => launch(a),
        Command::Selftest(a) => selftest(a),
        Command::ProbeRendezvous { rounds } => probe_rendezvous(rounds),
        Command::Plan(a) => plan(a),
        Command::Topo { json } => topo(json),
        Command::Tune(a) => tune(a),
        Command::Report { results, svg, compare } => report_cmd(&results, svg, compare),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
