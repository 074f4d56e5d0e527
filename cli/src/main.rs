//! `tp-allreduce`: benchmark against NCCL, inspect the PTX, plan and tune
//! algorithm selection, launch ranks.
//!
//! Every command parses and validates all of its arguments first (a bad
//! value is an error on stderr and a non-zero exit, with or without a GPU),
//! writes its results to stdout, and stops quietly when stdout is closed
//! (`tp-allreduce report r.json | head`).
#![forbid(unsafe_code)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tp_allreduce::{Algorithm, Config, DType};
use tp_allreduce_cli::bench::options::{at_least_one, parse_dtype, parse_sizes, SizeList};
use tp_allreduce_cli::bench::{self, plot, report, BenchArgs, Mode, Options};
use tp_allreduce_cli::plan::{self, PlanRequest};

/// Why a command stopped early.
enum Failure {
    /// An error for stderr (and a non-zero exit).
    Message(String),
    /// Whoever read stdout stopped reading: stop quietly.
    StdoutClosed,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Message(message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure::Message(message.to_string())
    }
}

type CliResult<T = ()> = Result<T, Failure>;

/// Writes `text` to stdout; a closed stdout (broken pipe) is not an error
/// to report, just the end.
fn emit(text: impl AsRef<str>) -> CliResult {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_ref().as_bytes()).and_then(|()| out.flush()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Failure::StdoutClosed
        } else {
            Failure::Message(format!("writing to stdout: {e}"))
        }
    })
}

fn text<E: std::fmt::Display>(e: E) -> Failure {
    Failure::Message(e.to_string())
}

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
    /// Embedded topology name (see `--list`; default: TP_ALLREDUCE_TOPOLOGY,
    /// else the 8x RTX PRO 6000 PCIe machine).
    #[arg(long)]
    topology: Option<String>,
    /// Ranks (default: every GPU of the topology times --ranks-per-gpu).
    #[arg(long, value_parser = at_least_one)]
    world: Option<usize>,
    /// Ranks sharing each GPU (the first world / ranks-per-gpu GPUs are used).
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    ranks_per_gpu: usize,
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: DType,
    /// Message sizes, e.g. `4K,42K,8M` (default: 4 KB .. 8 MB doubling + 42 KB).
    #[arg(long, value_parser = parse_sizes)]
    sizes: Option<SizeList>,
    /// Model eager calls instead of CUDA-graph replay.
    #[arg(long)]
    eager: bool,
    /// Plan the compressed wire (`fp8` or `int8`; issue 38, no kernel yet):
    /// two-shot push over it against lossless and NCCL (default sizes
    /// 256 KB .. 64 MB), where it stops paying, and its accuracy emulated
    /// on the CPU.
    #[arg(long, default_value = "lossless", value_parser = tp_allreduce::wire::parse_wire)]
    wire: tp_allreduce::wire::WireFormat,
    /// List the embedded topologies.
    #[arg(long)]
    list: bool,
    /// Show the tables measured `auto` cached for this world size and
    /// dtype (in DIR, default the cache directory: TP_ALLREDUCE_CACHE_DIR,
    /// else ~/.cache/tp-allreduce), each measurement beside the model's
    /// prediction.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "")]
    measured: Option<PathBuf>,
}

#[derive(Args)]
struct TuneArgs {
    /// GPUs to use (default: all visible).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Ranks per GPU.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    ranks_per_gpu: usize,
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: DType,
    /// Where to write the table (default: the path communicators look at).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Islands for the hierarchical algorithm (ranks per island).
    #[arg(long)]
    island_size: Option<usize>,
    /// Size buckets to measure, e.g. `4K,42K,1M` (`default`: 1 KB .. 64 MB
    /// doubling + 42 KB).
    #[arg(long, value_parser = parse_sizes)]
    sizes: Option<SizeList>,
    /// Launch shapes of one-shot-push: `default` (the default rule) or
    /// `full` (sweep blocks x threads, verified, slowest rank; the winner
    /// goes into the table).
    #[arg(long, value_enum, default_value_t = bench::Shapes::Default)]
    shapes: bench::Shapes,
    /// Write every measured shape (JSON) here.
    #[arg(long)]
    report: Option<PathBuf>,
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
    /// `R:MS`: rank R sleeps MS milliseconds before its first call (launch skew).
    #[arg(long)]
    delay_first_call: Option<String>,
    /// Seed shared by all ranks (default: from TP_ALLREDUCE_TEST_SEED or the job).
    #[arg(long)]
    seed: Option<u64>,
    /// Islands for the hierarchical algorithm (ranks per island).
    #[arg(long)]
    island_size: Option<usize>,
    /// Graph replays per algorithm (default: 200 with --quick, else 300).
    #[arg(long)]
    replays: Option<usize>,
}

fn plan(args: PlanArgs) -> CliResult {
    if args.list {
        return emit(tp_allreduce::select::topology::embedded::names().join("\n") + "\n");
    }
    let topology = plan::topology(args.topology.as_deref())?;
    let mut req = PlanRequest::for_world(topology, args.world, args.ranks_per_gpu, args.dtype)?;
    req.wire = args.wire;
    if args.wire.is_lossy() {
        req.sizes = plan::wire_report_sizes();
    }
    if let Some(sizes) = args.sizes {
        req.sizes = sizes.0;
    }
    req.capturing = !args.eager;
    if let Some(dir) = args.measured {
        let configured = (!dir.as_os_str().is_empty()).then_some(dir);
        let cache = tp_allreduce::select::measured::MeasuredCache::locate(configured.as_deref())
            .ok_or("no cache directory: pass --measured DIR, or set TP_ALLREDUCE_CACHE_DIR or HOME")?;
        return emit(plan::measured_report(&req, &cache)?);
    }
    emit(plan::plan_report(&req)?)
}

fn topo(json: bool) -> CliResult {
    let t = tp_allreduce::select::topology::discover::discover().map_err(text)?;
    if json {
        emit(t.to_json().map_err(text)? + "\n")
    } else {
        let islands = t.islands().map_or("none".to_string(), |i| format!("{:?}", i.groups));
        emit(
            tp_allreduce_cli::topology_view::render(&t, &(0..t.len()).collect::<Vec<_>>())
                + &format!("islands: {islands}\n"),
        )
    }
}

fn tune(args: TuneArgs) -> CliResult {
    let visible = tp_allreduce::driver::device_count();
    if visible == 0 {
        return Err("no CUDA device: tuning measures this machine's GPUs".into());
    }
    let gpus = if args.gpus.is_empty() { (0..visible).collect() } else { args.gpus.clone() };
    bench::options::check_gpus(&gpus, visible)?;
    let mut config = Config::from_env().map_err(text)?;
    if args.island_size.is_some() {
        config.island_size = args.island_size;
    }
    config.algorithm = None;
    let opts = Options {
        sizes: args.sizes.map(|s| s.0).unwrap_or_else(tp_allreduce::select::tuning::default_buckets),
        dtype: args.dtype,
        selections: Vec::new(),
        include_nccl: true,
        mode: Mode::Graph,
        iterations: 20,
        repeats: 5,
        warmup: 2,
        gpus: gpus.clone(),
        ranks_per_gpu: args.ranks_per_gpu,
        config: config.clone(),
        collective: tp_allreduce::Collective::AllReduce,
    };
    let outcome = bench::tune(&opts, args.out, args.shapes).map_err(text)?;
    if let Some(path) = &args.report {
        let json = serde_json::to_string_pretty(&outcome.sweep).map_err(text)?;
        std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let winners: Vec<String> = outcome
        .table
        .entries
        .iter()
        .map(|e| {
            let results: Vec<String> = e
                .results
                .iter()
                .map(|r| match r.shape() {
                    Some((b, t)) => format!("{} {:.2} us ({b}x{t})", r.algorithm, r.median_us),
                    None => format!("{} {:.2} us", r.algorithm, r.median_us),
                })
                .collect();
            format!("{} {:>8}: winner {}; {}", e.dtype.name(), e.bytes, e.winner, results.join(", "))
        })
        .collect();
    emit(format!(
        "tuned {} measurements in {:.1} s; table written to {}\n{}\n",
        outcome.measured,
        outcome.seconds,
        outcome.path.display(),
        winners.join("\n")
    ))?;
    // A new communicator on the same ranks must load and use it.
    let ranks = bench::Ranks::new(&gpus, opts.ranks_per_gpu).map_err(text)?;
    std::env::set_var(tp_allreduce::env::TUNING_FILE, &outcome.path);
    let comms = bench::our_group(&ranks, &config).map_err(text)?;
    let mut lines: String = comms[0].notes().iter().map(|n| format!("communicator: {n}\n")).collect();
    lines += &format!("communicator selects (graph): {}\n", comms[0].selection().describe(opts.dtype, true));
    emit(lines)
}

fn write_outputs(rep: &report::Report, out: Option<PathBuf>, compare: Option<PathBuf>) -> CliResult {
    let out = out.unwrap_or_else(|| PathBuf::from("results").join(format!("bench-{}", rep.date_utc.replace(':', ""))));
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    report::write_csv(rep, &out.join("results.csv")).map_err(text)?;
    report::write_json(rep, &out.join("results.json")).map_err(text)?;
    std::fs::write(out.join("latency.svg"), plot::render_svg(rep)).map_err(text)?;
    let mut shown = report::render_table(rep);
    shown += &format!("results: {}/results.{{csv,json}}, {}/latency.svg\n", out.display(), out.display());
    if let Some(old) = compare {
        let old = report::read_json(&old).map_err(text)?;
        shown += &report::render_compare(&old, rep);
    }
    emit(shown)
}

/// Without a GPU: the model's plan for what the arguments ask for (dtype,
/// sizes, GPUs and ranks per GPU, graph or eager) on the embedded topology
/// (`TP_ALLREDUCE_TOPOLOGY`, else the default one).
fn bench_plan(args: &BenchArgs) -> CliResult {
    let topology = plan::topology(None)?;
    let max_gpus = (tp_allreduce_kernels::layout::MAX_RANKS / args.ranks_per_gpu).clamp(1, topology.len());
    let gpus: Vec<usize> = if args.gpus.is_empty() { (0..max_gpus).collect() } else { args.gpus.clone() };
    let mut req = PlanRequest::on_gpus(topology, &gpus, args.ranks_per_gpu, args.dtype)?;
    req.sizes = args.sizes.0.clone();
    req.capturing = args.mode == Mode::Graph;
    emit(format!(
        "no CUDA device: nothing to measure here. The model's plan instead (`tp-allreduce plan`): {} ranks on \
         GPUs {gpus:?} of `{}`, {}, {} mode; --algorithms, --iterations, --repeats, --warmup and the output \
         options apply to measurements only.\n\n{}",
        req.world(),
        req.topology.name,
        req.dtype.name(),
        args.mode.name(),
        plan::plan_report(&req)?
    ))
}

fn bench(args: BenchArgs) -> CliResult {
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    let visible = tp_allreduce::driver::device_count();
    if visible == 0 {
        return bench_plan(&args);
    }
    let (opts, scenarios) = args.options(visible, Config::from_env().map_err(text)?)?;
    if args.processes {
        // One process per rank: this command again as `bench-rank` workers.
        let exe = std::env::current_exe().map_err(|e| format!("locating this executable: {e}"))?;
        let mut worker: Vec<String> = vec![exe.display().to_string(), "bench-rank".into()];
        worker.extend(std::env::args().skip(2).filter(|a| a != "--processes"));
        let gpus: Vec<usize> = opts.gpus.iter().flat_map(|&g| std::iter::repeat_n(g, opts.ranks_per_gpu)).collect();
        let launch = tp_allreduce_cli::launcher::LaunchOptions {
            world_size: gpus.len(),
            gpus,
            grace: std::time::Duration::from_secs(30),
            timeout: None,
        };
        let outcomes = tp_allreduce_cli::launcher::launch(&launch, &worker).map_err(text)?;
        return match outcomes.iter().find(|o| !o.success) {
            None => Ok(()),
            Some(o) => Err(format!("bench rank {} failed: {}", o.rank, o.status).into()),
        };
    }
    let rep = bench::run(&opts, &scenarios, &command_line).map_err(text)?;
    write_outputs(&rep, args.out, args.compare)
}

fn bench_rank(args: BenchArgs) -> CliResult {
    let env = rank_env()?;
    let command_line =
        format!("tp-allreduce bench --processes {}", std::env::args().skip(2).collect::<Vec<_>>().join(" "));
    let visible = tp_allreduce::driver::device_count();
    let (opts, scenarios) =
        BenchArgs { processes: true, ..args.clone() }.options(visible, Config::from_env().map_err(text)?)?;
    match bench::processes::run_rank(&env, &opts, &scenarios, &command_line)
        .map_err(|e| format!("rank {}: {e}", env.rank))?
    {
        Some(rep) => write_outputs(&rep, args.out, args.compare),
        None => Ok(()),
    }
}

fn inspect(args: InspectArgs) -> CliResult {
    let report = tp_allreduce_cli::inspect::inspect(&args.arch, &args.out).map_err(text)?;
    emit(tp_allreduce_cli::inspect::render(&report) + &format!("files: {}\n", args.out.display()))
}

fn launch(args: LaunchArgs) -> CliResult {
    let opts = tp_allreduce_cli::launcher::LaunchOptions {
        world_size: args.ranks,
        gpus: args.gpus,
        grace: std::time::Duration::from_secs(args.grace),
        timeout: (args.timeout > 0).then(|| std::time::Duration::from_secs(args.timeout)),
    };
    let outcomes = tp_allreduce_cli::launcher::launch(&opts, &args.command).map_err(text)?;
    let failed = outcomes.iter().filter(|o| !o.success).count();
    for o in &outcomes {
        eprintln!("launch: rank {}: {}", o.rank, o.status);
    }
    if failed == 0 {
        Ok(())
    } else {
        Err(format!("{failed} of {} ranks failed", outcomes.len()).into())
    }
}

fn rank_env() -> CliResult<tp_allreduce::RankEnv> {
    tp_allreduce::RankEnv::from_env()
        .map_err(text)?
        .ok_or_else(|| "not started by `tp-allreduce launch` (TP_ALLREDUCE_RANK is not set)".into())
}

fn selftest_options(
    args: &SelftestArgs,
    env: &tp_allreduce::RankEnv,
) -> CliResult<tp_allreduce_cli::selftest::SelftestOptions> {
    let algorithms = match &args.algorithms {
        None => Algorithm::allreduce_algorithms().collect(),
        Some(list) => list.split(',').map(|a| a.parse::<Algorithm>().map_err(text)).collect::<CliResult<_>>()?,
    };
    let fault = match &args.fault {
        None => None,
        Some(f) => {
            let (r, k) = f.split_once(':').ok_or("--fault takes RANK:CALLS")?;
            Some((r.parse().map_err(|_| "bad fault rank")?, k.parse().map_err(|_| "bad fault call count")?))
        }
    };
    let delay_first_call = match &args.delay_first_call {
        None => None,
        Some(d) => {
            let (r, ms) = d.split_once(':').ok_or("--delay-first-call takes RANK:MILLISECONDS")?;
            let ms: u64 = ms.parse().map_err(|_| "bad delay in milliseconds")?;
            Some((r.parse().map_err(|_| "bad delay rank")?, std::time::Duration::from_millis(ms)))
        }
    };
    let job_seed = || u64::from_le_bytes(env.id.job_id()[..8].try_into().expect("8 bytes of the job id"));
    let seed = args.seed.or_else(tp_allreduce::env::test_seed).unwrap_or_else(job_seed);
    let mut config = Config::from_env().map_err(text)?;
    if args.island_size.is_some() {
        config.island_size = args.island_size;
    }
    let sizes: Vec<usize> = if args.quick {
        vec![2, 18, 4_096, 43_008, 262_142]
    } else {
        vec![2, 6, 18, 34, 1_000, 4_096, 16_386, 43_008, 65_538, 262_142, 1_048_578, 8_388_608]
    };
    Ok(tp_allreduce_cli::selftest::SelftestOptions {
        sizes,
        dtypes: DType::ALL.to_vec(),
        algorithms,
        graph_allreduces: if args.quick { 50 } else { 60 },
        graph_replays: args.replays.unwrap_or(if args.quick { 200 } else { 300 }),
        seed,
        fault,
        delay_first_call,
        config,
    })
}

fn selftest(args: SelftestArgs) -> CliResult {
    let env = rank_env()?;
    let opts = selftest_options(&args, &env)?;
    emit(format!("rank {}: seed {}\n", env.rank, opts.seed))?;
    let summary = tp_allreduce_cli::selftest::run(&env, &opts).map_err(|e| format!("rank {}: {e}", env.rank))?;
    emit(format!(
        "rank {}: selftest passed: {} eager cases, {} graph replays, {} registration rounds \
         ({} reused the previous round's addresses) ({:.1} s)\n",
        env.rank,
        summary.eager_cases,
        summary.graph_replays,
        summary.registration_rounds,
        summary.reused_addresses,
        summary.elapsed.as_secs_f64()
    ))
}

fn probe_rendezvous(rounds: usize) -> CliResult {
    let env = rank_env()?;
    let rdv = tp_allreduce::rendezvous::connect(&env.id, env.rank, env.world_size, std::time::Duration::from_secs(30))
        .map_err(text)?;
    for round in 0..rounds {
        let mine = format!("rank {} round {round} pid {}", env.rank, std::process::id()).into_bytes();
        let all = rdv.all_gather(&mine).map_err(text)?;
        for (r, got) in all.iter().enumerate() {
            let text = String::from_utf8_lossy(got);
            if !text.starts_with(&format!("rank {r} round {round} pid ")) {
                return Err(format!("round {round}: rank {r} sent {text:?}").into());
            }
        }
    }
    emit(format!("rank {}: {rounds} rendezvous rounds across {} processes ok\n", env.rank, env.world_size))
}

fn report_cmd(results: &std::path::Path, svg: Option<PathBuf>, compare: Option<PathBuf>) -> CliResult {
    let rep = report::read_json(results).map_err(text)?;
    let mut shown = report::render_table(&rep);
    if let Some(path) = svg {
        std::fs::write(&path, plot::render_svg(&rep)).map_err(|e| format!("writing {}: {e}", path.display()))?;
        shown += &format!("plot: {}\n", path.display());
    }
    if let Some(old) = compare {
        let old = report::read_json(&old).map_err(text)?;
        shown += &report::render_compare(&old, &rep);
    }
    emit(shown)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The library's records (measured `auto` says that it measures, for how
    // long, and what it chose) on stderr; TP_ALLREDUCE_LOG / RUST_LOG filter.
    if let Err(e) = tp_allreduce_cli::logger::install() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
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
        Ok(()) | Err(Failure::StdoutClosed) => ExitCode::SUCCESS,
        Err(Failure::Message(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
